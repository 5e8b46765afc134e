"""Drafting milliseconds per proposal of several drafters, interleaved on the same contexts (fair under load).

The serving path of each drafter (``DFlash2CandidateGenerator.propose``: one full block after queuing the target
features of 2 new context tokens, as in the decoding loop) runs in turn, proposal by proposal, on a random 400-token
context of the target, so a busy machine slows every drafter alike. Prints the median ms per proposal of each::

    OMP_NUM_THREADS=1 taskset -c 1 .venv/bin/python examples/drafting_cost_by_arm.py \\
        --drafters runs/depth-study/L1-conv,runs/depth-study/L5-conv --dtype int8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dflash2_hf import DFlash2DraftModel, GenerationStats
from dflash2_hf.generation.candidate_generator import DFlash2CandidateGenerator
from dflash2_hf.quantization import quantize_drafter
from dflash2_hf.targets import load_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafters", required=True, help="comma-separated drafter folders")
    parser.add_argument("--dtype", choices=["fp32", "int8"], default="int8")
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=60, help="timed proposals per drafter")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    target, _ = load_target("smollm2")
    paths = args.drafters.split(",")
    ids = torch.randint(100, 20000, (1, 400 + 2 * (args.steps + 10)), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
    gens = []
    for path in paths:
        drafter = DFlash2DraftModel.from_pretrained(path, dtype=torch.float32).eval()
        if args.dtype == "int8":
            drafter = quantize_drafter(drafter)
        block = drafter.config.block_size
        gen = DFlash2CandidateGenerator(drafter, target, False, 1.0, True, GenerationStats(block_size=block))
        gen.add_context(hidden, 400)
        gen.propose(ids[:, :401], block - 1)
        gens.append((gen, block))
    times = [[] for _ in paths]
    for i in range(args.steps + 5):
        a, b = 400 + 2 * i, 400 + 2 * (i + 1)  # 2 newly verified tokens per cycle
        for k, (gen, block) in enumerate(gens):
            t0 = time.perf_counter()
            gen.add_context(tuple(h[:, a:b] for h in hidden), b - a)
            gen.propose(ids[:, : b + 1], block - 1)
            if i >= 5:
                times[k].append(1000 * (time.perf_counter() - t0))
    out = {p: round(statistics.median(t), 2) for p, t in zip(paths, times)}
    for p, ms in out.items():
        print(f"{p}: {ms:.2f} ms per proposal ({args.dtype}, {args.num_threads} thread(s))")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dtype": args.dtype, "threads": args.num_threads, "ms_per_proposal": out}, f, indent=1)


if __name__ == "__main__":
    main()
