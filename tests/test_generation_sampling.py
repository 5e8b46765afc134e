"""Sampling with the drafter follows the target's distribution exactly (rejection sampling with the selector's q).

On a 12-token vocabulary target we compute the EXACT distribution of the 2nd and 3rd generated tokens under the
target's processed distribution (temperature + top-k), sample many generations with the drafter, and compare
marginals by total-variation distance. The 2nd and 3rd tokens come from drafts (accepted or replaced by the residual),
so a wrong ``q`` shifts them; a negative control with a deliberately wrong ``q`` must fail the same threshold.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from dflash2_hf.generation import candidate_generator as cg
from conftest import make_drafter, make_target, randomize_selector

VOCAB = 12
TEMPERATURE = 0.8
TOP_K = 6
NEW = 4  # t1 from the prefill, t2..t3 drafted in the first cycle, t4 its bonus
THRESHOLD = 0.06


def _processed_probs(logits: torch.Tensor, temperature=TEMPERATURE, top_k=TOP_K, top_p=None) -> torch.Tensor:
    """The target's distribution after transformers' own warpers (the ones generate() builds)."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p:
        warpers.append(TopPLogitsWarper(top_p))
    logits = logits.float().reshape(-1, logits.shape[-1])
    return torch.softmax(warpers(None, logits), dim=-1).reshape(-1, logits.shape[-1]).squeeze(0)


@torch.no_grad()
def _exact_marginals(target, prompt, **warp):
    """Exact P(t2) and P(t3) under plain sampling (enumerating t1, t2 over the whole vocabulary)."""
    p1 = _processed_probs(target(prompt).logits[0, -1], **warp)  # (V,)
    seqs1 = torch.cat([prompt.expand(VOCAB, -1), torch.arange(VOCAB)[:, None]], dim=1)
    p2_given_1 = _processed_probs(target(seqs1).logits[:, -1], **warp)  # (V, V)
    joint12 = p1[:, None] * p2_given_1
    t1, t2 = torch.meshgrid(torch.arange(VOCAB), torch.arange(VOCAB), indexing="ij")
    seqs2 = torch.cat([prompt.expand(VOCAB * VOCAB, -1), t1.reshape(-1, 1), t2.reshape(-1, 1)], dim=1)
    p3_given_12 = _processed_probs(target(seqs2).logits[:, -1], **warp).view(VOCAB, VOCAB, VOCAB)
    p3 = (joint12[..., None] * p3_given_12).sum((0, 1))
    return joint12.sum(0), p3


def _empirical(target, drafter, prompt, draws: int, temperature=TEMPERATURE, top_k=TOP_K, top_p=None,
               draft_lengths: list | None = None):
    counts = torch.zeros(2, VOCAB)
    accepted = 0
    for _ in range(draws):
        out = target.generate(
            prompt, assistant_model=drafter, do_sample=True, temperature=temperature, top_k=top_k or None,
            top_p=top_p, max_new_tokens=NEW, pad_token_id=0, eos_token_id=None,
        )
        new = out[0, prompt.shape[1]:]
        counts[0, new[1]] += 1
        counts[1, new[2]] += 1
        accepted += sum(drafter.generation_stats.accepted_drafts)
        if draft_lengths is not None:
            draft_lengths += drafter.generation_stats.draft_lengths
    return counts / draws, accepted / draws


def _tv(a, b):
    return 0.5 * (a - b).abs().sum().item()


def sampling_models():
    """``(target, drafter, prompt)`` of the exactness tests: a softened 12-token target (several tokens plausible at
    every step) and a near-uniform top-4 drafter (acceptance high enough that accepted drafts are tested too)."""
    target = make_target("llama", seed=5, vocab_size=VOCAB, eos_token_id=None, pad_token_id=0, bos_token_id=1)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(0.35)
    drafter = randomize_selector(make_drafter(target, block_size=4, selector_top_k=4, output_multiplier=0.05), scale=0.3)
    return target, drafter, torch.tensor([[3, 7, 2, 9, 4]])


@pytest.fixture(scope="module")
def setup():
    target, drafter, prompt = sampling_models()
    return target, drafter, prompt, _exact_marginals(target, prompt)


def test_sampling_matches_target_distribution(setup):
    target, drafter, prompt, (p2, p3) = setup
    torch.manual_seed(0)
    emp, accepted = _empirical(target, drafter, prompt, draws=1500)
    assert accepted > 0.3  # drafts really were accepted: the drafted path is what is being tested
    assert _tv(emp[0], p2) < THRESHOLD, (emp[0], p2)
    assert _tv(emp[1], p3) < THRESHOLD, (emp[1], p3)


def test_wrong_q_is_detected(setup, monkeypatch):
    """Negative control: accepting every draft (q treated as equal to p) visibly breaks the distribution."""
    target, drafter, prompt, (p2, p3) = setup
    monkeypatch.setattr(cg.DraftProposal, "q_of_tokens", lambda self: torch.zeros(self.tokens.shape[1]))
    torch.manual_seed(1)
    emp, _ = _empirical(target, drafter, prompt, draws=500)
    assert max(_tv(emp[0], p2), _tv(emp[1], p3)) > 2 * THRESHOLD


def test_sampling_without_selector_is_lossless_too(setup):
    target, drafter, prompt, (p2, p3) = setup
    drafter.use_selector = False
    try:
        torch.manual_seed(2)
        emp, _ = _empirical(target, drafter, prompt, draws=800)
    finally:
        drafter.use_selector = True
    assert _tv(emp[0], p2) < THRESHOLD * 1.4 and _tv(emp[1], p3) < THRESHOLD * 1.4


def test_sampling_with_top_p_and_high_temperature(setup):
    """Another processor chain (temperature 1.3, nucleus 0.85, no top-k): still the target's distribution."""
    target, drafter, prompt, _ = setup
    warp = dict(temperature=1.3, top_k=0, top_p=0.85)
    p2, p3 = _exact_marginals(target, prompt, **warp)
    torch.manual_seed(3)
    emp, _ = _empirical(target, drafter, prompt, draws=1200, **warp)
    assert _tv(emp[0], p2) < THRESHOLD and _tv(emp[1], p3) < THRESHOLD, (emp, p2, p3)


def test_sampling_with_a_confidence_cut_draft_length_is_lossless(setup):
    """Cutting the path where q is low (assistant_confidence_threshold) depends on the drafter alone: still exact."""
    target, drafter, prompt, (p2, p3) = setup
    drafter.generation_config.assistant_confidence_threshold = 0.27
    lengths = []
    try:
        torch.manual_seed(4)
        emp, accepted = _empirical(target, drafter, prompt, draws=1200, draft_lengths=lengths)
    finally:
        drafter.generation_config.assistant_confidence_threshold = None
    assert {1, 2} <= set(lengths)  # both cut and uncut first cycles were sampled
    assert accepted > 0.2
    assert _tv(emp[0], p2) < THRESHOLD and _tv(emp[1], p3) < THRESHOLD, (emp, p2, p3)
