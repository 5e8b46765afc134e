"""Copying from the context (drafter.use_prompt_lookup): the n-gram continuation, greedy identity and exact sampling
when the loop verifies copied continuations."""

from __future__ import annotations

import pytest
import torch

from conftest import make_drafter, make_target
from dflash2_hf.generation import candidate_generator as cg
from dflash2_hf.generation.prompt_lookup import continuation, longest_recurring_suffix, ngram_continuation
from test_generation_sampling import THRESHOLD, VOCAB, _empirical, _exact_marginals, _tv, sampling_models


def _record_proposals(monkeypatch, method: str) -> list[bool]:
    """Wraps ``DFlash2CandidateGenerator.<method>``; the list gets, per call, whether it returned a proposal."""
    made = []
    original = getattr(cg.DFlash2CandidateGenerator, method)

    def spy(self, *args, **kwargs):
        proposal = original(self, *args, **kwargs)
        made.append(proposal is not None)
        return proposal

    monkeypatch.setattr(cg.DFlash2CandidateGenerator, method, spy)
    return made


def test_ngram_continuation_takes_the_most_recent_longest_match():
    ids = torch.tensor([[5, 1, 2, 9, 1, 2, 3, 4, 7, 1, 2]])
    # the 2-gram (1, 2) last occurred at index 4: what followed it
    assert ngram_continuation(ids, 3, 3).tolist() == [3, 4, 7]
    assert ngram_continuation(ids, 3, 1).tolist() == [3]
    # a 3-gram match wins over a more recent shorter one
    ids = torch.tensor([[8, 1, 2, 6, 9, 2, 7, 8, 1, 2]])
    assert ngram_continuation(ids, 3, 2).tolist() == [6, 9]
    assert ngram_continuation(torch.tensor([[1, 2, 3]]), 3, 4).numel() == 0  # nothing recurs
    assert ngram_continuation(ids, 3, 0).numel() == 0
    assert ngram_continuation(torch.tensor([[4]]), 3, 4).numel() == 0


def test_longest_recurring_suffix_and_overlapping_continuation():
    ids = torch.tensor([[4, 5, 6, 7, 1, 9, 5, 6, 7, 2, 4, 5, 6, 7]])
    # (4, 5, 6, 7) recurs at 0..3 (followed by 1); the more recent (5, 6, 7) at 6..8 is a shorter match
    assert longest_recurring_suffix(ids, 8, 1) == (4, 4)
    assert longest_recurring_suffix(ids, 3, 1) == (3, 9)  # capped at 3 tokens: the most recent 3-gram wins
    assert longest_recurring_suffix(ids, 8, 5) == (0, 0)  # no 5-gram recurs
    assert longest_recurring_suffix(torch.tensor([[1, 2, 3]]), 8, 1) == (0, 0)
    assert longest_recurring_suffix(torch.tensor([[3, 3]]), 8, 1) == (1, 1)
    # a recent match repeats as in LZ77: the period-2 loop (8, 9) goes on
    loop = torch.tensor([[1, 8, 9, 8, 9]])
    n, start = longest_recurring_suffix(loop, 8, 1)
    assert (n, start) == (2, 3) and continuation(loop, start, 5).tolist() == [8, 9, 8, 9, 8]
    assert ngram_continuation(ids, 8, 3).tolist() == [1, 9, 5]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_copied_continuations_keep_greedy_identity(arch, monkeypatch):
    """Copy in every cycle where the context has a continuation (agreement forced): wrong copies are rejected by
    verification, and the output stays plain greedy's."""
    target = make_target(arch, seed=0)
    drafter = make_drafter(target, block_size=6)
    prompt = torch.tensor([[3, 17, 42, 5, 3, 17, 42, 5, 3, 17, 42, 8, 61, 3, 17]])
    plain = target.generate(prompt, do_sample=False, max_new_tokens=24)
    monkeypatch.setattr(cg.DFlash2CandidateGenerator, "_agrees", staticmethod(lambda continuation, first: True))
    out = target.generate(prompt, assistant_model=drafter, do_sample=False, max_new_tokens=24)
    assert torch.equal(out, plain)
    stats = drafter.generation_stats
    assert stats.copied_cycles > 0
    drafter.use_prompt_lookup = False
    try:
        target.generate(prompt, assistant_model=drafter, do_sample=False, max_new_tokens=24)
    finally:
        drafter.use_prompt_lookup = True
    assert drafter.generation_stats.copied_cycles == 0


def test_sampling_with_copied_continuations_is_exact(monkeypatch):
    """Every token of the prompt is followed by token 5 somewhere in it, so the n-gram continuation almost always
    starts with 5, and the drafter leans towards 5 (+2 on its logit: still its own q); many first cycles then verify
    a copied continuation (q = 1 after the drafter's first draft). The 2nd and 3rd tokens still follow the target's
    exact distribution."""
    target, drafter, _ = sampling_models()
    prompt = torch.tensor([[1, 5, 2, 5, 3, 5, 4, 5, 6, 5, 7, 5, 8, 5, 9, 5, 10, 5, 11, 5, 3]])
    p2, p3 = _exact_marginals(target, prompt)
    compute_logits = type(drafter).compute_logits

    def leaning(self, hidden, lm_head):
        logits = compute_logits(self, hidden, lm_head).clone()
        logits[..., 5] += 2.0
        return logits

    monkeypatch.setattr(type(drafter), "compute_logits", leaning)
    copied = _record_proposals(monkeypatch, "_copied")
    torch.manual_seed(7)
    emp, accepted = _empirical(target, drafter, prompt, draws=1500)
    assert sum(copied) > 0.2 * len(copied), (sum(copied), len(copied))  # copied continuations were verified
    assert _tv(emp[0], p2) < THRESHOLD and _tv(emp[1], p3) < THRESHOLD, (emp, p2, p3)


def test_recurring_ngram_is_copied_without_drafting_and_longer_than_a_block():
    """A 12-token target's greedy text soon repeats 2-grams: those cycles verify copies of up to COPY_MAX_TOKENS
    tokens with no drafter pass (more tokens than a drafter block holds), and the output stays plain greedy's."""
    from dflash2_hf.generation.decoding import COPY_MAX_TOKENS

    target, drafter, _ = sampling_models()
    prompt = torch.tensor([[3, 7, 2, 9, 4, 3, 7, 2, 9, 4, 3, 7, 2, 9, 4, 3, 7, 2, 9, 4, 3, 7]])
    plain = target.generate(prompt, do_sample=False, max_new_tokens=48, pad_token_id=0, eos_token_id=None)
    out = target.generate(prompt, assistant_model=drafter, do_sample=False, max_new_tokens=48, pad_token_id=0,
                          eos_token_id=None)
    assert torch.equal(out, plain)
    stats = drafter.generation_stats
    cycles = len(stats.draft_lengths)
    assert stats.copied_cycles > 0 and stats.drafter_passes < cycles, (stats.copied_cycles, stats.drafter_passes)
    assert max(stats.draft_lengths) > drafter.config.block_size - 1
    assert max(stats.draft_lengths) <= COPY_MAX_TOKENS
    assert stats.new_tokens == 48
    assert stats.copied_cycles == sum(stats.copied) and len(stats.copied) == cycles
    assert 0 < stats.copies_without_drafting <= stats.copied_cycles
    # no cost schedule: every cycle drafted or copied, except a last one with no room left before max_length
    no_room = sum(d == 0 for d in stats.draft_lengths)
    assert stats.drafter_passes + stats.copies_without_drafting + no_room == cycles
    # a caller's cap on the drafts per cycle caps copies too
    drafter.generation_config.num_assistant_tokens = 2
    try:
        capped = target.generate(prompt, assistant_model=drafter, do_sample=False, max_new_tokens=48,
                                 pad_token_id=0, eos_token_id=None)
    finally:
        drafter.generation_config.num_assistant_tokens = None
    assert torch.equal(capped, plain)
    assert drafter.generation_stats.copied_cycles > 0 and max(drafter.generation_stats.draft_lengths) == 2


def test_sampling_with_copies_made_without_drafting_is_exact(monkeypatch):
    """Every token of the 12-token vocabulary follows a 3 somewhere in the prompt, so after the first sampled token
    the 2-gram (3, t1) always recurs: the first cycle verifies a copy made without a drafter pass (q = 1 for every
    copied token). The 2nd and 3rd tokens still follow the target's exact distribution."""
    target, drafter, _ = sampling_models()
    prompt = torch.tensor([[x for t in range(VOCAB) for x in (3, t, 9)] + [3]])
    p2, p3 = _exact_marginals(target, prompt)
    made = _record_proposals(monkeypatch, "propose_copy")
    torch.manual_seed(11)
    emp, accepted = _empirical(target, drafter, prompt, draws=1500)
    assert sum(made) >= 1500, (sum(made), len(made))  # the first cycle of every draw verified such a copy
    assert accepted > 0.1  # copied tokens were accepted: the copy's q = 1 path is what is being tested
    assert _tv(emp[0], p2) < THRESHOLD and _tv(emp[1], p3) < THRESHOLD, (emp, p2, p3)
