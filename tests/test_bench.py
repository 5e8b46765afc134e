"""Smoke test of the benchmark harness (dflash2_hf.bench) with tiny random models: every method, greedy and sampling."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_drafter, make_target, randomize_selector
from dflash2_hf.bench import METHODS, BenchSettings, Prompt, per_position_rates, run_benchmark
from dflash2_hf.bench.prompts import jsonl_bench_prompts
from dflash2_hf.cpu_kernels import cpu_kernels_summary, optimize_for_cpu, restore_stock_kernels

NEW = 10


@pytest.fixture(scope="module")
def models():
    target = make_target("llama")
    drafter = randomize_selector(make_drafter(target))
    return target, drafter


@pytest.fixture(scope="module")
def adapted(models, tmp_path_factory):
    """The same drafter with a (random, non-zero) LoRA adapter, saved and loaded back merged, as the CLI does."""
    import copy

    from dflash2_hf.bench import load_adapted_drafter
    from dflash2_hf.lora import add_lora, save_adapter

    target, drafter = models
    root = tmp_path_factory.mktemp("adapter")
    drafter.save_pretrained(root / "base")
    model = add_lora(copy.deepcopy(drafter))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    save_adapter(model, root / "adapter")
    return load_adapted_drafter(str(root / "base"), root / "adapter", target)


@pytest.fixture(scope="module")
def previous(models):
    """Another drafter for the same target (other weights, block size 4): the dflash2_previous method's."""
    return randomize_selector(make_drafter(models[0], seed=7, block_size=4), seed=8)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    random_prompt = torch.randint(6, 96, (9,), generator=g).tolist()
    repetitive = [7, 8, 9, 10] * 3  # gives prompt lookup something to find
    return {"rand": [Prompt("rand", "0", random_prompt)], "rep": [Prompt("rep", "0", repetitive)]}


def _check_files(out, results, methods, greedy=True):
    for name in ("results.json", "results.md", "acceptance_per_position.png", "speedup.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    data = json.loads((out / "results.json").read_text())
    for key in ("settings", "meta", "environment", "prompts", "run", "records", "aggregates"):
        assert key in data, key
    assert {"torch", "transformers", "dflash2_hf"} <= set(data["environment"]["versions"])
    assert {"cpu_count", "torch_threads", "device"} <= set(data["environment"]["machine"])
    assert len(data["records"]) == 2 * len(methods)
    # interleaved: each prompt runs every method, in a rotated order
    orders = {}
    for rec in data["records"]:
        orders.setdefault(rec["prompt_index"], {})[rec["order"]] = rec["method"]
    assert [orders[0][i] for i in range(len(methods))] != [orders[1][i] for i in range(len(methods))]
    for rec in data["records"]:
        assert rec["new_tokens"] > 0 and rec["seconds"] > 0 and rec["tokens_per_second"] > 0
        assert rec["forwards"]["target_forwards"] >= 1
        if rec["method"] in ("dflash2", "dflash2_top1", "dflash2_dynamic", "dflash2_adapter", "dflash2_previous"):
            stats = rec["generation_stats"]
            assert stats is not None
            # the hook-based accounting agrees with the loop's own statistics
            assert rec["forwards"]["cycles"] == stats["num_cycles"]
            assert rec["forwards"]["accepted"] == stats["accepted_drafts"]
            assert rec["forwards"]["tau_from_forwards"] == pytest.approx(stats["tau"])
        if rec["method"] == "plain" and rec["forwards"]["cycles"]:
            assert rec["forwards"]["tau_from_forwards"] == pytest.approx(1.0)
    rows = data["aggregates"]
    assert {(r["dataset"], r["method"]) for r in rows} == {(d, m) for d in ("rand", "rep", "all") for m in methods}
    for row in rows:
        for key in ("tokens_per_second", "speedup", "tau", "per_position_acceptance", "time_split_ms_per_cycle",
                    "identical_to_plain", "prefill_ms_per_call"):
            assert key in row, key
        assert row["tokens_per_second"] > 0 and row["speedup"] > 0
        if row["method"] == "plain":
            assert row["speedup"] == pytest.approx(1.0)
        if row["method"] in ("builtin_dflash", "dflash2", "dflash2_top1", "dflash2_dynamic", "dflash2_adapter"):
            assert len(row["per_position_acceptance"]) == 5  # block size 6
            assert row["time_split_ms_per_cycle"]["draft"] is not None
        if row["method"] == "dflash2_top1":
            assert "selector_passes" not in row
        if row["method"] == "dflash2" and row["dataset"] == "all" and greedy:  # a random selector: its path often
            assert row["selector_passes"] >= 1 and 0 < row["selector_changed"] <= 1  # differs (counted when greedy)
    md = (out / "results.md").read_text()
    for m in methods:
        assert f"| {m} |" in md
    if "dflash2" in methods and greedy:
        assert "selector path differs from the top-1 path" in md and "all `dflash2`" in md
    return data


def test_bench_greedy(models, adapted, previous, prompts, tmp_path):
    target, drafter = models
    settings = BenchSettings(max_new_tokens=NEW, methods=METHODS, warmup_tokens=3, progress=False)
    optimize_for_cpu(target)  # plain_optimized needs it; plain still runs on stock kernels
    try:
        results = run_benchmark(target, drafter, prompts, settings, out_dir=tmp_path,
                                meta={"target": "tiny-llama", "adapter": "a/b", "adapter_bytes": 1000,
                                      "drafter_bytes": 10000, "previous_drafter": "old/release",
                                      "cpu_kernels": cpu_kernels_summary(target)},
                                adapted_drafter=adapted, previous_drafter=previous)
    finally:
        restore_stock_kernels(target)
    data = _check_files(tmp_path, results, METHODS)
    md = (tmp_path / "results.md").read_text()
    assert "LoRA adapter (method `dflash2_adapter`): `a/b` (0.00 MB = 10.0% of the drafter's" in md
    assert "previous drafter (method `dflash2_previous`): `old/release`" in md
    # the previous drafter drafted its own blocks (block size 4: at most 3 drafts, 3 acceptance positions)
    prev = [r for r in data["records"] if r["method"] == "dflash2_previous"]
    drafted = [d for r in prev for d, c in zip(r["generation_stats"]["draft_lengths"], r["generation_stats"]["copied"])
               if not c]  # copies from the context may be longer than a block
    assert max(drafted) == 3
    assert prev[-1]["generation_stats"] == json.loads(json.dumps(previous.generation_stats.to_dict()))
    assert all(r["forwards"]["drafter_calls"] > 0 for r in prev)  # its forwards are hooked too
    row = next(r for r in data["aggregates"] if r["dataset"] == "all" and r["method"] == "dflash2_previous")
    assert len(row["per_position_acceptance"]) == 3
    # the adapter method drafted with the adapted drafter: its last record's statistics are the adapted
    # drafter's own (the base drafter's last run is a dflash2/dflash2_top1 one)
    last = [r for r in data["records"] if r["method"] == "dflash2_adapter"][-1]
    assert last["generation_stats"] == json.loads(json.dumps(adapted.generation_stats.to_dict()))
    assert adapted is not drafter
    # every method is lossless in fp32 greedy: token-for-token identical to plain greedy
    assert all(rec["identical_to_plain"] is True for rec in data["records"])
    assert all(row["identical_all"] is True for row in data["aggregates"])
    assert drafter.use_selector is True  # restored after dflash2_top1
    pl = next(r for r in data["aggregates"] if r["dataset"] == "rep" and r["method"] == "prompt_lookup")
    assert pl["per_position_acceptance"] is not None
    assert "vs plain_optimized" in md and "every other method on prepacked oneDNN linears" in md
    optimized = next(r for r in data["aggregates"] if r["dataset"] == "all" and r["method"] == "plain_optimized")
    assert optimized["speedup_vs_plain_optimized"] == pytest.approx(1.0)
    assert optimized["tau"] == 1.0 and optimized["per_position_acceptance"] is None
    # copying from the context is counted per call, and never happens where the method turns it off
    assert sum(r["generation_stats"]["copied_cycles"] for r in data["records"]
               if r["method"] == "dflash2_no_lookup") == 0
    assert all("copied_cycles" in r["generation_stats"] for r in data["records"] if r["method"] == "dflash2")


def test_plain_optimized_needs_an_optimized_target(models, prompts):
    target, drafter = models
    settings = BenchSettings(max_new_tokens=2, methods=("plain", "plain_optimized"), warmup=False, progress=False)
    with pytest.raises(ValueError, match="plain_optimized needs a target run through dflash2_hf.optimize_for_cpu"):
        run_benchmark(target, drafter, prompts, settings)


def test_dynamic_method_cuts_drafts_and_restores_the_drafter_knobs(models, prompts, tmp_path):
    """dflash2 runs full blocks and dflash2_dynamic the bench's threshold, whatever the caller had set; restored after."""
    target, drafter = models
    drafter.generation_config.num_assistant_tokens = 2
    drafter.generation_config.assistant_confidence_threshold = 0.123
    try:
        settings = BenchSettings(max_new_tokens=NEW, methods=("dflash2", "dflash2_dynamic"), confidence_threshold=0.9,
                                 warmup=False, progress=False)
        data = _check_files(tmp_path, run_benchmark(target, drafter, prompts, settings, out_dir=tmp_path),
                            settings.methods)
        knobs = (drafter.generation_config.num_assistant_tokens,
                 drafter.generation_config.assistant_confidence_threshold)
    finally:
        drafter.generation_config.num_assistant_tokens = None
        drafter.generation_config.assistant_confidence_threshold = None
    assert knobs == (2, 0.123)
    assert all(r["identical_to_plain"] for r in data["records"])
    full = [d for r in data["records"] if r["method"] == "dflash2"
            for d, c in zip(r["generation_stats"]["draft_lengths"], r["generation_stats"]["copied"]) if not c]
    assert max(full) == 5  # B - 1: the caller's cap of 2 did not leak into the full-block method
    rows = {r["method"]: r for r in data["aggregates"] if r["dataset"] == "all"}
    assert rows["dflash2_dynamic"]["mean_draft_length"] < rows["dflash2"]["mean_draft_length"]
    assert rows["plain"]["mean_draft_length"] is None
    md = (tmp_path / "results.md").read_text()
    assert "| tau | drafts |" in md and f"| {rows['dflash2_dynamic']['mean_draft_length']:.2f} |" in md


def test_confidence_threshold_is_checked_when_used():
    with pytest.raises(ValueError, match="--confidence-threshold"):
        BenchSettings(methods=("dflash2_dynamic",), confidence_threshold=1.5)
    BenchSettings(methods=("dflash2",), confidence_threshold=1.5)  # not used: no error


def test_adapter_and_previous_methods_need_their_drafters(models, prompts):
    target, drafter = models
    settings = BenchSettings(max_new_tokens=NEW, methods=("dflash2_adapter",), warmup=False, progress=False)
    with pytest.raises(ValueError, match="dflash2_adapter needs adapted_drafter"):
        run_benchmark(target, drafter, prompts, settings)
    settings = BenchSettings(max_new_tokens=NEW, methods=("dflash2_previous",), warmup=False, progress=False)
    with pytest.raises(ValueError, match="dflash2_previous needs previous_drafter"):
        run_benchmark(target, drafter, prompts, settings)


def test_bench_sampling_subset(models, prompts, tmp_path):
    target, drafter = models
    settings = BenchSettings(max_new_tokens=NEW, temperature=0.8, top_p=0.95,
                             methods=("dflash2", "builtin_dflash", "prompt_lookup", "dflash2_top1"),
                             warmup=False, progress=False)
    assert settings.methods[0] == "plain"  # always added: the speedup reference
    results = run_benchmark(target, drafter, prompts, settings, out_dir=tmp_path)
    data = _check_files(tmp_path, results, settings.methods, greedy=False)
    assert all(rec["identical_to_plain"] is None for rec in data["records"])
    assert all(row["identical_to_plain"] is None for row in data["aggregates"])
    assert "n/a" in (tmp_path / "results.md").read_text()


def test_forward_accounting_with_acceptance(models, prompts, tmp_path, monkeypatch):
    """With an oracle drafter (the plain greedy continuation, every 3rd draft corrupted) blocks are partly accepted:
    the hook-based per-cycle accounting must match the loop's own statistics exactly."""
    from dflash2_hf.generation import candidate_generator as cg

    target, drafter = models
    ids = torch.tensor([prompts["rand"][0].input_ids])
    full = target.generate(ids, max_new_tokens=NEW, do_sample=False)[0].tolist()

    def oracle(self, input_ids, num_drafts):
        cur = input_ids.shape[1]
        tokens = (full[cur: cur + num_drafts] + [0] * num_drafts)[:num_drafts]
        if len(tokens) >= 3:
            tokens[2] = (tokens[2] + 1) % 96
        return cg.DraftProposal(tokens=torch.tensor([tokens]))

    monkeypatch.setattr(cg.DFlash2CandidateGenerator, "propose", oracle)
    settings = BenchSettings(max_new_tokens=NEW, methods=("dflash2",), warmup=False, progress=False)
    data = run_benchmark(target, drafter, {"rand": prompts["rand"]}, settings, out_dir=None)
    rec = next(r for r in data["records"] if r["method"] == "dflash2")
    stats = rec["generation_stats"]
    assert stats["tau"] > 1.5 and rec["identical_to_plain"] is True
    assert rec["forwards"]["accepted"] == stats["accepted_drafts"]
    assert rec["forwards"]["drafts"] == stats["draft_lengths"]
    assert rec["forwards"]["tau_from_forwards"] == pytest.approx(stats["tau"])


def test_per_position_rates():
    assert per_position_rates([3, 3, 1], [3, 0, 1], 4) == [2 / 3, 1 / 2, 1 / 2, None]


class _FakeTokenizer:
    chat_template = "fake"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "|".join(f"{m['role']}:{m['content']}" for m in messages) + ("|assistant:" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([1] if add_special_tokens else []) + [ord(c) % 90 + 6 for c in text]}


def test_jsonl_prompts(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"prompt": "hi"}) + "\n\n"
                    + json.dumps({"id": "x", "messages": [{"role": "user", "content": "yo"}]}) + "\n"
                    + json.dumps({"prompt": "a much longer prompt than the limit"}) + "\n")
    tok = _FakeTokenizer()
    skipped = []
    got = jsonl_bench_prompts(path, tok, 10, max_prompt_tokens=20, skipped=skipped)
    assert [p.prompt_id for p in got] == ["1", "x"] and skipped == ["4"]
    assert got[0].dataset == "mine" and got[0].chat
    assert got[0].input_ids == tok(tok.apply_chat_template([{"role": "user", "content": "hi"}]),
                                   add_special_tokens=False)["input_ids"]
    raw = jsonl_bench_prompts(path, tok, 1, chat=False)
    assert raw[0].input_ids == tok("hi")["input_ids"] and not raw[0].chat
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(ValueError, match="prompt"):
        jsonl_bench_prompts(bad, tok, 1)
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps({"prompt": "fine"}) + "\n\n{not json\n")
    with pytest.raises(ValueError, match="broken.jsonl: line 3 is no JSON record"):
        jsonl_bench_prompts(broken, tok, 5)
