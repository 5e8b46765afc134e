"""Builds a code-completion prompt set from the Python standard library (and, with --packages, installed
third-party packages), in ShareGPT format.

Each prompt asks to complete one documented stdlib function given its signature and docstring (body removed):
"Complete the following Python function:" + a fenced code block, the same instruction wording `dflash2 bench` uses
for HumanEval prompts. The functions come from the standard library of the running Python (no download, no
HumanEval). Feed the file to `dflash2 prepare-data --source` so the TARGET writes the answers:

    python examples/make_stdlib_code_prompts.py --out data/stdlib-code-prompts.json --max-prompts 1500
    dflash2 prepare-data --target smollm2 --source data/stdlib-code-prompts.json --output-dir data/smollm2-stdlib-code \\
        --start 0 --stop 1500 --batch-size 64 --max-new-tokens 192

Functions are taken in a fixed, shuffled order (seed 0); private names, methods, functions with a docstring shorter
than 40 characters and duplicate names are skipped.

A code LoRA adapter trained on the stdlib alone generalises poorly to other code; add the documented functions of
installed third-party packages (never the held-out or validation libraries of `examples/make_heldout_prompts.py`,
which are refused):

    python examples/make_stdlib_code_prompts.py --out data/code-prompts.json --max-prompts 3000 \
        --packages numpy,pandas,sympy,matplotlib,requests,rich,pygments,yaml,packaging,pydantic,transformers

A code adapter on top of a base drafter that trained on those prompts needs functions the base never saw: take them
from other packages only (``--no-stdlib``), skipping every name of the base's packages (``--exclude-packages``);
packages installed just for this can sit in a ``pip install --target DIR`` folder on ``PYTHONPATH``::

    PYTHONPATH=/tmp/extra-pkgs python examples/make_stdlib_code_prompts.py --out data/adapter-code-prompts.json \
        --max-prompts 3000 --no-stdlib --exclude-packages numpy,pandas,...,PIL --packages django,sqlalchemy,scipy,...
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import random
import sys
import sysconfig
from pathlib import Path

from dflash2_hf.data.humaneval import HUMANEVAL_INSTRUCTION


def function_stubs(path: Path):
    """``(name, stub source)`` for each documented top-level public function of one module file."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node, clean=True)
        if not doc or len(doc) < 40:
            continue
        node.body = [ast.Expr(ast.Constant(doc))]
        node.decorator_list = []
        stub = ast.unparse(node)
        # ast.unparse writes the docstring as one repr() line; re-indent it as a normal triple-quoted block
        header = stub.split("\n", 1)[0]
        body = "\n".join(("    " + line) if line else "" for line in doc.splitlines())
        yield node.name, f'{header}\n    """\n{body}\n    """\n'


def package_stubs(packages, max_chars: int, seen: set | None = None) -> list[tuple[str, str]]:
    """``(id, stub)`` of the documented public top-level functions of installed ``packages`` (import names; those
    not installed are skipped), test folders excluded, in file order; names in ``seen`` (updated) are skipped."""
    out, seen = [], set() if seen is None else seen
    for lib in packages:
        spec = importlib.util.find_spec(lib)
        if spec is None or not spec.submodule_search_locations:
            continue
        root = Path(list(spec.submodule_search_locations)[0])
        for path in sorted(p for p in root.rglob("*.py") if "tests" not in p.parts and "test" not in p.parts):
            for name, stub in function_stubs(path):
                if name not in seen and len(stub) <= max_chars:
                    seen.add(name)
                    out.append((f"{lib}/{path.relative_to(root)}:{name}", stub))
    return out


def write_prompt_file(path, stubs) -> list[dict]:
    """Writes ``(id, stub)`` pairs as "complete this function" prompts in ShareGPT format (what
    ``prepare-data --source`` reads); returns the records."""
    records = [{"id": sid, "conversations": [{"from": "human", "value": HUMANEVAL_INSTRUCTION.format(prompt=stub)}]}
               for sid, stub in stubs]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(records, indent=0), encoding="utf-8")
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output JSON array (ShareGPT format)")
    parser.add_argument("--max-prompts", type=int, default=1500)
    parser.add_argument("--max-chars", type=int, default=1500, help="skip stubs longer than this")
    parser.add_argument("--packages", default="",
                        help="comma-separated import names of installed third-party packages to add (not the "
                             "held-out libraries of make_heldout_prompts.py)")
    parser.add_argument("--no-stdlib", action="store_true",
                        help="prompts from --packages only; stdlib function names are still skipped there")
    parser.add_argument("--exclude-packages", default="",
                        help="comma-separated packages whose function names are skipped and never written (e.g. "
                             "the base drafter's training packages, so a code adapter trains on functions it "
                             "never saw)")
    args = parser.parse_args()
    from make_heldout_prompts import LIBRARIES, VALIDATION_LIBRARIES

    packages = [p.strip() for p in args.packages.split(",") if p.strip()]
    held_out = sorted(set(packages) & set(LIBRARIES + VALIDATION_LIBRARIES))
    if held_out:
        parser.error(f"--packages {held_out} are held-out or validation libraries of make_heldout_prompts.py: "
                     "never train on them")

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts
                   and "tests" not in p.parts and "idlelib" not in p.parts)
    seen, stubs = set(), []
    for path in files:
        for name, stub in function_stubs(path):
            if name in seen or len(stub) > args.max_chars:
                continue
            seen.add(name)
            stubs.append((f"{path.relative_to(stdlib)}:{name}", stub))
    excluded = [p.strip() for p in args.exclude_packages.split(",") if p.strip()]
    package_stubs(excluded, args.max_chars, seen)  # only marks their names as seen
    if args.no_stdlib:
        stubs = []
    n_stdlib = len(stubs)
    stubs += package_stubs(packages, args.max_chars, seen)
    random.Random(0).shuffle(stubs)
    records = write_prompt_file(args.out, stubs[: args.max_prompts])
    print(f"wrote {len(records)} prompts (of {n_stdlib} stdlib functions from {len(files)} files, Python "
          f"{sys.version.split()[0]}, and {len(stubs) - n_stdlib} of the packages {packages}; names of "
          f"{excluded or 'no package'} skipped) to {args.out}")


if __name__ == "__main__":
    main()
