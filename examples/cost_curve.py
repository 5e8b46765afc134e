"""What a drafter must reach to give a speedup on THIS machine: the target's verification cost curve.

Speculative decoding pays one drafter pass plus one target forward over ``n = drafts + 1`` tokens per cycle and
gets ``tau`` tokens for it, against one plain decoding step per token. So (DESIGN.md section 8)

    speedup = tau * T_decode / (T_draft + T_verify(n))        and        tau_needed(S) = S * (T_draft + T_verify(n)) / T_decode

This script measures ``T_verify(n)`` (a target forward over ``n`` new tokens on a KV cache of a real prompt, with the
drafter's hidden-state layers requested, as the loop runs it), ``T_decode = T_verify(1)`` and ``T_draft`` (one drafter
proposal of a full block, fp32 and bf16), each the median of ``--repeats`` interleaved timings, and prints the cost
ratios, the tau each block size needs for 1x / 1.8x, and the best speedup a perfect drafter (``tau = n``) could give.
No training or data is involved: it bounds what any drafter can do with this target on this hardware.
``--dtype`` is the target's (default ``auto``: bf16 where the CPU/GPU computes it natively, else fp32, as the main job
picks it; the first line says which and why); compare fp32 and bf16 targets with two runs.

    PYTHONPATH=src python examples/cost_curve.py --num-threads 1
    PYTHONPATH=src python examples/cost_curve.py --num-threads 2 --dtype bf16
    PYTHONPATH=src python examples/cost_curve.py --num-threads 2 --cpu-kernels stock   # without optimize_for_cpu
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time

import torch

import dflash2_hf  # noqa: F401
from dflash2_hf import GenerationStats
from dflash2_hf.bench import load_bench_prompts, load_drafter
from dflash2_hf.cli import DTYPES, apply_cpu_kernels, resolve_dtype
from dflash2_hf.generation.candidate_generator import DFlash2CandidateGenerator
from dflash2_hf.quantization import int8_support
from dflash2_hf.targets import load_target


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--drafter", default="model_cards/dflash2-smollm2-135m-instruct")
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--sizes", default="1,2,3,4,6,8,12,16", help="verification lengths n (tokens per forward)")
    parser.add_argument("--dtype", default="auto", choices=DTYPES,
                        help="target dtype (default auto: bf16 where this CPU computes it natively, else fp32)")
    parser.add_argument("--cpu-kernels", default="optimized", choices=("optimized", "stock"),
                        help="target and drafters on prepacked oneDNN linears (dflash2_hf.optimize_for_cpu) or stock")
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)

    dtype, dtype_label = resolve_dtype(args.dtype, "cpu")
    target, tokenizer = load_target(args.target, dtype=dtype)
    prompt = load_bench_prompts(["sharegpt"], tokenizer, num_prompts=1)[0]["sharegpt"][0]
    ids = torch.tensor([prompt.input_ids])
    drafters = {name: load_drafter(args.drafter, target, dtype=dtype)
                for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
    if int8_support("cpu")[0]:
        drafters["int8"] = load_drafter(args.drafter, target, int8=True)
    kernels = apply_cpu_kernels(args.cpu_kernels, target, *drafters.values())
    layers = [i + 1 for i in drafters["fp32"].config.target_layer_ids]
    block = drafters["fp32"].config.block_size

    with torch.no_grad():
        prefill = target(ids, use_cache=True, output_hidden_states=True)
    cache, context = prefill.past_key_values, prefill.hidden_states
    prompt_len = ids.shape[1]
    sizes = sorted({1, *(int(s) for s in args.sizes.split(","))})  # n = 1 is T_decode, the reference
    new_tokens = {n: torch.randint(0, 1000, (1, n)) for n in sizes}
    # transformers 5.24 renamed the forward's cache argument past_key_values -> cache
    cache_arg = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"

    def verify(n: int) -> None:
        with torch.no_grad():
            target(new_tokens[n], use_cache=True, output_hidden_states=layers,
                   position_ids=torch.arange(prompt_len, prompt_len + n)[None], **{cache_arg: cache})
        cache.crop(-n)

    def draft_step(name: str) -> None:  # steady state: cached context, only the newly accepted positions to add
        gen = steady[name]
        gen.add_context(tuple(h[:, prompt_len - 4:] for h in context), 3)
        gen.propose(ids, block - 1)
        gen.cache.crop(-3)  # back to the state before this step
        gen.context_positions = prompt_len - 4

    steady = {}
    for name in drafters:
        steady[name] = DFlash2CandidateGenerator(drafters[name], target, False, 1.0, True,
                                                 GenerationStats(block_size=block))
        steady[name].add_context(context, prompt_len - 4)
        steady[name].propose(ids[:, :prompt_len - 3], block - 1)
    for n in sizes:  # warm-up
        verify(n)
    verify_ms = {n: [] for n in sizes}
    draft_ms = {name: [] for name in drafters}
    for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits every entry alike
        for n in sizes:
            verify_ms[n].append(median_ms(lambda: verify(n), 1))
        for name in drafters:
            draft_ms[name].append(median_ms(lambda: draft_step(name), 1))
    verify_ms = {n: statistics.median(v) for n, v in verify_ms.items()}
    draft_ms = {name: statistics.median(v) for name, v in draft_ms.items()}
    decode = verify_ms[1]

    print(f"target {args.target} in {dtype_label}, prompt {prompt_len} tokens, torch threads {args.num_threads}, "
          f"median of {args.repeats}; {kernels}")
    print(f"drafter proposal of a full block (B={block}), context cached: "
          + ", ".join(f"{name} {ms:.1f} ms ({ms / decode:.2f} decode steps)" for name, ms in draft_ms.items()))
    best_draft = min(draft_ms.values())
    print(f"\n{'n':>3} {'T_verify ms':>12} {'/T_decode':>10} {'tau for 1x':>11} {'tau for 1.8x':>13} "
          f"{'max speedup (tau=n)':>20}")
    for n in sizes:
        cycle = best_draft + verify_ms[n]
        if n == 1:  # a plain decoding step: no drafts, so no tau to reach
            print(f"{n:>3} {verify_ms[n]:>12.1f} {1:>10.2f} {'-':>11} {'-':>13} {'-':>20}")
            continue
        print(f"{n:>3} {verify_ms[n]:>12.1f} {verify_ms[n] / decode:>10.2f} {cycle / decode:>11.2f} "
              f"{1.8 * cycle / decode:>13.2f} {n * decode / cycle:>19.2f}x")
    print("\ntau for S = S * (T_draft + T_verify(n)) / T_decode, with the cheaper drafter dtype; "
          "n = drafts + 1 verified per cycle (a full block of B verifies n = B); n = 1 is plain decoding (T_decode).")


if __name__ == "__main__":
    main()
