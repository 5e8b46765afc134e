"""Benchmark DFlash2 speculative decoding against plain generate() and the other baselines.

Runs every method on the same prompts, interleaved per prompt (rotating the method order), after one untimed
warm-up generation per method. Methods: plain, prompt_lookup, builtin_dflash (transformers' own DFlash loop with our
drafter), dflash2_top1 (our loop, selector off), dflash2 (our loop with the candidate selector), dflash2_dynamic
(dflash2 with a confidence-cut draft length), dflash2_cost (dflash2 with the draft length chosen from the measured
verification cost curve and the calibrated selector probabilities); with --adapter also dflash2_adapter (the
drafter plus a LoRA adapter), with --previous-drafter also dflash2_previous (another drafter, e.g. the last release).

Writes to --output-dir: results.json (settings, versions, machine, per-prompt raw numbers, aggregates), results.md (the
table printed at the end), acceptance_per_position.png and speedup.png. How to read the columns: docs/bench.md.

Examples:
  dflash2 bench --target smollm2 --drafter model_cards/dflash2-smollm2-135m-instruct --output-dir runs/bench
  dflash2 bench --target smollm2 --drafter fresh --datasets sharegpt,humaneval --num-prompts 2 \\
      --max-new-tokens 32 --output-dir runs/bench-smoke
  dflash2 bench --drafter my-drafter --datasets my_prompts.jsonl --temperature 0.7 --top-p 0.9 --output-dir runs/t07
"""

from __future__ import annotations

import argparse
import os
import sys

from dflash2_cli.arguments import add_bench_arguments as add_arguments  # noqa: F401 (the options: torch-free)
from dflash2_cli.arguments import default_bench_methods

from . import apply_cpu_kernels, resolve_device, resolve_drafter_dtype, resolve_dtype, warn_unused_sampling_filters


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def run(args: argparse.Namespace) -> int:
    import torch

    from .. import __version__  # noqa: F401  (importing dflash2_hf installs the generate() routing)
    from ..bench import BenchSettings, load_adapted_drafter, load_bench_prompts, load_drafter, run_benchmark
    from ..bench.runner import DRAFTER_METHODS, METHODS, OWN_DRAFTER_METHODS
    from ..targets import load_target

    methods = _csv(args.methods)
    if args.cpu_kernels == "stock" and args.methods == default_bench_methods():
        methods.remove("plain_optimized")  # the default list, without the method stock kernels cannot run
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        print(f"error: unknown method(s) {unknown}; choose from {list(METHODS)}", file=sys.stderr)
        return 2
    for method, value, flag in (("dflash2_adapter", args.adapter, "--adapter PATH (a LoRA adapter folder for --drafter)"),
                                ("dflash2_previous", args.previous_drafter,
                                 "--previous-drafter DRAFTER (another drafter for the target)")):
        if value and method not in methods:  # giving the flag selects its method
            methods.append(method)
        if method in methods and not value:
            print(f"error: method {method} needs {flag}", file=sys.stderr)
            return 2
    if "plain_optimized" in methods and args.cpu_kernels != "optimized":
        print("error: method plain_optimized needs --cpu-kernels optimized", file=sys.stderr)
        return 2
    if "plain" not in methods:
        print("note: adding 'plain' (the reference of speedup and identity)", file=sys.stderr)
    if args.adapter:
        from ..hub import is_local_path
        from ..lora import check_adapter_folder

        if is_local_path(args.adapter):
            check_adapter_folder(args.adapter)  # fail before loading any model
    from ..hub import check_hub_ids_reachable

    check_hub_ids_reachable(args.drafter, args.previous_drafter, args.adapter)  # before the target loads
    warn_unused_sampling_filters(args)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    device = resolve_device(args.device)
    dtype, dtype_label = resolve_dtype(args.dtype, device)
    settings = BenchSettings(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                             top_k=args.top_k, methods=tuple(methods), seed=args.seed,
                             prompt_lookup_num_tokens=args.prompt_lookup_tokens,
                             confidence_threshold=args.confidence_threshold, warmup=not args.no_warmup,
                             progress=not args.no_progress,
                             **({"near_tie_ulps": args.near_tie_ulps} if args.near_tie_ulps is not None else {}))
    torch.manual_seed(args.seed)
    print(f"target dtype: {dtype_label}", file=sys.stderr)
    target, tokenizer = load_target(args.target, dtype=dtype, device=device)
    reference = None
    if args.calibrate_fp32:
        if dtype == torch.float32 or not settings.greedy:
            print("note: --calibrate-fp32 needs greedy decoding and a bf16 target; skipped", file=sys.stderr)
        else:
            reference = load_target(args.target, dtype=torch.float32, device=device)[0]
    needs_drafter = any(m in DRAFTER_METHODS and m not in OWN_DRAFTER_METHODS for m in settings.methods)
    drafter_dtype, int8, drafter_dtype_label = resolve_drafter_dtype(args.drafter_dtype, target.device)
    drafter = load_drafter(args.drafter, target, dtype=drafter_dtype, int8=int8) if needs_drafter else None
    adapted = load_adapted_drafter(args.drafter, args.adapter, target, dtype=drafter_dtype,
                                   strict=not args.adapter_no_strict, int8=int8) if args.adapter else None
    previous_dtype, previous_int8, previous_dtype_label = (
        resolve_drafter_dtype(args.previous_drafter_dtype, target.device) if args.previous_drafter_dtype
        else (drafter_dtype, int8, drafter_dtype_label))
    previous = (load_drafter(args.previous_drafter, target, dtype=previous_dtype, int8=previous_int8)
                if args.previous_drafter else None)
    kernels = "stock CPU kernels"
    if device.type == "cpu":
        kernels = apply_cpu_kernels(args.cpu_kernels, target, drafter, adapted, previous)
        print(f"cpu kernels: {kernels} (method plain: stock kernels)", file=sys.stderr)
    prompts, skipped = load_bench_prompts(_csv(args.datasets), tokenizer, args.num_prompts,
                                          max_prompt_tokens=args.max_prompt_tokens or None, chat=not args.raw_prompts)
    meta = {"target": args.target, "drafter": args.drafter, "adapter": args.adapter,
            "previous_drafter": args.previous_drafter, "dtype": dtype_label,
            "drafter_dtype": drafter_dtype_label, "cpu_kernels": kernels,
            "previous_drafter_dtype": previous_dtype_label if args.previous_drafter else None,
            "datasets": _csv(args.datasets), "skipped_prompts_too_long": skipped,
            "max_prompt_tokens": args.max_prompt_tokens or None, "raw_prompts": args.raw_prompts,
            "command": "dflash2 " + " ".join(sys.argv[1:]) if sys.argv else None}
    if args.adapter:
        from ..lora import adapter_size_bytes, checkpoint_size_bytes

        meta["adapter_bytes"] = adapter_size_bytes(args.adapter)
        if os.path.isdir(args.drafter):
            meta["drafter_bytes"] = checkpoint_size_bytes(args.drafter)
    results = run_benchmark(target, drafter, prompts, settings, out_dir=args.output_dir, meta=meta, plots=not args.no_plots,
                            adapted_drafter=adapted, reference_target=reference, previous_drafter=previous)
    with open(f"{args.output_dir}/results.md") as f:
        print(f.read())
    print("wrote: " + ", ".join(results["files"]))
    from ..bench.report import load_warning

    warning = load_warning(results["environment"])
    if warning:
        print(f"WARNING: {warning}", file=sys.stderr)
    failed = [f"{r['dataset']}/{r['method']}" for r in results["aggregates"] if r["fidelity_ok"] is False]
    pooled = results["aggregates"][-1]["dataset"]
    print(f"speedup over plain ({pooled}): " + ", ".join(
        f"{r['method']} {r['speedup']:.2f}x" for r in results["aggregates"]
        if r["dataset"] == pooled and r["method"] != "plain" and r["speedup"] is not None))
    near_ties = sum(r["near_ties"] or 0 for r in results["aggregates"] if r["dataset"] == pooled)
    if near_ties:
        print(f"note: {near_ties} output(s) part from plain greedy at near-ties (within {dtype_label.split()[0]} "
              "rounding; see 'Divergences' in results.md)", file=sys.stderr)
    if failed:  # fp32: any divergence; bf16: one that rounding cannot explain. A lossless method broke: a bug
        print(f"ERROR: greedy output differs from plain greedy beyond rounding for {failed} (see 'Divergences' in "
              "results.md, 'divergence' in results.json records)", file=sys.stderr)
        return 1
    return 0
