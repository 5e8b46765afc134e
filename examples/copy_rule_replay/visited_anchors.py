"""Why the serving loop's position-1 acceptance sits below the teacher-forced slot-1 accuracy of the recall table.

The table (docs/claims.md) anchors a block at EVERY response position. The loop anchors where the last cycle left
off: at the bonus token, i.e. mostly right after a draft was rejected, where the text has just done something the
drafter did not expect. This script reads collect.py's records (the drafter's selector path from every position of
each prompt's greedy answer, teacher-forced, fp32) and prints slot-1 accuracy over:

* all anchors (the table's measure);
* the anchors a drafter-only loop visits (full blocks, no copying: next anchor = anchor + accepted + 1);
* anchors right after a slot-1 miss / hit from the previous position.

    python examples/copy_rule_replay/visited_anchors.py runs/copysim/all.jsonl
"""
import json
import sys
from collections import defaultdict

BLOCK = 7  # draft slots after the anchor


def accepted(path, seq, anchor):
    """How many of ``path``'s tokens match the greedy answer after ``anchor``."""
    k = 0
    while k < BLOCK and anchor + 1 + k < len(seq) and path[k] == seq[anchor + 1 + k]:
        k += 1
    return k


def main(path):
    rows = defaultdict(lambda: defaultdict(lambda: [0, 0]))  # data set -> subset -> [anchors, slot 1 right]
    for line in open(path):
        rec = json.loads(line)
        seq, start, paths = rec["seq"], rec["prompt_len"] - 1, rec["paths"]
        name = rec["dataset"]
        n = sum(1 for i in range(len(paths)) if start + i + 1 < len(seq))
        acc = [accepted(paths[i], seq, start + i) for i in range(n)]

        def count(subset, i):
            rows[name][subset][0] += 1
            rows[name][subset][1] += acc[i] >= 1

        for i in range(n):
            count("all anchors", i)
            if i:
                count("after a slot-1 miss" if paths[i - 1][0] != seq[start + i] else "after a slot-1 hit", i)
        i = 0
        while i < n:
            count("visited by the loop", i)
            i += acc[i] + 1
    for name, subsets in rows.items():
        print(name)
        for subset in ("all anchors", "visited by the loop", "after a slot-1 miss", "after a slot-1 hit"):
            total, right = subsets[subset]
            print(f"  {subset:22s} slot 1 {right / total:.3f}  ({total} anchors)")


if __name__ == "__main__":
    main(sys.argv[1])
