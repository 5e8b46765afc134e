"""dflash2_hf.load_drafter: a drafter ready to draft for a target in one call (precision, device, target check, CPU
kernels), and what it says it chose."""

from __future__ import annotations

import pytest
import torch

from conftest import make_drafter, make_target
from dflash2_hf import DrafterTargetMismatchError, drafting_precision, load_drafter
from dflash2_hf.cpu_kernels import PrepackedLinear
from dflash2_hf.quantization import is_int8


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    target = make_target("llama")
    folder = tmp_path_factory.mktemp("drafter")
    make_drafter(target).save_pretrained(folder)
    return target, folder


def test_auto_precision_is_the_devices_cheapest_and_is_reported(saved):
    target, folder = saved
    draft = load_drafter(folder, target)
    precision, reason = drafting_precision(target.device)
    assert draft.dflash2_loading.startswith(f"{precision} (auto: {reason})")
    assert is_int8(draft) == (precision == "int8")
    assert not draft.training and draft.device == target.device
    prompt = torch.tensor([[3, 17, 42, 5, 3, 17]])
    plain = target.generate(prompt, do_sample=False, max_new_tokens=12)
    assert torch.equal(target.generate(prompt, assistant_model=draft, do_sample=False, max_new_tokens=12), plain)


def test_explicit_precision_and_stock_kernels(saved):
    target, folder = saved
    draft = load_drafter(folder, target, precision="fp32", cpu_kernels="stock")
    assert next(draft.parameters()).dtype == torch.float32 and not is_int8(draft)
    assert not any(type(m) is PrepackedLinear for m in draft.modules())
    assert draft.dflash2_loading.startswith("fp32; ")
    optimized = load_drafter(folder, target, precision="fp32")
    assert any(type(m) is PrepackedLinear for m in optimized.modules()) or "no " in optimized.dflash2_loading
    fresh = load_drafter("fresh", target, precision="fp32", num_hidden_layers=1)
    assert fresh.config.num_hidden_layers == 1


def test_the_cli_and_load_drafter_resolve_precision_the_same_way(saved, monkeypatch):
    """One rule for ``--drafter-dtype`` and ``precision=``: the same dtype, int8 choice and label, aliases included;
    an emulated bf16 keeps the user's choice and says so; int8 where it cannot run names the reason and the fix."""
    from dflash2_hf.cli import resolve_drafter_dtype
    from dflash2_hf.generation.precision import resolve_drafting_precision

    target, folder = saved
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    for spec in ("auto", "int8", "bf16", "bfloat16", "fp32", "float32"):
        precision, label = resolve_drafting_precision(spec, "cpu")
        dtype, int8, cli_label = resolve_drafter_dtype(spec, "cpu")
        assert cli_label == label and int8 == (precision == "int8")
        assert dtype == (torch.bfloat16 if precision == "bf16" else torch.float32)
    assert resolve_drafting_precision("bfloat16", "cpu") == (
        "bf16", "bf16 (explicit; no native bf16 on this CPU: emulated, slower than fp32)")
    draft = load_drafter(folder, target, precision="float32", cpu_kernels="stock")
    assert next(draft.parameters()).dtype == torch.float32 and draft.dflash2_loading.startswith("fp32; ")
    with pytest.raises(ValueError, match="int8 drafting runs on the CPU only.*; use fp32 or bf16"):
        resolve_drafting_precision("int8", "meta")
    with pytest.raises(ValueError, match="--drafter-dtype int8: int8 drafting runs on the CPU only"):
        resolve_drafter_dtype("int8", "meta")
    with pytest.raises(ValueError, match="unknown drafting precision 'fp16'"):
        resolve_drafting_precision("fp16", "cpu")


def test_bad_arguments_and_another_targets_drafter_are_refused(saved):
    target, folder = saved
    with pytest.raises(ValueError, match="precision='fp16' is not one of auto, int8, bf16, fp32"):
        load_drafter(folder, target, precision="fp16")
    with pytest.raises(ValueError, match="cpu_kernels='fast'"):
        load_drafter(folder, target, cpu_kernels="fast")
    other = make_target("llama", hidden_size=96)
    with pytest.raises(DrafterTargetMismatchError, match="built for another target"):
        load_drafter(folder, other)


def test_wrong_kinds_and_stray_keywords_are_refused_before_loading(saved):
    from dflash2_hf import DrafterArgumentTypeError

    target, folder = saved
    for bad in ("smollm2", target.config, None, make_drafter(target)):
        with pytest.raises(DrafterArgumentTypeError, match="target must be the loaded transformers causal LM"):
            load_drafter(folder, bad)
    with pytest.raises(DrafterArgumentTypeError, match="load_target\\('smollm2'\\)"):
        load_drafter(folder, "smollm2")
    with pytest.raises(DrafterArgumentTypeError, match="name_or_path must be a folder"):
        load_drafter(None, target)
    with pytest.raises(DrafterArgumentTypeError, match="Did you mean precision=\\?"):
        load_drafter(folder, target, precison="fp32")
    with pytest.raises(DrafterArgumentTypeError, match="precision="):
        load_drafter(folder, target, dtype=torch.float32)
    with pytest.raises(DrafterArgumentTypeError, match="'fresh' drafter only"):
        load_drafter(folder, target, num_hidden_layers=3)


def test_an_adapter_folder_names_its_base_and_forward_refuses_token_ids(saved, tmp_path):
    from dflash2_hf import CheckpointError, DFlash2DraftModel

    target, folder = saved
    (tmp_path / "adapter_config.json").write_text('{"base_model_name_or_path": "org/base-drafter"}')
    with pytest.raises(CheckpointError, match="load_drafter\\('org/base-drafter', target, adapter=.*--drafter org/base-drafter --adapter"):
        DFlash2DraftModel.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="forward takes block embeddings .*assistant_model=draft"):
        load_drafter(folder, target, precision="fp32")(torch.tensor([[1, 2, 3]]))


def test_an_adapter_is_merged_before_the_precision_is_applied(saved, tmp_path):
    """``load_drafter(..., adapter=...)`` drafts with the adapter merged (in float, then int8 where auto picks it),
    says so in ``dflash2_loading``, and refuses another drafter's adapter."""
    from conftest import make_drafter as make
    from dflash2_hf import DFlash2DraftModel, add_lora, load_adapter
    from dflash2_hf.lora import AdapterMismatchError, save_adapter

    target, folder = saved
    adapted = add_lora(DFlash2DraftModel.from_pretrained(folder))
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    save_adapter(adapted, tmp_path / "adapter")
    draft = load_drafter(folder, target, precision="fp32", adapter=tmp_path / "adapter")
    assert "LoRA adapter" in draft.dflash2_loading and "merged" in draft.dflash2_loading
    reference = load_adapter(DFlash2DraftModel.from_pretrained(folder), tmp_path / "adapter").merge_and_unload()
    for name, p in reference.state_dict().items():
        torch.testing.assert_close(draft.state_dict()[name], p)
    auto = load_drafter(folder, target, adapter=tmp_path / "adapter")
    assert is_int8(auto) == (drafting_precision(target.device)[0] == "int8")
    prompt = torch.tensor([[3, 17, 42, 5, 3, 17]])
    plain = target.generate(prompt, do_sample=False, max_new_tokens=12)
    assert torch.equal(target.generate(prompt, assistant_model=auto, do_sample=False, max_new_tokens=12), plain)
    other = tmp_path / "other"
    make(target, num_hidden_layers=1).save_pretrained(other)
    with pytest.raises(AdapterMismatchError, match="trained for another drafter"):
        load_drafter(other, target, adapter=tmp_path / "adapter")
