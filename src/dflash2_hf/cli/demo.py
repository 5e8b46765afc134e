"""The main job: the shipped drafter on the bundled real target, real prompts, text + tau + speedup.

Runs plain ``generate()``, ``generate(..., assistant_model=draft)`` with full blocks, and the same with the draft
length chosen from the measured verification cost curve (``draft.generation_config.num_assistant_tokens_schedule =
"cost"``; the curve and the choices are printed) side by side (interleaved, same prompts, same dtype, same
``max_new_tokens``) on ShareGPT development records [16000, 17000) and HumanEval, prints every generated text, whether
greedy outputs were identical (a divergence: near-tie or bug), ``tau`` and the measured speedups; writes the full
benchmark files too. The target's and the drafter's dtypes default to ``auto``: the fastest on this machine (the
target in bf16 where the device computes it natively, else fp32; the drafter in int8 on x86 CPUs, else bf16 where
native, else fp32); the output names them and why.
"""

from __future__ import annotations

import argparse
import sys

from dflash2_cli.arguments import add_demo_arguments as add_arguments  # noqa: F401 (the options: torch-free)


def run(args: argparse.Namespace) -> int:
    from ..bench import BenchSettings, load_bench_prompts, run_benchmark
    from ..bench.fidelity import describe
    from ..bench.report import cost_curve_lines
    from .generate import load_target_and_drafter

    target, tokenizer, drafter, (dtype_label, drafter_dtype_label) = load_target_and_drafter(args)
    device = target.device
    prompts, _ = load_bench_prompts(args.datasets.split(","), tokenizer, num_prompts=args.num_prompts)
    from ..cpu_kernels import cpu_kernels_summary, is_optimized

    optimized = is_optimized(target)
    methods = (("plain",) + (("plain_optimized",) if optimized else ()) + ("dflash2",)
               + (() if args.no_cost_schedule else ("dflash2_cost",))
               + (("dflash2_dynamic",) if args.confidence_threshold else ()))
    settings = BenchSettings(max_new_tokens=args.max_new_tokens, methods=methods,
                             confidence_threshold=args.confidence_threshold or 0.7)
    results = run_benchmark(target, drafter, prompts, settings, out_dir=args.output_dir,
                            meta={"target": args.target, "drafter": args.drafter, "dtype": dtype_label,
                                  "drafter_dtype": drafter_dtype_label,
                                  "cpu_kernels": cpu_kernels_summary(target)})

    texts = {}
    for rec in results["records"]:
        texts.setdefault((rec["dataset"], rec["prompt_id"]), {})[rec["method"]] = rec
    labels = {"dflash2": "full blocks", "dflash2_cost": "draft length from the cost curve",
              "dflash2_dynamic": f"draft cut at confidence < {args.confidence_threshold}"}
    for (dataset, prompt_id), by_method in texts.items():
        print(f"\n=== {dataset} {prompt_id}: plain generate() {by_method['plain']['tokens_per_second']:.1f} tokens/s"
              + (f" (optimized kernels: {by_method['plain_optimized']['tokens_per_second']:.1f})" if optimized else ""))
        for method, label in labels.items():
            if method in by_method:
                rec = by_method[method]
                diverged = f" ({describe(rec['divergence'])})" if rec.get("divergence") else ""
                print(f"    {label}: tau {rec['generation_stats']['tau']:.2f}, {rec['tokens_per_second']:.1f} tokens/s, "
                      f"identical to plain greedy: {rec['identical_to_plain']}{diverged}")
        print(tokenizer.decode(by_method["dflash2"]["output_ids"], skip_special_tokens=True))

    print("\n" + "=" * 72)
    print(f"target dtype {dtype_label}, drafter dtype {drafter_dtype_label}, device {device}, "
          f"{cpu_kernels_summary(target) if device.type == 'cpu' else 'GPU kernels'}")
    if optimized:
        row = [a for a in results["aggregates"] if a["method"] == "plain_optimized"][-1]  # pooled over data sets
        print(f"{row['dataset']:>10} {'plain generate(), optimized kernels':>32}: speedup {row['speedup']:.2f}x over plain "
              "generate() on stock kernels")
    for agg in results["aggregates"]:
        if agg["method"] not in labels:
            continue
        near = f" ({agg['near_ties']} near-tie{'s' if agg['near_ties'] > 1 else ''})" if agg["near_ties"] else ""
        print(f"{agg['dataset']:>10} {labels[agg['method']]:>32}: tau {agg['tau']:.2f}, "
              f"{agg['mean_draft_length']:.2f} drafts verified per cycle, speedup {agg['speedup']:.2f}x over plain "
              f"generate()" + (f" ({agg['speedup_vs_plain_optimized']:.2f}x over plain on the same optimized kernels)"
                               if optimized else "") + f", greedy identical: {agg['identical_all']}{near}")
    print("\n".join(line for line in cost_curve_lines(results["aggregates"]) if line))
    print(f"full results: {args.output_dir}/results.md, {args.output_dir}/results.json")
    from ..bench.report import load_warning

    warning = load_warning(results["environment"])
    if warning:  # the same check as `dflash2 bench`: speedups measured next to other work are not to be trusted
        print(f"WARNING: {warning}", file=sys.stderr)
    # a greedy output that differs from plain greedy beyond rounding (fp32: at all) is a bug: fail loudly
    bugs = [f"{a['dataset']}/{a['method']}" for a in results["aggregates"] if a["method"] in labels
            and a["fidelity_ok"] is False]
    if bugs:
        print(f"ERROR: greedy output differs from plain greedy beyond rounding for {bugs} (see 'Divergences' in "
              f"{args.output_dir}/results.md)", file=sys.stderr)
    return 1 if bugs else 0

