"""Choosing a drafter's draft vocabulary from training data (see ``DFlash2DraftModel.set_draft_vocab``)."""

from __future__ import annotations

from collections import Counter

import torch


def response_token_counts(records) -> Counter:
    """How often each token id occurs in the RESPONSES of ``records`` (prepared records with ``response_spans`` or
    training records with ``response_mask``)."""
    counts: Counter = Counter()
    for rec in records:
        ids = rec["input_ids"]
        if "response_spans" in rec:
            for start, end in rec["response_spans"]:
                counts.update(ids[start:end])
        else:
            counts.update(t for t, m in zip(ids, rec["response_mask"]) if m)
    return counts


def eos_ids(config) -> list[int]:
    """The end-of-sequence ids of a drafter or target config, as a list (kept in every draft vocabulary)."""
    eos = getattr(config, "eos_token_id", None)
    return eos if isinstance(eos, list) else [eos] if eos is not None else []


def draft_vocab_coverage(token_ids, records) -> float:
    """Share of the response tokens of ``records`` inside the draft vocabulary ``token_ids`` (the ceiling on
    per-position acceptance the restriction imposes on that data).

    Raises:
        ValueError: no response tokens in ``records``.
    """
    counts = response_token_counts(records)
    total = sum(counts.values())
    if total == 0:
        raise ValueError("The records hold no response tokens to measure a draft vocabulary's coverage on.")
    inside = {int(t) for t in token_ids}
    return sum(n for t, n in counts.items() if t in inside) / total


def draft_vocab_from_records(records, size: int, always: list[int] | None = None) -> tuple[torch.LongTensor, float]:
    """The ``size`` most frequent RESPONSE tokens of target-regenerated records (``input_ids`` + ``response_spans``,
    or the ``response_mask`` of training records).

    Args:
        records: prepared records (:func:`dflash2_hf.data.load_prepared`) or training records
            (:func:`dflash2_hf.training.load_training_records`).
        size: draft vocabulary size.
        always: ids to include whatever their count (e.g. EOS / end-of-turn tokens).

    Returns:
        ``(ids (size,) long, coverage)``: coverage = share of response tokens of ``records`` inside the list (the
        ceiling on per-position acceptance the restriction imposes on this data).

    Raises:
        ValueError: no response tokens in ``records``, or ``size`` < len(always).
    """
    counts = response_token_counts(records)
    total = sum(counts.values())
    if total == 0:
        raise ValueError("The records hold no response tokens to choose a draft vocabulary from.")
    chosen = list(dict.fromkeys(always or []))
    if size < len(chosen):
        raise ValueError(f"size={size} is smaller than the {len(chosen)} ids that must always be included.")
    for token, _ in counts.most_common():
        if len(chosen) >= size:
            break
        if token not in chosen:
            chosen.append(token)
    return torch.tensor(sorted(chosen), dtype=torch.long), draft_vocab_coverage(chosen, records)
