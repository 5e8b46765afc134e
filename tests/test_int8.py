"""int8 drafting (dflash2_hf.quantization): lossless, close to the float drafter, refused where it cannot work."""

from __future__ import annotations

import copy

import pytest
import torch

import dflash2_hf
from conftest import Oracle, make_drafter, make_target, randomize_selector
from torch import nn

from dflash2_hf.bench import load_drafter
from dflash2_hf.cli import resolve_drafter_dtype
from dflash2_hf.errors import UnsupportedGenerationError
from dflash2_hf.generation import GenerationStats, candidate_generator as cg
from dflash2_hf.quantization import int8_support, is_int8, parameter_count, quantize_drafter

pytestmark = pytest.mark.skipif(not int8_support("cpu")[0], reason="no x86/fbgemm int8 kernels in this torch")


def _prompt(length: int, seed: int) -> torch.LongTensor:
    return torch.randint(6, 96, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def pair(targets):
    target = targets["llama"]
    drafter = randomize_selector(make_drafter(target), scale=1.0)
    return target, drafter, quantize_drafter(copy.deepcopy(drafter))


def test_every_linear_of_the_layers_is_int8_and_the_fusion_and_selector_stay_float(pair):
    _, drafter, q = pair
    assert is_int8(q) and not is_int8(drafter)
    dense = [name for name, m in q.named_modules() if type(m) is nn.Linear]
    assert dense == ["fc", "candidate_selector.hidden_projection"]
    quantized = [name for name, m in q.named_modules() if isinstance(m, torch.ao.nn.quantized.dynamic.Linear)]
    assert all(n.startswith("layers.") for n in quantized)
    assert len(quantized) == len(q.layers) * (7 + 2)  # q,k,v,o, gate,up,down, 2 convs
    # the packed int8 weights are no nn.Parameter: parameter_count (the bench's drafter size) still counts them
    assert sum(p.numel() for p in q.parameters()) < parameter_count(q) == parameter_count(drafter)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_int8_drafting_is_lossless(targets, arch):
    target = targets[arch]
    q = quantize_drafter(randomize_selector(make_drafter(target), scale=1.0))
    for length, new, seed in [(5, 30, 0), (12, 23, 1)]:
        ids = _prompt(length, seed)
        ref = target.generate(ids, max_new_tokens=new, do_sample=False)
        assert torch.equal(target.generate(ids, assistant_model=q, max_new_tokens=new, do_sample=False), ref)


def test_int8_accepts_long_blocks_losslessly(targets, monkeypatch):
    """Forced-acceptance drafts (the int8 drafter still runs and keeps its cache): identical output, long blocks."""
    target = targets["llama"]
    q = quantize_drafter(make_drafter(target))
    ids = _prompt(7, 3)
    ref = target.generate(ids, max_new_tokens=40, do_sample=False)
    Oracle(ref, wrong_slot_per_cycle=lambda c: 2 if c % 3 == 0 else None).install(monkeypatch)
    out = target.generate(ids, assistant_model=q, max_new_tokens=40, do_sample=False)
    assert torch.equal(out, ref)
    assert max(q.generation_stats.acceptance_lengths) == q.config.block_size


@pytest.mark.parametrize("first_token_scale", [1.0, 500.0])
def test_int8_proposals_are_close_to_the_float_drafter(pair, first_token_scale):
    """Same hidden states up to int8 rounding: the draft logits agree closely (so acceptance barely moves). Also when
    the first context token carries "massive activations" (x500, as real targets' first tokens do: SmolLM2 ~25,000 vs
    ~100-450): one int8 activation scale over the context would round every other token's features away."""
    target, drafter, q = pair
    ids = _prompt(20, 5)
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
    hs = tuple(torch.cat([h[:, :1] * first_token_scale, h[:, 1:]], dim=1) for h in hs)
    logits = {}
    for name, model in (("fp32", drafter), ("int8", q)):
        gen = cg.DFlash2CandidateGenerator(model, target, False, 1.0, True, GenerationStats(block_size=6))
        gen.add_context(hs, ids.shape[1] - 1)
        block = torch.cat([ids[:, -1:], gen.mask_ids], dim=1)
        embeds = model.embed_block(block, gen.embedding_weight)
        with torch.no_grad():
            hidden = model(embeds, gen.pending[0], cache=gen.cache).last_hidden_state
        logits[name] = model.compute_logits(hidden, gen.lm_head)
    rel = (logits["int8"] - logits["fp32"]).norm() / logits["fp32"].norm()
    assert 0 < rel < 0.05, rel  # int8 really ran (not the float weights), and stays within a few percent


def test_refusals(targets, tmp_path):
    target = targets["llama"]
    with pytest.raises(UnsupportedGenerationError, match="float32 drafter"):
        quantize_drafter(make_drafter(target).to(torch.bfloat16))
    q = quantize_drafter(make_drafter(target))
    with pytest.raises(UnsupportedGenerationError, match="already quantized"):
        quantize_drafter(q)
    with pytest.raises(UnsupportedGenerationError, match="cannot be saved"):
        q.save_pretrained(tmp_path / "q")
    assert not (tmp_path / "q").exists()
    from dflash2_hf.lora import add_lora

    with pytest.raises(UnsupportedGenerationError, match="cannot be given a LoRA adapter"):
        add_lora(q)
    with pytest.raises(UnsupportedGenerationError, match="merge the adapter first"):
        quantize_drafter(add_lora(make_drafter(target)))
    from dflash2_hf.training import DFlash2Trainer

    with pytest.raises(UnsupportedGenerationError, match="cannot be trained"):
        DFlash2Trainer(model=q, target=target)


def test_load_drafter_int8_and_the_cli_choice(targets, monkeypatch):
    target = targets["llama"]
    assert is_int8(load_drafter("fresh", target, int8=True, num_hidden_layers=1))
    assert resolve_drafter_dtype("int8", "cpu") == (torch.float32, True, "int8")
    assert resolve_drafter_dtype("fp32", "cpu") == (torch.float32, False, "fp32")
    with pytest.raises(ValueError, match="CPU only"):
        resolve_drafter_dtype("int8", "meta")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    dtype, int8, label = resolve_drafter_dtype("auto", "cpu")
    assert (dtype, int8) == (torch.float32, True) and label == "int8 (auto: x86 int8 on this CPU)"
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert resolve_drafter_dtype("auto", "cpu")[:2] == (torch.float32, True)  # int8 reads fewer bytes than bf16 too
    assert dflash2_hf.drafting_precision("cpu")[0] == "int8"
    monkeypatch.setattr(dflash2_hf.quantization, "int8_support", lambda device: (False, "no int8 kernels"))
    assert resolve_drafter_dtype("auto", "cpu") == (torch.bfloat16, False, "bf16 (auto: AMX on this CPU; no int8 kernels)")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    assert dflash2_hf.drafting_precision("cpu")[0] == "fp32"
    assert dflash2_hf.drafting_precision("meta")[0] == "bf16"  # not a CPU: no int8 kernels, the device's own bf16


def test_int8_sampling_stays_exact():
    """Rejection sampling with the int8 drafter's own q: the 2nd/3rd token marginals match the exact ones."""
    from test_generation_sampling import THRESHOLD, _empirical, _exact_marginals, _tv, sampling_models

    target, drafter, prompt = sampling_models()
    q = quantize_drafter(drafter)
    p2, p3 = _exact_marginals(target, prompt)
    torch.manual_seed(6)
    emp, accepted = _empirical(target, q, prompt, draws=1000)
    assert accepted > 0.3
    assert _tv(emp[0], p2) < THRESHOLD and _tv(emp[1], p3) < THRESHOLD, (emp, p2, p3)


@pytest.mark.parametrize("int8", [False, True])
def test_biased_lm_head_with_a_draft_vocabulary(targets, int8):
    """A target LM head with a bias keeps its bias rows for the draft vocabulary (float and int8 drafting)."""
    target = make_target("llama")
    old = target.lm_head
    target.lm_head = nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        target.lm_head.weight.copy_(old.weight)
        target.lm_head.bias.copy_(torch.randn(old.out_features, generator=torch.Generator().manual_seed(0)))
    drafter = randomize_selector(make_drafter(target), scale=1.0)
    drafter.set_draft_vocab(list(range(0, old.out_features, 3)))
    if int8:
        drafter = quantize_drafter(drafter)
    head = cg.lm_head_for_drafter(target, drafter)
    x = torch.randn(4, old.in_features)
    rows = drafter.draft_vocab_ids
    expected = x @ target.lm_head.weight[rows].T + target.lm_head.bias[rows]
    torch.testing.assert_close(drafter.compute_logits(x, head), expected, atol=0.05 if int8 else 1e-5, rtol=0.05)
    ids = _prompt(7, 2)
    ref = target.generate(ids, max_new_tokens=30, do_sample=False)
    assert torch.equal(target.generate(ids, assistant_model=drafter, max_new_tokens=30, do_sample=False), ref)


def test_an_int8_copy_moved_or_cast_is_refused_before_decoding(targets):
    target = targets["llama"]
    q = quantize_drafter(make_drafter(target)).to(torch.bfloat16)
    with pytest.raises(UnsupportedGenerationError, match="int8 drafting runs in float32 on the CPU only"):
        target.generate(_prompt(5, 0), assistant_model=q, max_new_tokens=5, do_sample=False)


def test_push_to_hub_refuses_an_int8_copy_before_any_hub_call(targets, monkeypatch):
    from huggingface_hub import HfApi, ModelCard

    calls = []
    monkeypatch.setattr(HfApi, "create_repo", lambda self, *a, **k: calls.append("create_repo"))
    monkeypatch.setattr(HfApi, "upload_folder", lambda self, *a, **k: calls.append("upload_folder"))
    q = quantize_drafter(make_drafter(targets["llama"]))
    with pytest.raises(UnsupportedGenerationError, match="cannot be pushed to the Hub"):
        q.push_to_hub("me/x", model_card=ModelCard("---\nlicense: mit\n---\n# x"))
    assert calls == []
