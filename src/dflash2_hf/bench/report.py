"""Aggregates, ``results.json``, ``results.md`` and the PNG plots of a benchmark run."""

from __future__ import annotations

import json
import math
import os
import platform
import sys
from dataclasses import asdict, fields
from pathlib import Path

from ..generation.draft_length import CostCurve
from ..generation.stats import GenerationStats
from .fidelity import divergence_counts, divergence_lines, identity_cell
from .recorder import per_position_rates
from .runner import METHOD_DESCRIPTIONS, PLAIN_METHODS, STATS_METHODS, RawRecord

ALL = "all"  # pseudo data set pooling every prompt


def _stats_from_dict(d: dict) -> GenerationStats:
    names = {f.name for f in fields(GenerationStats)}
    return GenerationStats(**{k: v for k, v in d.items() if k in names})


def _div(a, b):
    return a / b if b else None


def aggregate(records: list[RawRecord], methods: tuple, block_size: int | None, prompt_lookup_num_tokens: int,
              greedy: bool) -> list[dict]:
    """One row per (data set, method), plus data set :data:`ALL` pooling everything (when there are several).

    Pooled figures: tokens/s = sum(new tokens) / sum(seconds); speedup = that / plain's; tau and acceptance pool
    all cycles; the time split is per verification cycle (see docs/bench.md).
    """
    datasets = list(dict.fromkeys(r.dataset for r in records))
    groups = [(d, [r for r in records if r.dataset == d]) for d in datasets]
    if len(datasets) > 1:
        groups.append((ALL, list(records)))
    rows = []
    for dataset, recs in groups:
        plain_tps = optimized_tps = None
        for method in methods:
            rs = [r for r in recs if r.method == method]
            if not rs:
                continue
            new = sum(r.new_tokens for r in rs)
            secs = sum(r.seconds for r in rs)
            tps = new / secs if secs > 0 else None
            if method == "plain":
                plain_tps = tps
            elif method == "plain_optimized":
                optimized_tps = tps
            fw_cycles = sum(r.forwards["cycles"] for r in rs)
            fw_tau = _div(sum(r.new_tokens - 1 for r in rs if r.forwards["cycles"]), fw_cycles)
            row = {
                "dataset": dataset, "method": method, "num_prompts": len(rs), "new_tokens": new, "seconds": secs,
                "tokens_per_second": tps,
                "speedup": (tps / plain_tps) if (tps and plain_tps) else None,
                "speedup_vs_plain_optimized": (tps / optimized_tps) if (tps and optimized_tps) else None,
                "mean_prompt_speedup": None,
                "tau_from_forwards": fw_tau,
                "target_forwards": sum(r.forwards["target_forwards"] for r in rs),
            }
            plain_by_prompt = {(r.dataset, r.prompt_id): r for r in recs if r.method == "plain"}
            ratios = [(r.new_tokens / r.seconds) / (p.new_tokens / p.seconds) for r in rs
                      if (p := plain_by_prompt.get((r.dataset, r.prompt_id))) and r.seconds > 0 and p.seconds > 0
                      and p.new_tokens > 0]
            if ratios:
                row["mean_prompt_speedup"] = sum(ratios) / len(ratios)
            prefill = verify = draft = select = 0.0
            if method in STATS_METHODS:
                merged = GenerationStats.merge([_stats_from_dict(r.generation_stats) for r in rs])
                cycles = merged.num_cycles
                row.update(tau=merged.tau if cycles else None, tau_source="generation_stats",
                           mean_draft_length=merged.mean_draft_length if cycles else None,
                           per_position_acceptance=merged.per_position_acceptance(), acceptance_source="generation_stats",
                           split_source="generation_stats", loop_other_seconds=merged.other_seconds)
                prefill, verify, draft, select = (merged.prefill_seconds, merged.verify_seconds,
                                                  merged.draft_seconds, merged.select_seconds)
                if merged.selector_passes:  # how often the selector's path is not the top-1 path
                    row.update(selector_passes=merged.selector_passes,
                               selector_changed=merged.selector_changed_passes / merged.selector_passes)
                if merged.cost_curve:  # dflash2_cost: the curve it chose from, and how often the drafter ran
                    row.update(cost_curve=merged.cost_curve,
                               drafted_cycles=merged.drafter_passes / cycles if cycles else None,
                               copy_only_cycles=merged.copies_without_drafting / cycles if cycles else None)
            else:
                cycles = fw_cycles
                drafts = [x for r in rs for x in (r.forwards["drafts"] or [])]
                accepted = [x for r in rs for x in (r.forwards["accepted"] or [])]
                if method in PLAIN_METHODS:
                    acceptance = None
                else:
                    max_pos = (block_size - 1) if method == "builtin_dflash" and block_size else (
                        prompt_lookup_num_tokens if method == "prompt_lookup" else None)
                    acceptance = per_position_rates(drafts, accepted, max_pos) if drafts else None
                row.update(tau=fw_tau if method not in PLAIN_METHODS else (1.0 if cycles else None),
                           tau_source="target_forwards",
                           mean_draft_length=(sum(drafts) / len(drafts)) if drafts and method not in PLAIN_METHODS
                           else None,
                           per_position_acceptance=acceptance, acceptance_source="target_forwards",
                           split_source="forward_hooks")
                prefill = sum(r.forwards["prefill_seconds"] for r in rs)
                verify = sum(r.forwards["verify_seconds"] for r in rs)
                draft = sum(r.forwards["drafter_seconds"] for r in rs) if method == "builtin_dflash" else 0.0
            rest = secs - prefill - verify - draft - select
            ms = (lambda x: 1000.0 * x / cycles) if cycles else (lambda x: None)
            row.update(
                cycles=cycles,
                time_split_ms_per_cycle={
                    "draft": ms(draft) if method in ("builtin_dflash",) + STATS_METHODS else None,
                    "select": ms(select) if method in STATS_METHODS else None,
                    "verify": ms(verify),
                    "rest": ms(rest),
                },
                prefill_ms_per_call=1000.0 * prefill / len(rs),
                identical_to_plain=(sum(bool(r.identical_to_plain) for r in rs) if greedy else None),
                identical_all=(all(r.identical_to_plain for r in rs) if greedy else None),
                **divergence_counts(rs, greedy),
            )
            rows.append(row)
    return rows


# ------------------------------------------------------------------ environment
def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def environment(target) -> dict:
    """Versions and machine description for ``results.json``."""
    import torch
    import transformers

    from .. import __version__

    device = next(target.parameters()).device
    env = {
        "versions": {"dflash2_hf": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
                     "python": sys.version.split()[0]},
        "machine": {
            "platform": platform.platform(), "cpu": _cpu_model(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "device": str(device),
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        },
    }
    if device.type == "cuda":
        env["machine"]["gpu"] = torch.cuda.get_device_name(device)
    for name in ("matplotlib", "tqdm"):
        try:
            env["versions"][name] = __import__(name).__version__
        except Exception:
            pass
    return env


def load_warning(env: dict) -> str | None:
    """A warning when other work was competing for the CPUs (load average vs cores and torch threads)."""
    m = env.get("machine", {})
    loads = [x for x in (m.get("load_average") or [])[:1] + (m.get("load_average_end") or [])[:1] if x is not None]
    cpus = m.get("cpu_count") or 0
    if not loads or not cpus or m.get("device", "cpu") != "cpu":
        return None
    start = loads[0]
    if start > 0.5 * cpus:
        return (f"load average {start:.1f} on {cpus} CPUs when the run started (other processes were busy; "
                f"torch threads: {m.get('torch_threads')}): timings are noisy"
                + ("; with more threads than free cores torch's thread barriers can slow forwards several-fold, "
                   "try --num-threads 1" if (m.get("torch_threads") or 1) > 1 else ""))
    return None


# ------------------------------------------------------------------ markdown
def _fmt(x, spec=".2f", none="n/a"):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    return format(x, spec)


def markdown(results: dict) -> str:
    s = results["settings"]
    env = results["environment"]
    meta = results.get("meta", {})
    lines = ["# DFlash2 benchmark", ""]
    decoding = "greedy" if s["greedy"] else f"sampling T={s['temperature']}, top_p={s['top_p']}, top_k={s['top_k'] or 'off'}"
    lines += [
        f"- target: `{meta.get('target', '?')}` in {meta.get('dtype', '?')}, drafter: `{meta.get('drafter', '?')}`"
        + (f" in {meta['drafter_dtype']}" if meta.get("drafter_dtype") else "")
        + (f" (block size {meta['block_size']})" if meta.get("block_size") else ""),
        f"- {decoding}, max_new_tokens={s['max_new_tokens']}, seed={s['seed']}, "
        f"prompt lookup N={s['prompt_lookup_num_tokens']}",
        "- prompts: " + ", ".join(f"{k}: {len(v)}" for k, v in results["prompts"].items()),
        f"- machine: {env['machine']['cpu']} ({env['machine']['cpu_count']} CPUs, torch threads "
        f"{env['machine']['torch_threads']}, device {env['machine']['device']}); torch {env['versions']['torch']}, "
        f"transformers {env['versions']['transformers']}, dflash2_hf {env['versions']['dflash2_hf']}"
        + (f"; 1-min load average {env['machine']['load_average'][0]:.1f} at start, "
           f"{(env['machine'].get('load_average_end') or [float('nan')])[0]:.1f} at end"
           if env["machine"].get("load_average") else ""),
    ]
    if meta.get("adapter"):
        size = (f" ({meta['adapter_bytes'] / 1e6:.2f} MB" + (
            f" = {100 * meta['adapter_bytes'] / meta['drafter_bytes']:.1f}% of the drafter's "
            f"{meta['drafter_bytes'] / 1e6:.1f} MB" if meta.get("drafter_bytes") else "") + ")"
            if meta.get("adapter_bytes") else "")
        lines.append(f"- LoRA adapter (method `dflash2_adapter`): `{meta['adapter']}`{size}")
    if meta.get("previous_drafter"):
        lines.append(f"- previous drafter (method `dflash2_previous`): `{meta['previous_drafter']}`"
                     + (f" in {meta['previous_drafter_dtype']}" if meta.get("previous_drafter_dtype") else ""))
    warning = load_warning(env)
    if warning:
        lines.append(f"- **{warning}**")
    if meta.get("cpu_kernels"):
        lines.append(f"- kernels: `plain` on stock PyTorch kernels, every other method on {meta['cpu_kernels']}")
    vs_optimized = any(r.get("speedup_vs_plain_optimized") for r in results["aggregates"])
    lines += [
        "",
        "| data set | method | tok/s | speedup | " + ("vs plain_optimized | " if vs_optimized else "")
        + "tau | drafts | identical | draft ms | select ms | verify ms | rest ms | prefill ms |",
        "|---|---|---:|---:|" + ("---:|" if vs_optimized else "") + "---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for row in results["aggregates"]:
        split = row["time_split_ms_per_cycle"]
        ident = identity_cell(row)
        dagger = "" if row["tau_source"] == "generation_stats" or row["method"] in PLAIN_METHODS else "†"
        tau = _fmt(row["tau"]) + dagger
        drafts = _fmt(row.get("mean_draft_length"), ".2f", "-") + (dagger if row.get("mean_draft_length") else "")
        lines.append(
            f"| {row['dataset']} | {row['method']} | {_fmt(row['tokens_per_second'], '.1f')} | "
            f"{_fmt(row['speedup'])}x | "
            + (f"{_fmt(row.get('speedup_vs_plain_optimized'))}x | " if vs_optimized else "")
            + f"{tau} | {drafts} | {ident} | "
            f"{_fmt(split['draft'], '.1f', '-')} | "
            f"{_fmt(split['select'], '.1f', '-')} | {_fmt(split['verify'], '.1f', '-')} | "
            f"{_fmt(split['rest'], '.1f', '-')} | {_fmt(row['prefill_ms_per_call'], '.0f')} |")
    width = max((len(r["per_position_acceptance"] or []) for r in results["aggregates"]), default=0)
    if width:
        lines += ["", "Per-position acceptance (rate at which draft position i was accepted, among cycles that "
                  "proposed it):", "",
                  "| data set | method | " + " | ".join(str(i) for i in range(1, width + 1)) + " |",
                  "|---|---|" + "---:|" * width]
        for row in results["aggregates"]:
            acc = row["per_position_acceptance"]
            if not acc:
                continue
            cells = [_fmt(acc[i]) if i < len(acc) else "" for i in range(width)]
            lines.append(f"| {row['dataset']} | {row['method']} | " + " | ".join(cells) + " |")
    lines += selector_lines(results["aggregates"])
    lines += cost_curve_lines(results["aggregates"])
    lines += divergence_lines(results)
    lines += [
        "",
        "tok/s: new tokens / wall seconds of the generate() calls (pooled over prompts); speedup: tok/s over plain's "
        "in this same interleaved run; tau: tokens per target verification (generation_stats; † = from counting target "
        "forward calls with a hook); drafts: drafts verified per cycle (cycles with room for one; † = counted with the "
        "hook); identical: prompts whose greedy output equals plain greedy token for token (near-ties and bugs: see "
        "Divergences); "
        "ms columns: per verification cycle (plain: per decoding step), rest = wall time not spent in the other "
        "columns or the prefill. See docs/bench.md.",
        "",
        "Methods: " + "; ".join(f"`{m}` = {METHOD_DESCRIPTIONS[m]}" for m in s["methods"]) + ".",
    ]
    return "\n".join(lines) + "\n"


def selector_lines(aggregates: list[dict]) -> list[str]:
    """How often the candidate selector's path differed from the drafter's top-1 path (greedy methods with it)."""
    rows = [r for r in aggregates if r.get("selector_passes")]
    if not rows:
        return []
    return ["", "Candidate selector: share of drafter passes whose selector path differs from the top-1 path at some "
            "proposed position: " + "; ".join(f"{r['dataset']} `{r['method']}` {r['selector_changed']:.2f} of "
                                              f"{r['selector_passes']}" for r in rows) + "."]


def cost_curve_lines(aggregates: list[dict]) -> list[str]:
    """The verification cost curve ``dflash2_cost`` chose its draft lengths from, and how often it drafted nothing."""
    rows = [r for r in aggregates if r.get("cost_curve")]
    if not rows:
        return []
    curve = rows[0]["cost_curve"]
    relative = CostCurve.format_relative(curve)
    lines = ["", f"Draft length from the cost curve (`dflash2_cost`): verifying n tokens costs T_verify(n)/T_decode = "
                 f"{relative} (measured once: {curve['label']}, {curve['verify_ms']['1']:.1f} ms per decoding step)", ""]
    for r in rows:
        lines.append(f"- {r['dataset']}: the drafter ran in {100 * (r.get('drafted_cycles') or 0):.0f}% of the cycles, "
                     f"{100 * (r.get('copy_only_cycles') or 0):.0f}% verified a copy from the context made without it "
                     f"(the others were plain steps); {_fmt(r.get('mean_draft_length'))} drafts verified per cycle "
                     "that verified any")
    return lines


# ------------------------------------------------------------------ plots
def plot(results: dict, out_dir: Path) -> list[str]:
    """Writes ``acceptance_per_position.png`` and ``speedup.png``; returns the file names written."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    rows = results["aggregates"]
    methods = [m for m in results["settings"]["methods"]]
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    colors = {m: c for m, c in zip(methods, plt.rcParams["axes.prop_cycle"].by_key()["color"])}
    written = []
    title_suffix = ("greedy" if results["settings"]["greedy"] else f"T={results['settings']['temperature']}")
    title_suffix += f", max_new_tokens={results['settings']['max_new_tokens']}"

    # acceptance per position: one panel per data set, one line per speculative method
    panel_sets = [d for d in datasets if d != ALL] or datasets
    fig, axes = plt.subplots(1, len(panel_sets), figsize=(5.5 * len(panel_sets), 4.2), squeeze=False)
    markers = {"prompt_lookup": "s", "builtin_dflash": "^", "dflash2_top1": "v", "dflash2": "o"}
    offsets = {"prompt_lookup": -0.15, "builtin_dflash": -0.05, "dflash2_top1": 0.05, "dflash2": 0.15}
    for ax, dataset in zip(axes[0], panel_sets):
        for row in rows:
            acc = row["per_position_acceptance"]
            if row["dataset"] != dataset or not acc or row["method"] in PLAIN_METHODS:
                continue
            # small x offsets and distinct markers keep coinciding curves (e.g. all at 0) visible
            dx = offsets.get(row["method"], 0.0)
            xs = [i + 1 + dx for i, a in enumerate(acc) if a is not None]
            ys = [a for a in acc if a is not None]
            if xs:
                ax.plot(xs, ys, marker=markers.get(row["method"], "o"), ms=5, lw=1.5, alpha=0.85,
                        color=colors.get(row["method"]), label=f"{row['method']} (tau {_fmt(row['tau'])})")
        ax.set_title(f"{dataset}")
        ax.set_xlabel("draft position i")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_ylabel("acceptance rate")
        ax.set_ylim(-0.03, 1.03)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"Per-position acceptance ({title_suffix})")
    fig.tight_layout()
    fig.savefig(out_dir / "acceptance_per_position.png", dpi=120)
    plt.close(fig)
    written.append("acceptance_per_position.png")

    # speedup: grouped bars, one group per data set
    spec = [m for m in methods if m != "plain"]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(datasets) * max(1, len(spec)) / 2.5), 4.5))
    width = 0.8 / max(1, len(spec))
    for j, method in enumerate(spec):
        xs, ys = [], []
        for i, dataset in enumerate(datasets):
            row = next((r for r in rows if r["dataset"] == dataset and r["method"] == method), None)
            if row and row["speedup"] is not None:
                xs.append(i - 0.4 + width * (j + 0.5))
                ys.append(row["speedup"])
        bars = ax.bar(xs, ys, width=width, color=colors.get(method), label=method)
        for bar, y in zip(bars, ys):
            ax.annotate(f"{y:.2f}", (bar.get_x() + bar.get_width() / 2, y), ha="center", va="bottom", fontsize=7,
                        xytext=(0, 2), textcoords="offset points")
    ax.axhline(1.0, color="black", lw=1, ls="--", label="plain = 1.0")
    ax.set_xticks(range(len(datasets)))
    ax.set_xticklabels(datasets)
    ax.set_ylabel("speedup over plain generate() (x)")
    ax.set_title(f"Wall-clock speedup ({title_suffix})")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_dir / "speedup.png", dpi=120)
    plt.close(fig)
    written.append("speedup.png")
    return written


def write_outputs(results: dict, out_dir: str | os.PathLike, plots: bool = True) -> list[str]:
    """Writes ``results.json``, ``results.md`` and (``plots``) the PNGs into ``out_dir``; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(results, indent=1, default=str))
    os.replace(tmp, out / "results.json")
    (out / "results.md").write_text(markdown(results))
    written = [str(out / "results.json"), str(out / "results.md")]
    if plots:
        written += [str(out / name) for name in plot(results, out)]
    return written


def records_to_json(records: list[RawRecord]) -> list[dict]:
    return [asdict(r) for r in records]


__all__ = ["aggregate", "environment", "load_warning", "markdown", "plot", "write_outputs", "records_to_json", "ALL"]
