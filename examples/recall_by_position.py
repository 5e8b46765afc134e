"""Recall by block position, teacher-forced, on held-out regenerated records (the DFlash2 blog's table).

For each data set, every response position whose next ``B - 1`` tokens are the target's greedy tokens anchors a
block; the target runs once per record (features + its own greedy labels), the drafter once per group of blocks.
Prints one markdown table per data set (rows: Recall@1, Recall@16, the selector's top-1 given the true
predecessor, and the chance that the top-1 path / the selector path / a perfect selector over the top-16 is right
at every slot up to t; columns: slots 1..B-1 and the implied teacher-forced tau) and writes them to ``--json``.
See :mod:`dflash2_hf.analysis.recall`.

    OMP_NUM_THREADS=1 taskset -c 1 .venv/bin/python examples/recall_by_position.py \\
        --drafter model_cards/dflash2-smollm2-135m-instruct \\
        --data chat=dataset_cards/smollm2-135m-instruct-sharegpt-regenerated \\
        --data code=dataset_cards/smollm2-135m-instruct-code-validation --records 60 --json runs/recall.json

``--data`` reads a dataset folder's ``dev`` split (held-out records; never a train split).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from dflash2_hf import DFlash2DraftModel
from dflash2_hf.analysis.recall import recall_by_position
from dflash2_hf.targets import load_target
from dflash2_hf.training import load_training_records

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default="model_cards/dflash2-smollm2-135m-instruct", help="drafter folder")
    parser.add_argument("--target", default="smollm2", help="target alias or folder (loaded in float32)")
    parser.add_argument("--data", action="append", required=True, metavar="NAME=FOLDER",
                        help="a held-out data set: its dev split is read (repeatable)")
    parser.add_argument("--records", type=int, default=60, help="first N records of each data set (by record_id)")
    parser.add_argument("--max-length", type=int, default=1024, help="cut each record to this many tokens")
    parser.add_argument("--drafter-dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--blocks-per-pass", type=int, default=64)
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--json", default=None, help="write the counts, rates and tau here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.num_threads)

    t0 = time.time()
    target, _ = load_target(args.target, dtype=torch.float32)
    drafter = DFlash2DraftModel.from_pretrained(args.drafter, dtype=DTYPES[args.drafter_dtype]).eval()
    out = {"drafter": args.drafter, "target": args.target, "target_dtype": "float32",
           "drafter_dtype": args.drafter_dtype, "max_length": args.max_length, "command": " ".join(sys.argv),
           "data": {}}
    for spec in args.data:
        name, _, folder = spec.partition("=")
        if not folder:
            name, folder = Path(spec).name, spec
        recs = load_training_records(folder, max_records=args.records, train_only=False)
        t1 = time.time()

        def progress(i, n, s):
            print(f"  {name}: record {i + 1}/{n}, {s.blocks} blocks, {time.time() - t1:.0f} s", file=sys.stderr,
                  flush=True)

        stats = recall_by_position(drafter, target, recs, max_length=args.max_length,
                                   blocks_per_pass=args.blocks_per_pass, progress=progress)
        agree = stats.agree / max(stats.checked, 1)
        print(f"\n### {name}: {stats.records} held-out records of {folder} (dev split, record ids "
              f"{recs[0]['record_id']}..{recs[-1]['record_id']}), {stats.blocks} full blocks "
              f"({stats.partial_blocks} anchors without {stats.slots} labelled slots left out); record tokens equal "
              f"to the target's greedy token: {stats.agree}/{stats.checked} ({agree:.4f})\n")
        print(stats.markdown(), flush=True)
        out["data"][name] = {"folder": folder, "record_ids": [r["record_id"] for r in recs],
                             "seconds": round(time.time() - t1, 1), **stats.to_dict()}
    out["seconds"] = round(time.time() - t0, 1)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        print(f"\nwrote {args.json} ({out['seconds']} s)")


if __name__ == "__main__":
    main()
