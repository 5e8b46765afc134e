"""Draft length from the verification cost curve (``num_assistant_tokens_schedule="cost"``, generation/draft_length.py).

The policy's arithmetic against a brute force, the calibration it learns, the plain-step back-off, the curve it
measures, and that the schedule stays lossless: greedy identity (including forced long accepted blocks and forced plain
steps) and exact sampling with every draft length 0 .. B-1 chosen.
"""

from __future__ import annotations

import pytest
import torch
from conftest import Oracle, make_drafter, make_target, randomize_selector

from dflash2_hf.generation.draft_length import (
    AcceptanceCalibration,
    CostCurve,
    DraftLengthPolicy,
    cost_schedule_state,
    curve_key,
    measure_cost_curve,
)


def _prompt(length: int, seed: int) -> torch.LongTensor:
    return torch.randint(6, 96, (1, length), generator=torch.Generator().manual_seed(seed))


def _install_curve(drafter, target, verify_seconds: dict[int, float]) -> None:
    """Gives the drafter a cost curve for ``target`` (as policy_for would measure it) so choices are deterministic."""
    cost_schedule_state(drafter, target)["curves"][curve_key(target)] = CostCurve(verify_seconds, label="test curve")


def test_choice_maximises_expected_tokens_per_second():
    curve = CostCurve({1: 1.0, 2: 1.6, 3: 2.0, 4: 1.6, 5: 1.9, 6: 1.9})
    calibration = AcceptanceCalibration(prior_weight=1.0)
    policy = DraftLengthPolicy(curve, calibration)
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        conf = torch.rand(5, generator=g)
        draft_seconds = float(torch.rand((), generator=g)) * 0.5
        p = calibration(conf)
        best = max(range(6), key=lambda k: (1 + sum(float(p[:i].prod()) for i in range(1, k + 1)))
                   / (draft_seconds + curve.verify_seconds[k + 1]))
        assert policy.choose(conf, draft_seconds) == best
    # confident paths on a flat curve: the whole path; doubtful ones on a steep curve: the anchor alone
    assert policy.choose(torch.full((5,), 0.99), 0.1) == 5  # n = 6 costs 1.9 for ~5.3 expected tokens
    assert policy.choose(torch.tensor([0.99, 0.99, 0.99, 0.05, 0.05]), 0.1) == 3  # n = 4 is cheaper than n = 3
    steep = DraftLengthPolicy(CostCurve({1: 1.0, 2: 2.0, 3: 3.0}), calibration)
    assert steep.choose(torch.tensor([0.3, 0.3]), 0.0) == 0


def test_calibration_learns_the_acceptance_rate_of_each_confidence_bin():
    calibration = AcceptanceCalibration()
    assert calibration(torch.tensor([0.55]))[0] == pytest.approx(0.55)  # the prior: trust the selector
    for _ in range(200):  # steps at 0.55 accepted 1 time in 4; a step after a rejection is not observed
        calibration.update(torch.tensor([0.55, 0.95]), accepted=0)
        calibration.update(torch.tensor([0.55, 0.95]), accepted=0)
        calibration.update(torch.tensor([0.55, 0.95]), accepted=0)
        calibration.update(torch.tensor([0.55, 0.95]), accepted=2)
    assert calibration(torch.tensor([0.55]))[0] == pytest.approx(0.25, abs=0.01)
    assert calibration(torch.tensor([0.95]))[0] == pytest.approx(1.0, abs=0.01)
    table = {row["bin"]: row for row in calibration.table()}
    assert table["0.5-0.6"]["observed"] == 800 and table["0.9-1.0"]["observed"] == 200


def test_losing_drafts_back_off_to_plain_steps_and_winning_ones_resume():
    policy = DraftLengthPolicy(CostCurve({1: 1.0, 2: 1.5}), AcceptanceCalibration())  # plain: 1 token/s
    pattern = []
    for _ in range(6):  # every drafting cycle yields 1 token in 2 s: worse than plain
        assert policy.should_draft()
        policy.record_cycle(1, 2.0, drafted=True)
        skipped = 0
        while not policy.should_draft():
            skipped += 1
            policy.record_cycle(1, 1.0, drafted=False)
        pattern.append(skipped)
        policy._skip = 0  # the probe above consumed a should_draft(); hand it back to the loop
    assert pattern == [1, 2, 4, 8, 16, 32]
    for _ in range(5):  # drafting pays again: no more plain steps
        policy.record_cycle(4, 1.0, drafted=True)
    assert policy.should_draft() and policy._backoff == 1


def test_measured_curve_covers_every_block_length_and_leaves_no_state(targets):
    target = targets["llama"]
    curve = measure_cost_curve(target, 6, hidden_layers=[1, 2], prompt_tokens=10, repeats=1)
    assert sorted(curve.verify_seconds) == [1, 2, 3, 4, 5, 6]
    assert all(t > 0 for t in curve.verify_seconds.values()) and curve.relative()[1] == 1.0
    assert "LlamaForCausalLM" in curve.label and curve.describe().startswith("T_verify(n)/T_decode: n=1 1.00")
    assert set(curve.to_dict()["relative"]) == {"1", "2", "3", "4", "5", "6"}


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_cost_schedule_greedy_identity_and_its_report(targets, arch):
    """The real measured curve, a random drafter: output identical; the curve and the lengths are recorded."""
    target = targets[arch]
    drafter = randomize_selector(make_drafter(target), scale=1.0)
    drafter.generation_config.num_assistant_tokens_schedule = "cost"
    for length, new, seed in [(5, 30, 0), (12, 23, 1)]:
        ids = _prompt(length, seed)
        ref = target.generate(ids, max_new_tokens=new, do_sample=False)
        assert torch.equal(target.generate(ids, assistant_model=drafter, max_new_tokens=new, do_sample=False), ref)
        stats = drafter.generation_stats
        assert 1 + sum(stats.acceptance_lengths) == stats.new_tokens
        assert set(stats.cost_curve["relative"]) == {str(n) for n in range(1, drafter.config.block_size + 1)}
    assert len(cost_schedule_state(drafter, target)["curves"]) == 1  # measured once, reused by the second call
    other = make_target(arch, seed=9)  # another target: its own curve and calibration; deepcopy copies no target
    import copy

    twin = copy.deepcopy(drafter)
    assert torch.equal(other.generate(ids, assistant_model=twin, max_new_tokens=8, do_sample=False),
                       other.generate(ids, max_new_tokens=8, do_sample=False))
    assert cost_schedule_state(twin, other)["calibration"] is not cost_schedule_state(drafter, target)["calibration"]
    assert len(cost_schedule_state(twin, target)["curves"]) == 0  # the copy did not inherit the original's state


@pytest.mark.parametrize("curve", [
    {1: 1.0, 2: 1.05, 3: 1.1, 4: 1.1, 5: 1.15, 6: 1.2},  # nearly flat: long drafts pay
    {1: 1e-6, 2: 1.0, 3: 2.0, 4: 3.0, 5: 4.0, 6: 5.0},  # one token is (nearly) free: plain steps win
])
def test_cost_schedule_stays_identical_with_long_accepted_blocks_and_plain_steps(targets, monkeypatch, curve):
    target = targets["llama"]
    drafter = make_drafter(target)
    _install_curve(drafter, target, curve)
    drafter.generation_config.num_assistant_tokens_schedule = "cost"
    ids = _prompt(8, 4)
    ref = target.generate(ids, max_new_tokens=60, do_sample=False)
    # oracle drafts: right except one slot every third cycle, so acceptance (and what calibration learns) is high
    Oracle(ref, wrong_slot_per_cycle=lambda c: 1 if c % 3 == 0 else None).install(monkeypatch)
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=60, do_sample=False)
    assert torch.equal(out, ref)
    stats = drafter.generation_stats
    lengths = stats.draft_lengths
    if curve[1] < 1e-3:
        assert lengths.count(0) > len(lengths) / 2  # mostly plain steps between probes ...
        assert 0 < stats.drafter_passes < len(lengths) / 2  # ... which run no drafter
    else:
        assert max(lengths) == drafter.config.block_size - 1


def test_cost_schedule_sampling_is_exact_with_every_draft_length():
    """The choice (0 .. B-1 drafts) depends on the drafter and on earlier cycles only: sampling stays exact."""
    from test_generation_sampling import THRESHOLD, _empirical, _exact_marginals, _tv, sampling_models

    target, drafter, prompt = sampling_models()
    # a curve on which the calibrated q of a near-uniform top-4 drafter picks 0, 1, 2 or 3 drafts
    _install_curve(drafter, target, {1: 1.0, 2: 1.25, 3: 1.38, 4: 1.45})
    drafter.generation_config.num_assistant_tokens_schedule = "cost"
    p2, p3 = _exact_marginals(target, prompt)
    lengths = []
    torch.manual_seed(7)
    emp, _ = _empirical(target, drafter, prompt, draws=1200, draft_lengths=lengths)
    assert {0, 1, 2} <= set(lengths), sorted(set(lengths))
    assert _tv(emp[0], p2) < THRESHOLD and _tv(emp[1], p3) < THRESHOLD, (emp, p2, p3)


@pytest.mark.parametrize("settings,message", [
    (dict(num_assistant_tokens_schedule="heuristic"), "is not used by the DFlash2 loop"),
    (dict(num_assistant_tokens_schedule="cost", assistant_confidence_threshold=0.5), "unset assistant_confidence"),
])
def test_bad_schedules_are_refused(targets, settings, message):
    target = targets["llama"]
    drafter = make_drafter(target)
    for key, value in settings.items():
        setattr(drafter.generation_config, key, value)
    with pytest.raises(ValueError, match=message):
        target.generate(_prompt(5, 0), assistant_model=drafter, max_new_tokens=5, do_sample=False)


def test_bench_method_dflash2_cost_reports_the_curve(targets, tmp_path):
    from dflash2_hf.bench import BenchSettings, run_benchmark
    from dflash2_hf.bench.prompts import Prompt

    target = targets["llama"]
    drafter = make_drafter(target)
    prompts = {"toy": [Prompt(dataset="toy", prompt_id=str(i), input_ids=_prompt(6, i)[0].tolist()) for i in range(2)]}
    results = run_benchmark(target, drafter, prompts, BenchSettings(max_new_tokens=12, methods=("plain", "dflash2_cost"),
                                                                     progress=False), out_dir=tmp_path, plots=False)
    row = next(r for r in results["aggregates"] if r["method"] == "dflash2_cost" and r["dataset"] == "toy")
    assert row["identical_all"] and set(row["cost_curve"]["relative"]) == {str(n) for n in range(1, 7)}
    assert 0 < row["drafted_cycles"] <= 1
    text = (tmp_path / "results.md").read_text()
    assert "Draft length from the cost curve (`dflash2_cost`)" in text and "made without it (the others were plain steps)" in text
    assert 0 <= row["copy_only_cycles"] <= 1 - row["drafted_cycles"]
    assert drafter.generation_config.num_assistant_tokens_schedule is None  # the method's setting was restored

