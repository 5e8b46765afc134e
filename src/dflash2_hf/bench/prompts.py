"""Benchmark prompts: ShareGPT dev records, HumanEval, or a user JSONL file, tokenised for one target.

Chat prompts are rendered with the tokenizer's chat template (``add_generation_prompt=True``) and tokenised with
``add_special_tokens=False`` (the template already holds BOS etc.). A tokenizer without a chat template (a base model)
gets the raw text, tokenised with its special tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..data.json_lines import iter_json_lines

SHAREGPT_DEV = (16000, 17000)


@dataclass
class Prompt:
    """One benchmark prompt.

    Attributes:
        dataset: data set name (``"sharegpt"``, ``"humaneval"`` or the JSONL file's stem).
        prompt_id: record id inside the data set (ShareGPT record index, HumanEval task id, JSONL ``id`` or line).
        input_ids: the tokenised prompt (chat template applied where there is one).
        chat: whether the chat template was applied.
    """

    dataset: str
    prompt_id: str
    input_ids: list[int] = field(repr=False)
    chat: bool = True

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode_messages(tokenizer, messages: list[dict]) -> list[int]:
    """Chat messages -> token ids through the chat template, generation prompt included."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_text(tokenizer, text: str, chat: bool) -> tuple[list[int], bool]:
    """A user message (chat template when ``chat`` and the tokenizer has one) or raw text -> ``(ids, chat_used)``."""
    if chat and has_chat_template(tokenizer):
        return encode_messages(tokenizer, [{"role": "user", "content": text}]), True
    return list(tokenizer(text, add_special_tokens=True)["input_ids"]), False


def sharegpt_bench_prompts(tokenizer, num_prompts: int, max_prompt_tokens: int | None = None,
                           skipped: list | None = None) -> list[Prompt]:
    """The first ``num_prompts`` usable ShareGPT development records ([16000, 17000)): their first human turn.

    Records whose rendered prompt is longer than ``max_prompt_tokens`` are skipped (their ids are appended to
    ``skipped``). Raises ValueError if the development range holds fewer usable prompts.
    """
    from ..data import sharegpt_prompts

    out = []
    for record_id, text in sharegpt_prompts(*SHAREGPT_DEV):
        ids, chat = encode_text(tokenizer, text, chat=True)
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            if skipped is not None:
                skipped.append(str(record_id))
            continue
        out.append(Prompt("sharegpt", str(record_id), ids, chat))
        if len(out) >= num_prompts:
            return out
    raise ValueError(f"only {len(out)} ShareGPT development prompts of at most {max_prompt_tokens} tokens; "
                     f"asked for {num_prompts}")


def humaneval_bench_prompts(tokenizer, num_prompts: int, max_prompt_tokens: int | None = None,
                            skipped: list | None = None) -> list[Prompt]:
    """The first ``num_prompts`` HumanEval problems, as a chat request to complete the function (raw code prompt
    for a tokenizer without a chat template)."""
    from ..data import humaneval_messages, load_humaneval

    out = []
    for problem in load_humaneval():
        if has_chat_template(tokenizer):
            ids, chat = encode_messages(tokenizer, humaneval_messages(problem)), True
        else:
            ids, chat = list(tokenizer(problem["prompt"], add_special_tokens=True)["input_ids"]), False
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            if skipped is not None:
                skipped.append(problem["task_id"])
            continue
        out.append(Prompt("humaneval", problem["task_id"], ids, chat))
        if len(out) >= num_prompts:
            break
    return out


def jsonl_bench_prompts(path: str | Path, tokenizer, num_prompts: int, max_prompt_tokens: int | None = None,
                        skipped: list | None = None, chat: bool = True) -> list[Prompt]:
    """Prompts from a JSONL file: one object per line with ``"prompt"`` (a string: sent as one user message through
    the chat template, or raw with ``chat=False``) or ``"messages"`` (a chat list of ``{"role", "content"}``), and
    optionally ``"id"``. Blank lines are ignored.

    Raises:
        ValueError: a line is not JSON or has neither field.
    """
    path = Path(path)
    name = path.name[: -len(".jsonl")] if path.name.endswith(".jsonl") else path.stem
    out = []
    for line_no, obj in iter_json_lines(path):
        pid = str(obj.get("id", line_no)) if isinstance(obj, dict) else str(line_no)
        if isinstance(obj, dict) and isinstance(obj.get("messages"), list):
            if not has_chat_template(tokenizer):
                raise ValueError(f"{path}:{line_no}: 'messages' needs a tokenizer with a chat template")
            ids, used = encode_messages(tokenizer, obj["messages"]), True
        elif isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
            ids, used = encode_text(tokenizer, obj["prompt"], chat)
        else:
            raise ValueError(f"{path}:{line_no}: expected an object with a 'prompt' string or a 'messages' list")
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            if skipped is not None:
                skipped.append(pid)
            continue
        out.append(Prompt(name, pid, ids, used))
        if len(out) >= num_prompts:
            break
    if not out:
        raise ValueError(f"{path}: no usable prompts")
    return out


def load_bench_prompts(datasets: list[str], tokenizer, num_prompts: int, max_prompt_tokens: int | None = None,
                       chat: bool = True) -> tuple[dict[str, list[Prompt]], dict[str, list[str]]]:
    """``datasets``: ``"sharegpt"``, ``"humaneval"`` or paths of JSONL files.

    Returns:
        ``({dataset name: prompts}, {dataset name: skipped prompt ids (too long)})``.
    """
    prompts, skipped = {}, {}
    for spec in datasets:
        skip: list[str] = []
        if spec == "sharegpt":
            got = sharegpt_bench_prompts(tokenizer, num_prompts, max_prompt_tokens, skip)
        elif spec == "humaneval":
            got = humaneval_bench_prompts(tokenizer, num_prompts, max_prompt_tokens, skip)
        elif Path(spec).is_file():
            got = jsonl_bench_prompts(spec, tokenizer, num_prompts, max_prompt_tokens, skip, chat=chat)
        else:
            raise ValueError(f"unknown data set {spec!r}: use 'sharegpt', 'humaneval' or the path of a JSONL file")
        name = got[0].dataset if got else spec
        if name in prompts:
            raise ValueError(f"data set name {name!r} given twice")
        prompts[name], skipped[name] = got, skip
    return prompts, skipped


__all__ = ["Prompt", "load_bench_prompts", "sharegpt_bench_prompts", "humaneval_bench_prompts",
           "jsonl_bench_prompts", "encode_messages", "encode_text", "SHAREGPT_DEV"]
