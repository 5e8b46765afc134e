"""Inputs are checked where they enter: one-line errors of our own ValueError / TypeError subclasses that name the
problem and the fix (issue 40)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaModel

from dflash2_hf import DFlash2Config, DFlash2DraftModel
from dflash2_hf.errors import CheckpointError, DrafterArgumentTypeError, DrafterConfigError, TargetConfigError
from conftest import make_target


@pytest.fixture(scope="module")
def llama():
    return make_target("llama")


@pytest.mark.parametrize("overrides, match", [
    ({"num_hidden_layers": -1}, "num_hidden_layers=-1: must be >= 1"),
    ({"num_hidden_layers": 0}, "num_hidden_layers=0: must be >= 1"),
    ({"blok_size": 8}, "unknown override 'blok_size' .did you mean 'block_size'"),
    ({"block_size": 1}, "block_size must be >= 2"),
])
def test_from_target_refuses_bad_overrides(llama, overrides, match):
    with pytest.raises(DrafterConfigError, match=match) as err:
        DFlash2DraftModel.from_target(llama, **overrides)
    assert isinstance(err.value, ValueError) and "\n" not in str(err.value)


@pytest.mark.parametrize("bad, match", [
    ("org/name", "got the string 'org/name': load it first"),
    (LlamaConfig(), "got a LlamaConfig"),
    (42, "got int"),
])
def test_from_target_refuses_what_is_not_a_model(bad, match):
    with pytest.raises(DrafterArgumentTypeError, match=match) as err:
        DFlash2DraftModel.from_target(bad)
    assert isinstance(err.value, TypeError)


def test_from_target_refuses_a_base_model_without_lm_head(llama):
    base = LlamaModel(llama.config)
    with pytest.raises(TargetConfigError, match="LlamaModel has no LM head.*AutoModelForCausalLM"):
        DFlash2DraftModel.from_target(base)


@pytest.mark.parametrize("name, dtype", [("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16),
                                         ("float32", torch.float32), ("torch.float16", torch.float16)])
def test_from_target_accepts_dtype_names(llama, name, dtype):
    drafter = DFlash2DraftModel.from_target(llama, dtype=name, num_hidden_layers=1)
    assert drafter.fc.weight.dtype == dtype
    assert drafter.rotary_emb.inv_freq.dtype == torch.float32


def test_from_target_refuses_unknown_dtypes(llama):
    with pytest.raises(DrafterConfigError, match="unknown dtype 'bfloat61'"):
        DFlash2DraftModel.from_target(llama, dtype="bfloat61")
    with pytest.raises(DrafterArgumentTypeError, match="dtype must be a torch.dtype"):
        DFlash2DraftModel.from_target(llama, dtype=16)


@pytest.mark.parametrize("kwargs, match", [
    ({"block_size": 1}, "block_size must be >= 2"),
    ({"hidden_size": "a"}, "hidden_size='a' must be an integer"),
    ({"num_attention_heads": 0}, "num_attention_heads=0: must be >= 1"),
    ({"vocab_size": 96, "mask_token_id": 500}, "mask_token_id=500 is outside"),
])
def test_config_values_raise_our_value_error(kwargs, match):
    with pytest.raises(DrafterConfigError, match=match) as err:
        DFlash2Config(**kwargs)
    assert isinstance(err.value, ValueError)
    assert "StrictDataclass" not in type(err.value).__name__


def test_config_checked_again_on_save(tmp_path):
    config = DFlash2Config()
    config.block_size = 1  # set after init: the save-time check catches it, as our error
    with pytest.raises(DrafterConfigError, match="block_size must be >= 2"):
        config.save_pretrained(tmp_path)


def test_llama_folder_is_not_a_drafter(llama, tmp_path, capfd):
    llama.save_pretrained(tmp_path / "llama")
    capfd.readouterr()
    with pytest.raises(CheckpointError, match="this is a llama model, not a dflash2 drafter"):
        DFlash2DraftModel.from_pretrained(tmp_path / "llama")
    printed = capfd.readouterr()
    assert "LOAD REPORT" not in printed.out + printed.err  # refused before transformers reads the weights


def test_published_config_errors_are_ours_too():
    published = {"model_type": "qwen3", "architectures": ["DFlash2DraftModel"], "num_target_layers": 6,
                 "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1, "vocab_size": 96,
                 "dflash_config": {"block_size": "16", "mask_token_id": 0, "target_layer_ids": [1]}}
    with pytest.raises(DrafterConfigError, match="block_size"):
        DFlash2Config.from_dict(published)
