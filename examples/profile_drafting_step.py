"""Where one drafting step's time goes: ``torch.profiler`` over the serving path's proposals (no target forwards).

A random 480-token context is run through the target once; then, as in the decoding loop, each step queues the
target features of 2 new context tokens and proposes a full block (``DFlash2CandidateGenerator.propose``). Prints the
mean wall time per proposal and the profiler's table of operators by self CPU time::

    OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python examples/profile_drafting_step.py --drafter-dtype int8
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from dflash2_hf import DFlash2DraftModel, GenerationStats
from dflash2_hf.generation.candidate_generator import DFlash2CandidateGenerator
from dflash2_hf.quantization import quantize_drafter
from dflash2_hf.targets import load_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default="model_cards/dflash2-smollm2-135m-instruct")
    parser.add_argument("--drafter-dtype", choices=["fp32", "bf16", "int8"], default="fp32")
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20, help="timed proposals (then 10 profiled ones)")
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    target, _ = load_target("smollm2")
    dtype = torch.bfloat16 if args.drafter_dtype == "bf16" else torch.float32
    drafter = DFlash2DraftModel.from_pretrained(args.drafter, dtype=dtype).eval()
    if args.drafter_dtype == "int8":
        drafter = quantize_drafter(drafter)
    ids = torch.randint(100, 20000, (1, 400 + 2 * (args.steps + 20)), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
    block = drafter.config.block_size
    gen = DFlash2CandidateGenerator(drafter, target, False, 1.0, True, GenerationStats(block_size=block))
    gen.add_context(hidden, 400)
    gen.propose(ids[:, :401], block - 1)

    def step(i: int) -> None:
        a, b = 400 + 2 * i, 400 + 2 * (i + 1)  # 2 newly verified tokens per cycle
        gen.add_context(tuple(h[:, a:b] for h in hidden), b - a)
        gen.propose(ids[:, : b + 1], block - 1)

    for i in range(5):
        step(i)
    t0 = time.perf_counter()
    for i in range(5, 5 + args.steps):
        step(i)
    print(f"{1000 * (time.perf_counter() - t0) / args.steps:.1f} ms per proposal ({args.drafter_dtype}, "
          f"{args.num_threads} thread(s))")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(5 + args.steps, 15 + args.steps):
            step(i)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
