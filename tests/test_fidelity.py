"""Fidelity in bf16: every greedy output that parts from plain greedy is located and classified (near-tie or bug)."""

from __future__ import annotations

import pytest
import torch

from conftest import make_drafter, make_near_tie_target, randomize_selector
from dflash2_hf.bench import BenchSettings, Prompt, run_benchmark
from dflash2_hf.bench.fidelity import NEAR_TIE_ULPS, classify, describe, first_difference, identity_cell, ulp

NEW = 20


def _prompts(n: int = 6):
    g = torch.Generator().manual_seed(0)
    return {"rand": [Prompt("rand", str(i), torch.randint(6, 96, (9,), generator=g).tolist()) for i in range(n)]}


@pytest.fixture(scope="module")
def near_ties():
    target = make_near_tie_target()
    drafter = randomize_selector(make_drafter(target.float())).to(torch.bfloat16)
    return target.to(torch.bfloat16), drafter


def test_ulp_is_the_spacing_of_the_dtype():
    assert ulp(20.0) == 0.125 and ulp(-20.0) == 0.125 and ulp(16.0) == 0.125 and ulp(15.99) == 0.0625
    assert ulp(1.0, torch.bfloat16) == 2 ** -7
    assert ulp(20.0, torch.float32) == 16 * 2 ** -23 and ulp(20.0, torch.float16) == 16 * 2 ** -10
    assert ulp(0.0) > 0
    # the definition: the next bf16 number above x is x + ulp(x)
    x = torch.tensor(20.0, dtype=torch.bfloat16)
    assert torch.nextafter(x, torch.tensor(100.0, dtype=torch.bfloat16)).item() - x.item() == ulp(20.0)


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 4, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2


def test_classify_margins_ranks_and_dtypes():
    scores = torch.tensor([20.0, 20.0 - 3 * 0.125, 10.0, -float("inf")])  # ulp at 20 in bf16: 0.125
    near = classify(scores, 4, 0, 1, torch.bfloat16)
    assert near.near_tie and near.classification == "near-tie" and near.margin_ulps == pytest.approx(3.0)
    assert near.other_rank == 2 and near.margin_top2 == pytest.approx(0.375) and near.ulp == 0.125
    far = classify(scores, 4, 0, 2, torch.bfloat16)
    assert not far.near_tie and far.classification == "bug" and far.margin_ulps == pytest.approx(80.0)
    assert far.other_rank == 3 and far.margin_top2 == pytest.approx(0.375)
    assert "BUG at new token 4" in describe(far) and "near-tie at new token 4" in describe(near)
    assert classify(scores, 4, 0, 1, torch.bfloat16, bound_ulps=2).classification == "bug"  # the bound is a setting
    # float32: token identity is the contract, even at a tie
    assert classify(scores, 4, 0, 1, torch.float32).classification == "bug"
    # only measuring (calibration): no verdict of bug
    assert classify(scores, 4, 0, 2, torch.bfloat16, judge=False).classification == "beyond rounding"
    assert classify(None, 3, 7, None, torch.bfloat16).classification == "bug"  # one output ended early


def test_forced_bf16_divergences_are_near_ties(near_ties, tmp_path):
    """Twin LM-head rows make plain greedy's top two nearly tied at every step: block verification in bf16 parts
    from plain greedy, and every such divergence must be classified a near-tie (bf16 rounding, not a bug)."""
    target, drafter = near_ties
    settings = BenchSettings(max_new_tokens=NEW, methods=("plain", "dflash2", "prompt_lookup"), progress=False,
                             warmup=False)
    results = run_benchmark(target, drafter, _prompts(), settings, out_dir=tmp_path, plots=False)
    diverged = [r for r in results["records"] if r["identical_to_plain"] is False]
    assert diverged, "the near-tie target produced no bf16 divergence: the test proves nothing"
    for rec in diverged:
        d = rec["divergence"]
        assert d["classification"] == "near-tie", d
        plain = next(r for r in results["records"] if r["method"] == "plain" and r["prompt_id"] == rec["prompt_id"])
        j = d["position"]
        assert rec["output_ids"][:j] == plain["output_ids"][:j] and rec["output_ids"][j] != plain["output_ids"][j]
        assert (d["plain_token"], d["other_token"]) == (plain["output_ids"][j], rec["output_ids"][j])
        assert 0 <= d["margin"] <= NEAR_TIE_ULPS * d["ulp"] and d["dtype"] == "bfloat16"
    for row in results["aggregates"]:
        assert row["fidelity_ok"] is True and row["divergence_bugs"] == 0
        assert row["near_ties"] == row["num_prompts"] - row["identical_to_plain"]
    md = (tmp_path / "results.md").read_text()
    assert "Divergences from plain greedy" in md and "| near-tie |" in md and "BUG" not in md
    assert "near-tie" in identity_cell(next(r for r in results["aggregates"] if r["near_ties"]))


def test_a_wrong_acceptance_is_flagged_as_a_bug(near_ties, tmp_path, monkeypatch):
    """Negative control: a verification that accepts every draft (a real bug) is classified a bug, loudly."""
    from dflash2_hf.generation import decoding

    def accept_all(drafts):
        proposed = [] if drafts is None else drafts[0].tolist()

        def pick(i, processed):
            if i < len(proposed):
                return torch.tensor([proposed[i]], device=processed.device), True
            return processed.argmax(-1), False

        return pick

    monkeypatch.setattr(decoding, "greedy_picker", accept_all)
    target, drafter = near_ties
    settings = BenchSettings(max_new_tokens=NEW, methods=("plain", "dflash2"), progress=False, warmup=False)
    results = run_benchmark(target, drafter, _prompts(2), settings, out_dir=tmp_path, plots=False)
    bugs = [r["divergence"] for r in results["records"] if r["divergence"]]
    assert bugs and all(d["classification"] == "bug" and d["margin_ulps"] > NEAR_TIE_ULPS for d in bugs)
    row = next(r for r in results["aggregates"] if r["method"] == "dflash2")
    assert row["fidelity_ok"] is False and row["divergence_bugs"] == len(bugs)
    md = (tmp_path / "results.md").read_text()
    assert "**NO: " in md and "| **BUG** |" in md and "**BUG: " in md


def test_fp32_divergences_are_bugs(targets, monkeypatch):
    """In fp32 any divergence is a bug, however small plain's margin."""
    from dflash2_hf.bench.fidelity import explain_divergences

    target = targets["llama"]
    ids = torch.tensor([[3, 7, 9, 11]])
    plain = target.generate(ids, max_new_tokens=6, do_sample=False)[0, 4:].tolist()
    other = plain[:3] + [(plain[3] + 1) % 96] + plain[4:]
    found = explain_divergences(target, ids, plain, {"x": other, "same": plain})
    assert set(found) == {"x"} and found["x"].position == 3 and found["x"].classification == "bug"
    assert found["x"].dtype == "float32" and found["x"].margin > 0


def test_calibration_bf16_vs_fp32(near_ties):
    target, drafter = near_ties
    reference = make_near_tie_target(dtype=torch.float32)
    settings = BenchSettings(max_new_tokens=NEW, methods=("plain",), progress=False, warmup=False)
    results = run_benchmark(target, None, _prompts(4), settings, reference_target=reference)
    cal = results["calibration"]
    assert cal["dtype"] == "bfloat16" and cal["reference_dtype"] == "float32" and cal["num_prompts"] == 4
    assert cal["identical"] + len(cal["divergences"]) == 4
    for d in cal["divergences"]:
        assert d["classification"] in ("near-tie", "beyond rounding") and d["margin"] >= 0
    from dflash2_hf.bench.report import markdown

    assert "Calibration: plain bfloat16 vs plain float32 greedy" in markdown(results)
