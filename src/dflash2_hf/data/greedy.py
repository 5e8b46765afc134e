"""Batched greedy continuation that drops finished rows (the regeneration engine of ``prepare-data``).

``generate()`` on a batch keeps running every row until the LAST one stops: on ShareGPT prompts with a 256-token
cap most of a batch of 64 stops early, and most of the compute then goes into rows that only emit padding. This
loop runs the same greedy decoding (prefill, then one token per live row per step, on a pre-allocated
``StaticCache``) and, whenever the live rows fall to ``compact_below`` of the rows in the cache, keeps only the live
rows of the cache (``Cache.reorder_cache``, the batch re-indexing beam search uses) and of the masks.

The tokens are the target's own greedy choices, as with ``generate(do_sample=False)`` and no logits processor:
only the batch shape of the matmuls differs, which can flip a rare near-tie (as any change of batch composition).
"""

from __future__ import annotations

import inspect

import torch
from transformers import StaticCache


def _cache_kwarg(model) -> str:
    """The name the model's forward takes its cache under (transformers 5.24: ``cache``; 5.23: ``past_key_values``)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def left_pad(contexts: list[list[int]], pad_id: int) -> tuple[torch.LongTensor, torch.LongTensor]:
    """``(ids, mask)``, both ``(n, longest)`` int64: the contexts right-aligned after ``pad_id`` padding, 1 = token."""
    width = max(len(c) for c in contexts)
    ids = torch.full((len(contexts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(contexts), width), dtype=torch.long)
    for i, c in enumerate(contexts):
        ids[i, width - len(c):] = torch.tensor(c, dtype=torch.long)
        mask[i, width - len(c):] = 1
    return ids, mask


@torch.inference_mode()
def greedy_continue(model, contexts: list[list[int]], max_new_tokens: int, stop_ids: list[int], pad_id: int,
                    compact_below: float = 0.75) -> list[tuple[list[int], bool]]:
    """Greedy-continue every context; returns ``(response ids, stopped)`` per context, in order.

    Args:
        model: a ``transformers`` causal LM (position ids from the left-padded mask, as ``generate`` computes them).
        contexts: token id lists (any lengths; left-padded internally with ``pad_id``).
        max_new_tokens: cap per context; a response that reaches it without a stop id has ``stopped=False``.
        stop_ids: token ids that end a response (included in it).
        pad_id: padding token id of the left padding.
        compact_below: compact the cache when live rows / cached rows drops below this (1.0: after every stop).

    Returns:
        list of ``(ids, stopped)``; ``ids`` ends with the stop id when ``stopped``.
    """
    device = model.device
    ids, mask = left_pad(contexts, pad_id)
    n, width = ids.shape
    ids, mask = ids.to(device), mask.to(device)
    cache = StaticCache(config=model.config, max_cache_len=width + max_new_tokens)
    stops = torch.tensor(sorted(set(stop_ids)), device=device)
    responses: list[list[int]] = [[] for _ in range(n)]
    stopped = [False] * n
    rows = torch.arange(n, device=device)  # cache row -> context index
    alive = torch.ones(n, dtype=torch.bool, device=device)  # per cache row
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    kw = _cache_kwarg(model)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, **{kw: cache},
                cache_position=torch.arange(width, device=device), use_cache=True, logits_to_keep=1)
    next_pos = positions[:, -1] + 1
    for step in range(max_new_tokens):
        tokens = out.logits[:, -1].argmax(-1)
        for ctx, tok in zip(rows[alive].tolist(), tokens[alive].tolist()):
            responses[ctx].append(tok)
        ended = alive & torch.isin(tokens, stops)
        for ctx in rows[ended].tolist():
            stopped[ctx] = True
        alive &= ~ended
        if step + 1 == max_new_tokens or not alive.any():
            break
        mask = torch.cat([mask, alive.long()[:, None]], dim=1)
        if alive.sum() < compact_below * len(alive):
            keep = alive.nonzero().flatten()
            cache.reorder_cache(keep)
            rows, mask, tokens, next_pos = rows[keep], mask[keep], tokens[keep], next_pos[keep]
            alive = torch.ones(len(keep), dtype=torch.bool, device=device)
        out = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                    **{kw: cache}, cache_position=torch.tensor([width + step], device=device), use_cache=True)
        next_pos = next_pos + 1
    return [(responses[i], stopped[i]) for i in range(n)]


__all__ = ["greedy_continue", "left_pad"]
