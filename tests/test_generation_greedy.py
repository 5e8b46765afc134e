"""Greedy speculative generation is token-for-token identical to the target's own greedy generation."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from dflash2_hf.generation import candidate_generator as cg
from dflash2_hf.generation.decoding import COPY_MAX_TOKENS
from conftest import Oracle, make_drafter, randomize_convs, randomize_selector

ARCHS = ("llama", "qwen3", "gemma3")
# (selector on?, convolutions on?) — randomised so both really change the drafts
VARIANTS = list(itertools.product((True, False), (True, False)))
# (prompt length, max_new_tokens, seed)
CASES = [(5, 1, 0), (9, 17, 1), (16, 40, 2), (3, 6, 3), (24, 25, 4)]


def _drafter(target, selector: bool, conv: bool):
    d = make_drafter(target, use_candidate_selector=selector, use_local_conv=conv)
    if selector:
        randomize_selector(d)
    if conv:
        randomize_convs(d)
    return d


def _prompt(length: int, seed: int) -> torch.LongTensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(6, 96, (1, length), generator=g)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("selector,conv", VARIANTS)
def test_greedy_identity_random_drafter(targets, arch, selector, conv):
    """3 architectures x 4 drafter variants x 5 prompt/length/seed cases = 60 combinations."""
    target = targets[arch]
    drafter = _drafter(target, selector, conv)
    for length, new, seed in CASES:
        ids = _prompt(length, seed)
        ref = target.generate(ids, max_new_tokens=new, do_sample=False)
        out = target.generate(ids, assistant_model=drafter, max_new_tokens=new, do_sample=False)
        assert torch.equal(ref, out), (arch, selector, conv, length, new, seed)
        stats = drafter.generation_stats
        assert stats.new_tokens == out.shape[1] - length
        # every cycle emits >= 1 and <= B tokens (a copy from the context: <= COPY_MAX_TOKENS + 1); tokens add up to
        # what was generated (the first comes from prefill)
        limits = [COPY_MAX_TOKENS + 1 if c else drafter.config.block_size for c in stats.copied]
        assert all(1 <= a <= lim for a, lim in zip(stats.acceptance_lengths, limits, strict=True))
        assert 1 + sum(stats.acceptance_lengths) == stats.new_tokens


@pytest.mark.parametrize("arch", ARCHS)
def test_oracle_drafts_are_accepted_and_identical(targets, arch, monkeypatch):
    target = targets[arch]
    drafter = make_drafter(target)
    ids = _prompt(8, 11)
    ref = target.generate(ids, max_new_tokens=60, do_sample=False)
    Oracle(ref, lambda c: [None, 0, 2, 4, 1][c % 5]).install(monkeypatch)
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=60, do_sample=False)
    assert torch.equal(ref, out)
    stats = drafter.generation_stats
    # the wrong slot bounds each cycle's acceptance: B, 1, 3, 5, 2 tokens per cycle in turn
    expected = [6, 1, 3, 5, 2]
    assert stats.acceptance_lengths[:5] == expected
    assert stats.tau > 2.5


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("new_tokens", [1, 2, 5, 6, 7, 11, 12, 13])
def test_max_new_tokens_boundary_inside_block(targets, arch, new_tokens, monkeypatch):
    """With perfect drafts a cycle emits B tokens; max_new_tokens cuts inside a block exactly."""
    target = targets[arch]
    drafter = make_drafter(target)
    ids = _prompt(7, 5)
    ref_long = target.generate(ids, max_new_tokens=30, do_sample=False)
    Oracle(ref_long, lambda c: None).install(monkeypatch)
    ref = target.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=new_tokens, do_sample=False)
    assert torch.equal(ref, out)
    assert out.shape[1] == 7 + new_tokens


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("stop_index", [2, 4, 9])
def test_eos_inside_accepted_block(targets, arch, stop_index, monkeypatch):
    """EOS in the middle of a fully accepted block: nothing after it is emitted."""
    target = targets[arch]
    drafter = make_drafter(target)
    ids = _prompt(10, 21)
    free = target.generate(ids, max_new_tokens=30, do_sample=False)
    eos = int(free[0, 10 + stop_index])
    Oracle(free, lambda c: None).install(monkeypatch)
    ref = target.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=eos)
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=30, do_sample=False, eos_token_id=eos)
    assert torch.equal(ref, out)
    assert int(out[0, -1]) == eos and (out[0, 10:-1] != eos).all()


class StopAfterToken(StoppingCriteria):
    """Fires when the last token equals ``token`` (a user criterion like a stop string)."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_custom_stopping_criterion_inside_block(targets, monkeypatch):
    target = targets["llama"]
    drafter = make_drafter(target)
    ids = _prompt(6, 8)
    free = target.generate(ids, max_new_tokens=30, do_sample=False)
    token = int(free[0, 6 + 3])
    first = int((free[0, 6:] == token).nonzero()[0])
    Oracle(free, lambda c: None).install(monkeypatch)
    criteria = StoppingCriteriaList([StopAfterToken(token)])
    ref = target.generate(ids, max_new_tokens=30, do_sample=False, stopping_criteria=criteria)
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=30, do_sample=False, stopping_criteria=criteria)
    assert torch.equal(ref, out)
    assert out.shape[1] == 6 + first + 1


class Collect(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


def test_streamer_receives_exactly_the_output(targets, monkeypatch):
    target = targets["qwen3"]
    drafter = make_drafter(target)
    ids = _prompt(6, 3)
    free = target.generate(ids, max_new_tokens=20, do_sample=False)
    Oracle(free, lambda c: [None, 3][c % 2]).install(monkeypatch)
    streamer = Collect()
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=20, do_sample=False, streamer=streamer)
    assert streamer.ended
    assert sum(streamer.chunks, []) == out[0].tolist()
    assert len(streamer.chunks) > 2  # the prompt, then one chunk per cycle


def test_repetition_penalty_and_processors_greedy(targets):
    """Logits processors apply per verified position exactly as in plain decoding."""
    target = targets["llama"]
    drafter = randomize_selector(make_drafter(target))
    for seed in range(3):
        ids = _prompt(8, 40 + seed)
        kw = dict(max_new_tokens=25, do_sample=False, repetition_penalty=1.3, no_repeat_ngram_size=3)
        assert torch.equal(target.generate(ids, **kw), target.generate(ids, assistant_model=drafter, **kw))


def test_return_dict_scores_match_plain(targets, monkeypatch):
    target = targets["llama"]
    drafter = make_drafter(target)
    ids = _prompt(6, 9)
    kw = dict(max_new_tokens=14, do_sample=False, return_dict_in_generate=True, output_scores=True, output_logits=True)
    ref = target.generate(ids, **kw)
    Oracle(ref.sequences, lambda c: [None, 2][c % 2]).install(monkeypatch)
    out = target.generate(ids, assistant_model=drafter, **kw)
    assert torch.equal(ref.sequences, out.sequences)
    assert len(out.scores) == len(ref.scores) == 14
    for a, b in zip(ref.scores, out.scores):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_untrained_selector_reproduces_top1_path(targets):
    """A fresh selector (zero successor codebook) proposes exactly the top-1 path."""
    target = targets["gemma3"]
    drafter = make_drafter(target)
    ids = _prompt(9, 1)
    paths = {}
    for use in (True, False):
        drafter.use_selector = use
        target.generate(ids, assistant_model=drafter, max_new_tokens=20, do_sample=False)
        paths[use] = (drafter.generation_stats.accepted_drafts, drafter.generation_stats.acceptance_lengths)
        st = drafter.generation_stats  # the selector's path never left the top-1 path; off: it never ran
        assert (st.selector_passes > 0) == use and st.selector_passes <= st.drafter_passes
        assert st.selector_changed_passes == 0
    drafter.use_selector = True
    gen_on = cg.DFlash2CandidateGenerator(drafter, target, False, 1.0, True, drafter.generation_stats)
    gen_off = cg.DFlash2CandidateGenerator(drafter, target, False, 1.0, False, drafter.generation_stats)
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
    for gen in (gen_on, gen_off):
        gen.add_context(hs, ids.shape[1] - 1)
    a = gen_on.propose(ids, 5).tokens
    b = gen_off.propose(ids, 5).tokens
    assert torch.equal(a, b)
    randomize_selector(drafter)
    gen_on2 = cg.DFlash2CandidateGenerator(drafter, target, False, 1.0, True, drafter.generation_stats)
    gen_on2.add_context(hs, ids.shape[1] - 1)
    assert not torch.equal(gen_on2.propose(ids, 5).tokens, b)  # a trained selector does change the path
    assert drafter.generation_stats.selector_changed_passes == 1  # and the statistics count it


def test_builtin_dflash_path_runs_our_drafter(targets):
    """transformers' own speculation_type='dflash' path accepts our drafter (no selector) and stays lossless."""
    for arch in ARCHS:
        target = targets[arch]
        drafter = randomize_convs(make_drafter(target))
        ids = _prompt(12, 2)
        ref = target.generate(ids, max_new_tokens=20, do_sample=False)
        out = target.generate(ids, assistant_model=drafter, max_new_tokens=20, do_sample=False, speculation_type="dflash")
        assert torch.equal(ref, out), arch


def test_other_assistants_are_untouched(targets):
    """The routing only claims DFlash2 drafters: a plain assistant model still uses transformers' own loop."""
    from transformers.generation.utils import GenerationMixin

    target = targets["llama"]
    small = make_target_like(target)
    ids = _prompt(6, 4)
    ref = target.generate(ids, max_new_tokens=10, do_sample=False)
    out = target.generate(ids, assistant_model=small, max_new_tokens=10, do_sample=False)
    assert torch.equal(ref, out)
    assert getattr(GenerationMixin._assisted_decoding, "_dflash2_routed", False)


def make_target_like(target):
    from conftest import make_target

    return make_target("llama", seed=9, num_hidden_layers=2)


def test_eos_from_generation_config(targets, monkeypatch):
    """The target's own EOS (generation_config) stops inside a block too."""
    target = targets["qwen3"]
    drafter = make_drafter(target)
    ids = _prompt(5, 77)
    free = target.generate(ids, max_new_tokens=25, do_sample=False, eos_token_id=None)
    Oracle(free, lambda c: None).install(monkeypatch)
    eos = int(free[0, 5 + 4])
    old = target.generation_config.eos_token_id
    target.generation_config.eos_token_id = eos
    try:
        ref = target.generate(ids, max_new_tokens=25, do_sample=False)
        out = target.generate(ids, assistant_model=drafter, max_new_tokens=25, do_sample=False)
    finally:
        target.generation_config.eos_token_id = old
    assert torch.equal(ref, out)
    assert int(out[0, -1]) == eos and out.shape[1] <= 5 + 5


def test_bf16_drafter_on_fp32_target_stays_identical(targets):
    """Drafting in bf16 only changes proposals; verification in fp32 keeps the output identical."""
    target = targets["llama"]
    drafter = randomize_selector(make_drafter(target)).to(torch.bfloat16)
    for seed in range(3):
        ids = _prompt(9, 60 + seed)
        ref = target.generate(ids, max_new_tokens=20, do_sample=False)
        out = target.generate(ids, assistant_model=drafter, max_new_tokens=20, do_sample=False)
        assert torch.equal(ref, out)
    assert drafter._lm_head_cast[1].dtype == torch.bfloat16
    builtin = target.generate(ids, assistant_model=drafter, max_new_tokens=20, do_sample=False, speculation_type="dflash")
    assert torch.equal(builtin, ref)


def test_draft_vocabulary_only_drafts_listed_tokens(targets, tmp_path, monkeypatch):
    """A draft vocabulary restricts proposals (cheaper LM head); output stays identical; it survives save/load."""
    from dflash2_hf import DFlash2DraftModel

    target = targets["qwen3"]
    drafter = randomize_selector(make_drafter(target))
    allowed = torch.arange(6, 96, 2)  # even ids only
    drafter.set_draft_vocab(allowed)
    seen = []
    original = cg.DFlash2CandidateGenerator.propose

    def spy(gen, input_ids, n):
        proposal = original(gen, input_ids, n)
        if not proposal.copied:  # a copy from the context proposes the context's tokens
            seen.append(proposal.tokens)
        return proposal

    monkeypatch.setattr(cg.DFlash2CandidateGenerator, "propose", spy)
    for use_selector in (True, False):
        drafter.use_selector = use_selector
        ids = _prompt(8, 5)
        ref = target.generate(ids, max_new_tokens=20, do_sample=False)
        assert torch.equal(ref, target.generate(ids, assistant_model=drafter, max_new_tokens=20, do_sample=False))
        sampled = target.generate(ids, assistant_model=drafter, max_new_tokens=10, do_sample=True)
        assert sampled.shape[1] == ids.shape[1] + 10
    drafter.use_selector = True
    proposed = torch.cat([t.flatten() for t in seen])
    assert torch.isin(proposed, allowed).all() and proposed.numel() > 20
    drafter.save_pretrained(tmp_path)
    loaded = DFlash2DraftModel.from_pretrained(tmp_path)
    assert torch.equal(loaded.draft_vocab_ids, allowed) and loaded.config.draft_vocab_size == allowed.numel()
    with pytest.raises(ValueError, match="unique ids"):
        drafter.set_draft_vocab([1, 1, 2])
