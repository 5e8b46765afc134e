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


def test_bad_arguments_and_another_targets_drafter_are_refused(saved):
    target, folder = saved
    with pytest.raises(ValueError, match="precision='fp16' is not one of auto, int8, bf16, fp32"):
        load_drafter(folder, target, precision="fp16")
    with pytest.raises(ValueError, match="cpu_kernels='fast'"):
        load_drafter(folder, target, cpu_kernels="fast")
    other = make_target("llama", hidden_size=96)
    with pytest.raises(DrafterTargetMismatchError, match="built for another target"):
        load_drafter(folder, other)
