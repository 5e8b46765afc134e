"""Teacher-forced acceptance through the serving path, by where the anchor sits in its response.

For held-out regenerated records (the target's own greedy answers), every ``--stride``-th response position is an
anchor: a fresh drafter call with the target's hidden states of ``[0, a)`` drafts ``B - 1`` tokens (exactly what
the decoding loop computes there, see ``check_estimate_vs_loop.py``) and the run that matches the record counts as
accepted. The anchors are bucketed by turn and by offset inside the response, so one sees where a drafter accepts
little: ``dflash2 bench`` and the release bar measure the first ``max_new_tokens`` tokens of a first turn.

    cd examples && ../.venv/bin/python acceptance_by_position.py \\
        --drafter ../model_cards/dflash2-smollm2-135m-instruct \\
        --data ../dataset_cards/smollm2-135m-instruct-sharegpt-regenerated --records 40 --stride 3

Several ``--drafter`` values are measured on the same anchors, one table row per bucket and drafter; ``--int8`` adds
each drafter's int8 drafting copy (:func:`dflash2_hf.quantization.quantize_drafter`, what ``--drafter-dtype auto``
drafts with on AVX2-only CPUs) as a column of its own.
"""

from __future__ import annotations

import argparse
import copy
from collections import defaultdict

import torch
from check_estimate_vs_loop import accepted_run

from dflash2_hf import DFlash2DraftModel, GenerationStats
from dflash2_hf.generation.candidate_generator import DFlash2CandidateGenerator
from dflash2_hf.quantization import quantize_drafter
from dflash2_hf.targets import load_target
from dflash2_hf.training import load_training_records


def bucket(turn: int, offset: int, edges: list[int]) -> str:
    """The row of an anchor ``offset`` tokens into response ``turn`` (0-based)."""
    if turn > 0:
        return "turn 2+"
    lo = 0
    for hi in edges:
        if offset < hi:
            return f"turn 1 [{lo}, {hi})"
        lo = hi
    return f"turn 1 [{lo}, ...)"


def response_runs(mask: list[int]) -> list[tuple[int, int]]:
    """``[(start, end), ...]``: the responses of a record (runs of 1 in its ``response_mask``), in order."""
    runs, start = [], None
    for p, m in enumerate([*mask, 0]):
        if m and start is None:
            start = p
        elif not m and start is not None:
            runs.append((start, p))
            start = None
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", action="append", required=True, help="drafter folder (repeatable)")
    parser.add_argument("--data", required=True,
                        help="regenerated HELD-OUT records: a dataset folder (its dev split is read) or prepare-data")
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--records", type=int, default=40, help="first N records")
    parser.add_argument("--stride", type=int, default=3, help="every N-th response position is an anchor")
    parser.add_argument("--edges", default="16,96", help="turn-1 offset bucket edges, comma-separated")
    parser.add_argument("--max-length", type=int, default=1024, help="cut each record to this many tokens")
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--int8", action="store_true", help="also measure each drafter's int8 drafting copy")
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    edges = [int(e) for e in args.edges.split(",")]

    target, _ = load_target(args.target)
    drafters = {d: DFlash2DraftModel.from_pretrained(d, dtype=torch.float32).eval() for d in args.drafter}
    if args.int8:
        drafters.update({f"{d} (int8)": quantize_drafter(copy.deepcopy(m)) for d, m in list(drafters.items())})
    recs = load_training_records(args.data, max_records=args.records, train_only=False)
    counts = {d: defaultdict(lambda: [0, 0, 0]) for d in drafters}  # bucket -> [anchors, accepted, position 1]
    for r in recs:
        ids = torch.tensor([r["input_ids"][: args.max_length]])
        seq = ids[0].tolist()
        with torch.no_grad():
            hidden = target(ids, output_hidden_states=True).hidden_states
        for turn, (start, end) in enumerate(response_runs(r["response_mask"])):
            end = min(end, len(seq))
            for a in range(start - 1, end - 1, args.stride):  # a = start - 1: the prompt's last token anchors
                row = bucket(turn, a - start + 1, edges)
                for name, drafter in drafters.items():
                    B = drafter.config.block_size
                    gen = DFlash2CandidateGenerator(drafter, target, False, 1.0, True, GenerationStats(block_size=B))
                    gen.add_context(hidden, a)
                    run = accepted_run(gen.propose(ids[:, : a + 1], B - 1).tokens[0].tolist(), seq[a + 1 : end])
                    c = counts[name][row]
                    c[0], c[1], c[2] = c[0] + 1, c[1] + run, c[2] + (run >= 1)
    print(f"{len(recs)} held-out records of {args.data}, every {args.stride}th anchor\n")
    print("| anchor | anchors | " + " | ".join(f"tau / position 1: {d}" for d in drafters) + " |")
    print("|---|---:|" + "---:|" * len(drafters))
    first = counts[next(iter(drafters))]
    rows = [bucket(0, lo, edges) for lo in [0] + edges] + [bucket(1, 0, edges)]
    for row in (row for row in rows if row in first):
        cells = [f"{1 + counts[d][row][1] / counts[d][row][0]:.3f} / {counts[d][row][2] / counts[d][row][0]:.3f}"
                 for d in drafters]
        print(f"| {row} | {first[row][0]} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
