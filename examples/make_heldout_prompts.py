"""Held-out prompt sets for the drafter's bar (JSONL files that `dflash2 bench --datasets` reads).

* ``sharegpt``: the first human turn of ShareGPT development records ``[--start, --start + n)`` (default 16500:
  the teacher-forced evaluations of training read [16000, 16200), so these were never used for tuning; records
  from 17000 on are never read).
  ``--test-set --start 17000``: the held-out test records, for reporting a release once.
* ``code``: "complete this function" prompts (the HumanEval instruction wording) built from documented public
  functions of THIRD-PARTY libraries installed next to this package (networkx, jinja2, click, fsspec, ...): code
  that is neither HumanEval nor the standard library the code LoRA adapter trains on.
* ``--validation-out``: a code VALIDATION set for choosing between training arms (teacher-forced, after
  ``dflash2 prepare-data --source`` lets the target write the answers), from other libraries again
  (:data:`VALIDATION_LIBRARIES`: fontTools, _pytest, anyio, ...), so the held-out prompts above are never used to
  tune anything. ShareGPT format (a JSON array), which ``prepare-data --source`` reads.

    python examples/make_heldout_prompts.py --out-dir runs/heldout --num-prompts 20
    dflash2 bench --datasets runs/heldout/sharegpt-16500.jsonl,runs/heldout/thirdparty-code.jsonl ...
    python examples/make_heldout_prompts.py --out-dir runs/heldout --validation-out data/validation-code-prompts.json
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from make_stdlib_code_prompts import package_stubs, write_prompt_file

from dflash2_hf.data import sharegpt_prompts
from dflash2_hf.data.humaneval import HUMANEVAL_INSTRUCTION

LIBRARIES = ("networkx", "jinja2", "click", "fsspec", "dateutil", "markdown_it", "pyarrow", "filelock", "idna")
# Never trained on either; these only pick between training arms. No library here copies stdlib modules (dill and
# multiprocess do), so no validation function is a training function under another name.
VALIDATION_LIBRARIES = ("fontTools", "_pytest", "anyio", "urllib3", "contourpy", "pyparsing", "regex",
                        "charset_normalizer", "pydantic_core")


def thirdparty_stubs(max_chars: int, libraries=LIBRARIES) -> list[tuple[str, str]]:
    """``(id, stub)`` of documented public top-level functions of ``libraries`` (those installed), shuffled."""
    out = package_stubs(libraries, max_chars)
    random.Random(0).shuffle(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--start", type=int, default=16500,
                        help="first ShareGPT record (< 17000: development records; 17000 or more needs --test-set)")
    parser.add_argument("--test-set", action="store_true",
                        help="allow ShareGPT records from 17000 on (the held-out test range: report a release on "
                             "them once, never choose or tune with them)")
    parser.add_argument("--max-chars", type=int, default=1200, help="skip code stubs longer than this")
    parser.add_argument("--validation-out", default=None,
                        help="also write a code validation set (ShareGPT-format JSON) from VALIDATION_LIBRARIES")
    parser.add_argument("--num-validation", type=int, default=160)
    args = parser.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stop = args.start + 4 * args.num_prompts
    chat = sharegpt_prompts(args.start, stop if args.test_set else min(stop, 17000),
                            allow_heldout=args.test_set)[: args.num_prompts]
    with open(out / f"sharegpt-{args.start}.jsonl", "w", encoding="utf-8") as f:
        for rid, text in chat:
            f.write(json.dumps({"id": f"sharegpt-{rid}", "prompt": text}) + "\n")
    code = thirdparty_stubs(args.max_chars)[: args.num_prompts]
    with open(out / "thirdparty-code.jsonl", "w", encoding="utf-8") as f:
        for sid, stub in code:
            f.write(json.dumps({"id": sid, "prompt": HUMANEVAL_INSTRUCTION.format(prompt=stub)}) + "\n")
    print(f"wrote {len(chat)} ShareGPT prompts (records {chat[0][0]}..{chat[-1][0]}) and {len(code)} third-party "
          f"code prompts to {out}")
    if args.validation_out:
        records = write_prompt_file(args.validation_out,
                                    thirdparty_stubs(args.max_chars, VALIDATION_LIBRARIES)[: args.num_validation])
        print(f"wrote {len(records)} validation code prompts to {args.validation_out}")


if __name__ == "__main__":
    main()
