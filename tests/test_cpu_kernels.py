"""optimize_for_cpu: prepacked oneDNN linears that compute what stock linears compute, never with stale weights, and
leave parameters, state_dict, ties, training and generation output as they were."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from conftest import make_drafter, make_target
from dflash2_hf import cpu_kernels as ck
from dflash2_hf.cpu_kernels import (
    PrepackedLinear,
    cpu_kernels_summary,
    is_optimized,
    optimize_for_cpu,
    restore_stock_kernels,
    stock_kernels,
)

pytestmark = pytest.mark.skipif(not ck.kernels_available()[0], reason="this torch build has no oneDNN linears")


def _linears(model):
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


@pytest.fixture
def target():
    return make_target("llama", seed=3)


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_computes_what_the_stock_linear_computes(rows, bias):
    torch.manual_seed(rows)
    layer = nn.Linear(48, 80, bias=bias)
    x = torch.randn(1, rows, 48)
    expected = layer(x)
    optimize_for_cpu(layer)
    assert type(layer) is PrepackedLinear
    with torch.no_grad():
        for one_row_packed in (True, False):  # both kernels of the one-row choice
            ck._ONE_ROW_CHOICE.update({key: one_row_packed for key in ck._ONE_ROW_CHOICE})
            layer._dflash2_one_row = None  # the module keeps its answer: ask the table again
            torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    assert layer._dflash2_packed is not None  # the packed path really ran


def test_a_weight_changed_after_packing_is_repacked_never_stale(target):
    optimize_for_cpu(target)
    layer = target.model.layers[0].mlp.up_proj
    x = torch.randn(1, 4, layer.in_features)
    with torch.no_grad():
        layer(x)
        first = layer._dflash2_packed[1]
        layer.weight.mul_(2.0)  # in place, as load_state_dict / copy_ do
        torch.testing.assert_close(layer(x), nn.functional.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
        assert layer._dflash2_packed[1] is not first
        layer.weight = nn.Parameter(torch.randn_like(layer.weight))  # replaced
        torch.testing.assert_close(layer(x), nn.functional.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
        target.load_state_dict(make_target("llama", seed=4).state_dict())
        torch.testing.assert_close(layer(x), nn.functional.linear(x, layer.weight), rtol=1e-5, atol=1e-5)


def test_state_dict_ties_and_saving_are_unchanged(target, tmp_path):
    before = {k: v.clone() for k, v in target.state_dict().items()}
    tied = target.lm_head.weight is target.model.embed_tokens.weight
    returned = optimize_for_cpu(target)
    assert returned is target
    with torch.no_grad():
        target(torch.tensor([[7, 8, 9]]))
    after = target.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert (target.lm_head.weight is target.model.embed_tokens.weight) == tied
    target.save_pretrained(tmp_path)
    reloaded = type(target).from_pretrained(tmp_path)
    assert all(torch.equal(reloaded.state_dict()[k], before[k]) for k in before)
    assert not is_optimized(reloaded)
    copy.deepcopy(target)
    pickle.loads(pickle.dumps(target))  # the opaque packed copies are left out and rebuilt on first use


def test_idempotent_report_and_undo(target):
    optimize_for_cpu(target)
    report = target.dflash2_cpu_kernels
    assert len(report.packed) == len(_linears(target)) and not report.skipped
    assert report.extra_bytes == sum(m.weight.numel() * 4 for m in _linears(target))
    assert cpu_kernels_summary(target).startswith(f"prepacked oneDNN linears for {len(report.packed)} of")
    optimize_for_cpu(target)
    assert target.dflash2_cpu_kernels.packed == report.packed
    with stock_kernels(target):
        assert not is_optimized(target)
    assert is_optimized(target)
    optimize_for_cpu(target, kernels="stock")
    assert not is_optimized(target) and all(type(m) is nn.Linear for m in _linears(target))
    assert all("_dflash2_packed" not in m.__dict__ for m in _linears(target))
    assert cpu_kernels_summary(target).startswith("stock CPU kernels")


def test_training_still_gets_gradients_through_stock_kernels(target):
    reference = copy.deepcopy(target)
    optimize_for_cpu(target)
    ids = torch.tensor([[7, 8, 9, 10]])
    target(ids, labels=ids).loss.backward()
    reference(ids, labels=ids).loss.backward()
    for (name, p), (_, q) in zip(target.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_bf16_is_packed_only_where_this_cpu_computes_it():
    layer = nn.Linear(32, 32).to(torch.bfloat16)
    optimize_for_cpu(layer)
    native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert is_optimized(layer) == native
    if not native:
        assert "no native bf16" in layer.dflash2_cpu_kernels.reason
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(layer(x).float(), nn.functional.linear(x, layer.weight, layer.bias).float(),
                                   rtol=2e-2, atol=2e-2)


def test_bad_arguments_are_refused():
    with pytest.raises(TypeError, match="takes a torch nn.Module"):
        optimize_for_cpu("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(ValueError, match="kernels='fast' is not one of optimized, stock"):
        optimize_for_cpu(nn.Linear(2, 2), kernels="fast")


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_generation_on_optimized_models_is_identical_to_stock_plain(arch):
    target = make_target(arch, seed=1)
    drafter = make_drafter(target)
    prompt = torch.randint(6, 96, (1, 11), generator=torch.Generator().manual_seed(5))
    plain = target.generate(prompt, do_sample=False, max_new_tokens=30)
    optimize_for_cpu(target)
    optimize_for_cpu(drafter)
    assert is_optimized(drafter)
    assert torch.equal(target.generate(prompt, do_sample=False, max_new_tokens=30), plain)
    assert torch.equal(target.generate(prompt, assistant_model=drafter, do_sample=False, max_new_tokens=30), plain)


def test_int8_drafting_copies_keep_their_quantized_linears():
    from dflash2_hf.quantization import int8_support, is_quantized_linear, quantize_drafter

    if not int8_support("cpu")[0]:
        pytest.skip("no int8 kernels on this CPU")
    target = make_target("llama", seed=2)
    drafter = quantize_drafter(make_drafter(target))
    quantized = [name for name, m in drafter.named_modules() if is_quantized_linear(m)]
    optimize_for_cpu(drafter)
    assert quantized and quantized == [name for name, m in drafter.named_modules() if is_quantized_linear(m)]
    assert drafter.dflash2_cpu_kernels.packed == ["fc", "candidate_selector.hidden_projection"]  # float ones
    prompt = torch.tensor([[9, 10, 11, 12, 13]])
    plain = target.generate(prompt, do_sample=False, max_new_tokens=12)
    assert torch.equal(target.generate(prompt, assistant_model=drafter, do_sample=False, max_new_tokens=12), plain)
