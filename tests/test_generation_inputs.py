"""Every input form generate() accepts decodes exactly as plain decoding, or is refused with a clear error:
inputs_embeds, padding masks, passed caches, cache implementations, GenerationConfig objects, length limits."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, GenerationConfig, StaticCache

from dflash2_hf import UnsupportedGenerationError
from dflash2_hf.generation import candidate_generator as cg
from dflash2_hf.generation.inputs import PromptLayout
from conftest import Oracle, make_drafter

PROMPT = 9
PADS = 3


def _prompt(seed: int = 4) -> torch.LongTensor:
    return torch.randint(6, 96, (1, PROMPT), generator=torch.Generator().manual_seed(seed))


def _left_pad_mask() -> torch.LongTensor:
    mask = torch.ones(1, PROMPT, dtype=torch.long)
    mask[0, :PADS] = 0
    return mask


def _exact(target, drafter, monkeypatch, **kw):
    """Plain == speculative with the random drafter, and with oracle drafts (long accepted blocks); returns the
    oracle run's acceptance lengths."""
    ref = target.generate(do_sample=False, **kw)
    assert torch.equal(ref, target.generate(do_sample=False, assistant_model=drafter, **kw))
    with monkeypatch.context() as patch:
        Oracle(ref, lambda c: [None, 2][c % 2]).install(patch)
        assert torch.equal(ref, target.generate(do_sample=False, assistant_model=drafter, **kw))
    return drafter.generation_stats.acceptance_lengths


def _first_proposal(target, drafter, monkeypatch, **kw) -> list[int]:
    """The drafter's first proposed path (it depends on the context features it was given)."""
    seen = []
    original = cg.DFlash2CandidateGenerator.propose

    def spy(gen, input_ids, n):
        proposal = original(gen, input_ids, n)
        seen.append(proposal.tokens[0].tolist())
        return proposal

    with monkeypatch.context() as patch:
        patch.setattr(cg.DFlash2CandidateGenerator, "propose", spy)
        target.generate(do_sample=False, assistant_model=drafter, **{**kw, "max_new_tokens": 4})
    return seen[0]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("padded", [False, True])
def test_inputs_embeds_prompt_is_exact_and_feeds_the_drafter(targets, monkeypatch, arch, padded):
    """Regression (issue 15.2): with inputs_embeds and a padding mask the output differed from the first token (the
    masks were sized from input_ids, which holds only generated tokens, and the drafter got no prompt context)."""
    target = targets[arch]
    drafter = make_drafter(target)
    ids = _prompt()
    embeds = target.get_input_embeddings()(ids).detach()
    mask = _left_pad_mask() if padded else None
    kw = dict(inputs_embeds=embeds, max_new_tokens=20, **({"attention_mask": mask} if padded else {}))
    lengths = _exact(target, drafter, monkeypatch, **kw)
    assert drafter.config.block_size in lengths
    # the drafter saw the prompt's (unpadded) hidden states: it proposes what it proposes for the bare token prompt
    assert _first_proposal(target, drafter, monkeypatch, **kw) == _first_proposal(
        target, drafter, monkeypatch, input_ids=ids[:, PADS:] if padded else ids
    )


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_left_padded_input_ids_are_exact_and_padding_stays_out_of_the_context(targets, monkeypatch, arch):
    target = targets[arch]
    drafter = make_drafter(target)
    ids = _prompt(5)
    ids[0, :PADS] = 0  # pad token
    kw = dict(input_ids=ids, attention_mask=_left_pad_mask(), max_new_tokens=20)
    assert drafter.config.block_size in _exact(target, drafter, monkeypatch, **kw)
    assert _first_proposal(target, drafter, monkeypatch, **kw) == _first_proposal(
        target, drafter, monkeypatch, input_ids=ids[:, PADS:]
    )


def test_prompt_layout_of_embeds_and_masks():
    ids, embeds = torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, PROMPT, 4)
    layout = PromptLayout.of(ids, {"inputs_embeds": embeds, "attention_mask": _left_pad_mask()})
    assert layout.offset == PROMPT and layout.hidden_positions == PADS and layout.visible.tolist() == [False] * 3 + [True] * 6
    assert PromptLayout.of(_prompt(), {"attention_mask": torch.ones(1, PROMPT)}) == PromptLayout(0, None)
    with pytest.raises(UnsupportedGenerationError, match=r"attention mask has shape \(1, 5\).*9 positions.*2-D"):
        PromptLayout.of(ids, {"inputs_embeds": embeds, "attention_mask": torch.ones(1, 5)})
    with pytest.raises(UnsupportedGenerationError, match="inputs_embeds covers 9 positions but input_ids 12"):
        PromptLayout.of(torch.zeros(1, 12, dtype=torch.long), {"inputs_embeds": embeds})


def test_a_cache_that_cannot_roll_back_is_refused(targets, monkeypatch):
    """Regression (issue 15.4): a quantized cache died with IndexError inside crop."""
    target = targets["llama"]
    drafter = make_drafter(target)
    kw = dict(max_new_tokens=6, cache_implementation="quantized", cache_config={"backend": "fp8"})
    target.generate(_prompt(), **kw)  # plain decoding serves it
    with pytest.raises(ValueError, match=r"QuantizedCache \(cache_implementation='quantized'\).*Fp8QuantizedLayer.*"
                                         r"default dynamic cache.*DynamicCache\(\)"):
        target.generate(_prompt(), assistant_model=drafter, **kw)
    # transformers 5.23 marks quantized layers croppable although crop fails on them: refused all the same
    from transformers.cache_utils import BaseQuantizedLayer

    monkeypatch.setattr(BaseQuantizedLayer, "is_croppable", True, raising=False)
    with pytest.raises(UnsupportedGenerationError, match="Fp8QuantizedLayer"):
        target.generate(_prompt(), assistant_model=drafter, **kw)


def test_static_caches_are_exact_or_refused(targets, monkeypatch):
    """A static cache rolls back (exact); a static sliding-window layer longer than its window cannot (refused)."""
    llama, gemma = targets["llama"], targets["gemma3"]
    assert make_drafter(llama).config.block_size in _exact(
        llama, make_drafter(llama), monkeypatch, input_ids=_prompt(), max_new_tokens=20, cache_implementation="static"
    )
    with pytest.raises(UnsupportedGenerationError, match="StaticCache.*StaticSlidingWindowLayer"):
        gemma.generate(_prompt(), assistant_model=make_drafter(gemma), max_new_tokens=20, cache_implementation="static")


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")  # 5.24 renamed it to cache
@pytest.mark.parametrize("key", ["cache", "past_key_values"])
def test_a_passed_empty_cache_is_exact_and_a_prefilled_one_refused(targets, key):
    ids = _prompt()
    caches = {"gemma3": lambda t: DynamicCache(config=t.config), "llama": lambda t: StaticCache(config=t.config, max_cache_len=64)}
    for arch, make in caches.items():
        target = targets[arch]
        ref = target.generate(ids, max_new_tokens=12, do_sample=False, **{key: make(target)})
        out = target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=make_drafter(target),
                              **{key: make(target)})
        assert torch.equal(ref, out), arch
    target = targets["gemma3"]
    prefilled = DynamicCache(config=target.config)
    with torch.no_grad():
        target(ids[:, :5], cache=prefilled)
    with pytest.raises(UnsupportedGenerationError, match="pre-filled target cache.*whole prompt without a cache"):
        target.generate(ids, assistant_model=make_drafter(target), max_new_tokens=4, **{key: prefilled})


def test_generation_config_objects_and_length_limits(targets, monkeypatch):
    """A GenerationConfig object, max_length instead of max_new_tokens (cut inside a block), min_new_tokens
    suppressing an EOS that the drafts contain."""
    target = targets["qwen3"]
    drafter = make_drafter(target)
    ids = _prompt()
    config = GenerationConfig(max_new_tokens=17, do_sample=False, eos_token_id=None, pad_token_id=0)
    _exact(target, drafter, monkeypatch, input_ids=ids, generation_config=config)
    assert drafter.generation_stats.new_tokens == 17
    _exact(target, drafter, monkeypatch, input_ids=ids, max_length=PROMPT + 10, eos_token_id=None)
    assert drafter.generation_stats.new_tokens == 10 and drafter.generation_stats.acceptance_lengths[-1] < 6
    free = target.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None)[0, PROMPT:].tolist()
    eos = free[2]
    lengths = _exact(target, drafter, monkeypatch, input_ids=ids, max_new_tokens=20, min_new_tokens=8, eos_token_id=eos)
    assert free.index(eos) < 7 and max(lengths) > 2


def test_prefill_chunk_size_and_use_cache(targets, monkeypatch):
    target = targets["llama"]
    drafter = make_drafter(target)
    _exact(target, drafter, monkeypatch, input_ids=_prompt(), max_new_tokens=12, prefill_chunk_size=4)  # one prefill
    with pytest.raises(UnsupportedGenerationError, match="use_cache=True"):
        target.generate(_prompt(), assistant_model=drafter, max_new_tokens=3, use_cache=False)
