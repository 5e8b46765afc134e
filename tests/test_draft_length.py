"""Dynamic draft length: ``num_assistant_tokens`` caps and ``assistant_confidence_threshold`` cuts each proposed path.

Both knobs live on ``drafter.generation_config`` (transformers' names for assistant models). The cut depends on the
drafter alone, so greedy output stays identical to plain greedy; sampling exactness with a cut is checked in
``test_generation_sampling.py``.
"""

from __future__ import annotations

import pytest
import torch

from dflash2_hf.generation import GenerationStats, candidate_generator as cg
from conftest import make_drafter, randomize_selector


def _prompt(length: int, seed: int) -> torch.LongTensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(6, 96, (1, length), generator=g)


def test_confident_prefix_keeps_up_to_the_first_unconfident_draft():
    conf = torch.tensor([0.9, 0.5, 0.2, 0.8])
    assert cg.confident_prefix(conf, 0.4) == 3  # 0.2 is the first below: it is still proposed, 0.8 is not
    assert cg.confident_prefix(conf, 0.95) == 1  # never fewer than one draft
    assert cg.confident_prefix(conf, 0.1) == 4
    assert cg.confident_prefix(conf, None) == 4
    assert cg.confident_prefix(conf, 0.0) == 4


def test_path_confidence_is_the_selector_probability_of_each_step():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 4, 4, generator=g)  # (P, predecessors, successors)
    path = [2, 0, 3]
    expected = torch.stack([
        torch.softmax(scores[0, 0], -1)[2],  # position 1: the anchor is predecessor row 0
        torch.softmax(scores[1, 2], -1)[0],  # position 2: predecessor = candidate 2 of position 1
        torch.softmax(scores[2, 0], -1)[3],
    ])
    torch.testing.assert_close(cg.path_confidence(scores, path), expected)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("selector", [True, False])
def test_confidence_threshold_cuts_drafts_and_stays_identical(targets, arch, selector):
    target = targets[arch]
    drafter = make_drafter(target)
    if selector:
        randomize_selector(drafter, scale=1.0)
    drafter.use_selector = selector
    lengths = {}
    for threshold in (None, 0.2, 0.5, 0.99):
        drafter.generation_config.assistant_confidence_threshold = threshold
        lengths[threshold] = []
        for length, new, seed in [(5, 30, 0), (12, 23, 1), (3, 9, 2)]:
            ids = _prompt(length, seed)
            ref = target.generate(ids, max_new_tokens=new, do_sample=False)
            out = target.generate(ids, assistant_model=drafter, max_new_tokens=new, do_sample=False)
            assert torch.equal(ref, out), (arch, selector, threshold, length, new)
            stats = drafter.generation_stats
            assert 1 + sum(stats.acceptance_lengths) == stats.new_tokens
            # the last cycle before max_length may have room for no draft at all
            # (copies from the context are not the drafter's path: the threshold does not cut them)
            lengths[threshold] += [d for d, c in zip(stats.draft_lengths, stats.copied) if d > 0 and not c]
    drafter.use_selector = True
    mean = {t: sum(v) / len(v) for t, v in lengths.items()}
    # a random drafter is never sure: 0.99 cuts after the first draft, no threshold proposes full blocks
    assert max(lengths[None]) == drafter.config.block_size - 1 and mean[None] > 3
    assert mean[None] >= mean[0.2] >= mean[0.5] >= mean[0.99]
    assert mean[0.99] < mean[None] - 1


@pytest.mark.parametrize("do_sample", [False, True])
def test_cut_is_a_prefix_of_the_full_path_at_the_first_unconfident_draft(targets, monkeypatch, do_sample):
    """Same drafter pass and path; the threshold only shortens it, exactly after the first draft below it."""
    target = targets["llama"]
    drafter = randomize_selector(make_drafter(target), scale=1.0)
    seen, keeps = [], []
    original = cg.path_confidence
    monkeypatch.setattr(cg, "path_confidence", lambda *a: seen.append(original(*a)) or seen[-1])
    with torch.no_grad():
        for seed in range(6):
            ids = _prompt(9, seed)
            hs = target(ids, output_hidden_states=True).hidden_states
            proposals = {}
            for threshold in (None, 0.6):
                stats = GenerationStats(block_size=drafter.config.block_size)
                gen = cg.DFlash2CandidateGenerator(drafter, target, do_sample, 1.0, True, stats,
                                                   confidence_threshold=threshold)
                gen.add_context(hs, ids.shape[1] - 1)
                torch.manual_seed(seed)  # the same sampled path both times
                proposals[threshold] = gen.propose(ids, 5)
            full, cut = proposals[None], proposals[0.6]
            if do_sample:
                confidence = full.q_of_tokens()
            else:
                confidence = seen[-1]  # recorded by the thresholded call (the full path is the same path)
            keep = cg.confident_prefix(confidence, 0.6)
            keeps.append(keep)
            assert torch.equal(cut.tokens, full.tokens[:, :keep])
            if do_sample:
                assert torch.equal(cut.q, full.q[:keep]) and torch.equal(cut.candidate_ids, full.candidate_ids[:keep])
    assert min(keeps) < 5  # the threshold really cut some paths


def test_num_assistant_tokens_caps_the_drafts(targets):
    target = targets["qwen3"]
    drafter = randomize_selector(make_drafter(target))
    ids = _prompt(7, 3)
    ref = target.generate(ids, max_new_tokens=25, do_sample=False)
    for cap in (1, 3, 50):
        drafter.generation_config.num_assistant_tokens = cap
        out = target.generate(ids, assistant_model=drafter, max_new_tokens=25, do_sample=False)
        assert torch.equal(ref, out)
        stats = drafter.generation_stats
        lengths = [d for d, c in zip(stats.draft_lengths, stats.copied) if not c]
        assert max(lengths) == min(cap, drafter.config.block_size - 1)  # 50 > B - 1: the block is the limit
        if cap < drafter.config.block_size - 1:  # a cap below the block caps copies from the context too
            assert max(stats.draft_lengths) <= cap


@pytest.mark.parametrize("field,value,message", [
    ("assistant_confidence_threshold", 1.5, "probability in \\[0, 1\\)"),
    ("assistant_confidence_threshold", -0.1, "probability in \\[0, 1\\)"),
    ("assistant_confidence_threshold", float("nan"), "probability in \\[0, 1\\)"),
    ("assistant_confidence_threshold", "0.5", "probability in \\[0, 1\\)"),
    ("assistant_confidence_threshold", True, "probability in \\[0, 1\\)"),
    ("num_assistant_tokens", 0, "positive integer"),
    ("num_assistant_tokens", 2.5, "positive integer"),
    ("num_assistant_tokens", float("inf"), "positive integer"),
    ("num_assistant_tokens", True, "positive integer"),
])
def test_bad_draft_length_settings_are_refused(targets, field, value, message):
    target = targets["llama"]
    drafter = make_drafter(target)
    setattr(drafter.generation_config, field, value)
    with pytest.raises(ValueError, match=message):
        target.generate(_prompt(5, 0), assistant_model=drafter, max_new_tokens=5, do_sample=False)


def test_draft_length_settings_are_not_saved(targets, tmp_path):
    """They are per-call runtime knobs: a saved drafter reloads with full blocks."""
    from dflash2_hf import DFlash2DraftModel

    drafter = make_drafter(targets["llama"])
    drafter.generation_config.assistant_confidence_threshold = 0.4
    drafter.save_pretrained(tmp_path)
    reloaded = DFlash2DraftModel.from_pretrained(tmp_path)
    assert reloaded.generation_config.assistant_confidence_threshold is None
    assert reloaded.generation_config.num_assistant_tokens is None


def test_sampling_cut_uses_temperature_1_probabilities(targets):
    """A near-zero sampling temperature samples the greedy path, and the same threshold cuts it where greedy does
    (the confidence is the temperature-1 selector probability, not the sharpened q)."""
    target = targets["llama"]
    drafter = randomize_selector(make_drafter(target), scale=1.0)
    ids = _prompt(9, 4)
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states

    def propose(do_sample: bool, seed: int):
        gen = cg.DFlash2CandidateGenerator(drafter, target, do_sample, 0.01, True,
                                           GenerationStats(block_size=drafter.config.block_size),
                                           confidence_threshold=0.6)
        gen.add_context(hs, ids.shape[1] - 1)
        torch.manual_seed(seed)
        return gen.propose(ids, 5).tokens

    greedy = propose(False, 0)
    assert greedy.shape[1] < 5  # the threshold cuts this path
    for seed in range(5):
        assert torch.equal(propose(True, seed), greedy)


def test_ignored_generate_kwargs_warn(targets, caplog):
    target = targets["llama"]
    drafter = make_drafter(target)
    from transformers.utils import logging as hf_logging

    hf_logging.enable_propagation()
    try:
        with caplog.at_level("WARNING"):
            out = target.generate(_prompt(5, 0), assistant_model=drafter, max_new_tokens=6, do_sample=False,
                                  num_assistant_tokens=2)
    finally:
        hf_logging.disable_propagation()
    assert "draft.generation_config" in caplog.text and "num_assistant_tokens" in caplog.text
    assert max(drafter.generation_stats.draft_lengths) > 2  # really ignored, as the warning says
    assert out.shape[1] == 11
