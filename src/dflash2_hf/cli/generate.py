"""Generate text from a prompt with a DFlash2 drafter (streams the text, prints tau and the time split).

Example:
    dflash2 generate --target smollm2 --drafter dflash2-smollm2-135m-instruct \\
        --prompt "Write a haiku about the sea." --max-new-tokens 64 --compare
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import TextStreamer

from dflash2_cli.arguments import DEFAULT_DRAFTER  # noqa: F401 (re-exported)
from dflash2_cli.arguments import add_generate_arguments as add_arguments  # noqa: F401 (the options: torch-free)

from . import apply_cpu_kernels, resolve_device, resolve_drafter_dtype, resolve_dtype, warn_unused_sampling_filters


def prompt_ids(tokenizer, text: str) -> torch.LongTensor:
    """``(1, T)`` ids of a single user turn rendered with the chat template (raw text if there is none)."""
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
    return tokenizer(text, return_tensors="pt")["input_ids"]


def load_target_and_drafter(args: argparse.Namespace):
    """``(target, tokenizer, drafter, dtype labels)`` from ``--target/--drafter/--dtype/--drafter-dtype/--device/
    --num-threads/--cpu-kernels`` and generate's ``--adapter`` (merged into the drafter) (the set-up ``generate`` and
    ``demo`` share); prints the resolved dtypes, device and CPU kernels."""
    from ..hub import check_hub_ids_reachable
    from ..targets import load_target

    adapter = getattr(args, "adapter", None)  # generate has --adapter, demo not
    if adapter:  # a missing, incomplete or non-adapter folder (a drafter, say): refused before any model loads
        from ..hub import is_local_path
        from ..lora import check_adapter_folder
        from ..shipped import resolve_name_or_path

        path = resolve_name_or_path(adapter)
        if is_local_path(path):
            check_adapter_folder(path)
    check_hub_ids_reachable(args.drafter, adapter)  # a Hub id with no Hub: fail now, not after the target loads
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    device = resolve_device(args.device)
    dtype, dtype_label = resolve_dtype(args.dtype, device)
    drafter_dtype_label = resolve_drafter_dtype(args.drafter_dtype, device)[2]  # refuses int8 where it cannot run
    print(f"target dtype: {dtype_label}; drafter dtype: {drafter_dtype_label}; device: {device}")
    target, tokenizer = load_target(args.target, dtype=dtype, device=device)
    from ..loading import load_drafter

    drafter = load_drafter(args.drafter, target, precision=args.drafter_dtype, cpu_kernels=args.cpu_kernels,
                           adapter=adapter)
    if device.type == "cpu":
        from ..cpu_kernels import cpu_kernels_summary

        print(f"cpu kernels: target: {apply_cpu_kernels(args.cpu_kernels, target)}; "
              f"drafter: {cpu_kernels_summary(drafter)}")
    return target, tokenizer, drafter, (dtype_label, drafter_dtype_label)


def run(args: argparse.Namespace) -> int:
    warn_unused_sampling_filters(args)
    target, tokenizer, drafter, _ = load_target_and_drafter(args)
    drafter.use_selector = not args.no_selector
    drafter.generation_config.assistant_confidence_threshold = args.confidence_threshold or None
    drafter.generation_config.num_assistant_tokens_schedule = "cost" if args.cost_schedule else None
    ids = prompt_ids(tokenizer, args.prompt).to(target.device)
    sampling = dict(do_sample=args.temperature > 0)
    if args.temperature > 0:
        sampling.update(temperature=args.temperature, top_p=args.top_p,
                        **({"top_k": args.top_k} if args.top_k is not None else {}))
    kw = dict(max_new_tokens=args.max_new_tokens, **sampling)
    if args.compare:  # both paths warm before either is timed
        for extra in ({"assistant_model": drafter}, {}):
            target.generate(ids, **{**kw, "max_new_tokens": 4}, **extra)

    start = time.perf_counter()
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    out = target.generate(ids, assistant_model=drafter, streamer=streamer, **kw)
    spec_s = time.perf_counter() - start
    stats = drafter.generation_stats
    new = out.shape[1] - ids.shape[1]
    print(f"\n--- {new} tokens in {spec_s:.2f} s ({new / spec_s:.1f} tokens/s), tau = {stats.tau:.2f} "
          f"over {stats.num_cycles} cycles, {stats.mean_draft_length:.2f} drafts verified per cycle")
    per = max(stats.num_cycles, 1)
    print(f"per cycle: drafter {1e3 * stats.draft_seconds / per:.1f} ms, selector {1e3 * stats.select_seconds / per:.1f} ms, "
          f"verification {1e3 * stats.verify_seconds / per:.1f} ms, rest {1e3 * stats.other_seconds / per:.1f} ms")
    if stats.cost_curve:
        from ..generation.draft_length import CostCurve

        print(f"cost schedule: T_verify(n)/T_decode = {CostCurve.format_relative(stats.cost_curve)}; the drafter ran in {stats.drafter_passes} of "
              f"{stats.num_cycles} cycles, {stats.copies_without_drafting} verified a copy from the context made without "
              "it (the others were plain steps)")
    if args.compare:
        start = time.perf_counter()
        ref = target.generate(ids, **kw)
        plain_s = time.perf_counter() - start
        ref_new = ref.shape[1] - ids.shape[1]
        print(f"plain generate(): {ref_new} tokens in {plain_s:.2f} s ({ref_new / plain_s:.1f} tokens/s); "
              f"speedup {(new / spec_s) / (ref_new / plain_s):.2f}x")
        if not sampling["do_sample"]:
            print("greedy outputs identical:", torch.equal(ref, out))
            if not torch.equal(ref, out):
                from ..bench.fidelity import describe, explain_divergences

                found = explain_divergences(target, ids, ref[0, ids.shape[1]:].tolist(),
                                            {"dflash2": out[0, ids.shape[1]:].tolist()}, kw)
                print(f"first divergence: {describe(found['dflash2'])}")
                return 0 if found["dflash2"].near_tie else 1
    return 0
