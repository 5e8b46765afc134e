"""`dflash2 generate` and `dflash2 demo` (the README's main job) on the real target with the shipped drafter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash2_hf.cli import main

SHIPPED = str(Path(__file__).resolve().parents[1] / "model_cards" / "dflash2-smollm2-135m-instruct")


def test_generate_with_a_confidence_threshold(capsys):
    rc = main(["generate", "--drafter", SHIPPED, "--prompt", "Write a haiku about the sea.", "--max-new-tokens", "16",
               "--confidence-threshold", "0.7", "--compare", "--num-threads", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "greedy outputs identical: True" in out
    assert "drafts verified per cycle" in out


def test_generate_with_the_cost_schedule(capsys):
    rc = main(["generate", "--drafter", SHIPPED, "--prompt", "Write a haiku about the sea.", "--max-new-tokens", "16",
               "--cost-schedule", "--compare", "--num-threads", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "greedy outputs identical: True" in out
    assert "cost schedule: T_verify(n)/T_decode = 1: 1.00, 2: " in out and "verified a copy from the context made without it (the others were plain steps)" in out


@pytest.mark.parametrize("value", ["1.5", "-0.1", "abc"])
def test_generate_rejects_a_bad_threshold(value, capsys):
    with pytest.raises(SystemExit) as err:
        main(["generate", "--prompt", "x", "--confidence-threshold", value])
    assert err.value.code == 2
    assert "--confidence-threshold" in capsys.readouterr().err


def test_demo_runs_full_blocks_and_the_cost_schedule(tmp_path, capsys, monkeypatch):
    import torch

    from dflash2_hf.quantization import int8_support

    # the main job's --dtype auto on a CPU without bf16 instructions (as the AMD EPYC): fp32 target, int8 drafter
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    rc = main(["demo", "--drafter", SHIPPED, "--num-prompts", "1", "--max-new-tokens", "12", "--datasets", "humaneval",
               "--output-dir", str(tmp_path), "--num-threads", "1", "--confidence-threshold", "0.7"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "full blocks: tau" in out and "draft cut at confidence < 0.7: tau" in out
    assert "draft length from the cost curve: tau" in out and "verifying n tokens costs T_verify(n)/T_decode = 1: 1.00" in out
    drafter_label = "int8 (auto: " if int8_support("cpu")[0] else "fp32 (auto: "
    assert f"target dtype: fp32 (auto: no native bf16 on this CPU); drafter dtype: {drafter_label}" in out
    assert out.count("identical to plain greedy: True") == 3
    data = json.loads((tmp_path / "results.json").read_text())
    # on a CPU the demo optimizes the kernels by default and times plain generate() on both
    assert {r["method"] for r in data["records"]} == {"plain", "plain_optimized", "dflash2", "dflash2_cost",
                                                      "dflash2_dynamic"}
    assert "cpu kernels: target: prepacked oneDNN linears for 211 of 211 linears" in out
    assert "x over plain generate() on stock kernels" in out and "over plain on the same optimized kernels" in out
    assert data["meta"]["cpu_kernels"].startswith("prepacked oneDNN linears")
    assert all(r["identical_to_plain"] for r in data["records"])
    assert data["settings"]["confidence_threshold"] == 0.7
    assert data["meta"]["dtype"] == "fp32 (auto: no native bf16 on this CPU)"
