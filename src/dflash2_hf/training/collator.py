"""Block sampling and batching for drafter training (DESIGN.md section 4, "Blocks").

Per sequence, :class:`BlockCollator` samples ``N`` random anchor positions inside the response tokens, afresh each
time it sees the sequence (so every epoch trains other blocks). A block at anchor ``a`` is
``[x_a, MASK x (B-1)]`` at positions ``a .. a+B-1``; slot ``j`` predicts ``x_{a+j}``. A block attends to the
target context features of positions ``< a`` and bidirectionally to itself, never to other blocks, so ``N``
blocks train in one drafter pass with a block mask and each gets the hidden states a single-block inference call
with context ``[0, a)`` would give.

Anchor rule: ``a`` is a response token whose successor ``a+1`` is also a response token (a block whose first draft
slot has no label teaches nothing). Labels: slot 0 is never a label; slot ``j >= 1`` is labelled ``x_{a+j}`` while
``a+j`` is inside the sequence and every position ``a+1 .. a+j`` is a response token, i.e. the labels stop at the
first non-response position (the end of a turn or of the sequence): serving stops at the end-of-turn token, so
nothing after it is ever accepted.

Target labels (items with ``target_next``, the target's greedy next token at every position, see
:class:`~dflash2_hf.training.features.FeatureCache` ``with_next``): slot ``j`` is labelled ``next[a+j-1]``, the
token the target itself would emit there, and only while the text agrees with the target before it
(``x_{a+i} == next[a+i-1]`` for ``1 <= i < j``). Every label is then exactly what verification accepts after the
anchor's context, whoever wrote the text: on the target's own regenerated text the labels are ``x_{a+j}`` again;
on text written by someone else (original ShareGPT answers) slot 1 always trains and later slots train as far as
the target would have written the same tokens.

Distillation targets (items with ``target_topk_logits`` / ``target_topk_ids``, the target's k largest next-token
logits at every position): slot ``j`` gets those of position ``a+j-1``, the target's distribution over the token
its label is drawn from.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

IGNORE_INDEX = -100


def valid_anchors(response_mask: torch.Tensor) -> torch.Tensor:
    """Positions that may anchor a block.

    Args:
        response_mask: ``(T,)`` bool/0-1, True on response tokens.

    Returns:
        ``(A,)`` int64 positions ``a`` with ``response_mask[a]`` and ``response_mask[a + 1]`` (ascending).
    """
    m = response_mask.bool()
    if m.numel() < 2:
        return torch.zeros(0, dtype=torch.long)
    return torch.nonzero(m[:-1] & m[1:], as_tuple=False).flatten()


def response_offsets(response_mask: torch.Tensor) -> torch.Tensor:
    """``(T,)`` int64: each position's index inside its run of response tokens (0 = a response's first token; -1
    outside responses)."""
    m = response_mask.bool()
    idx = torch.arange(m.numel())
    start = torch.where(m & ~torch.cat([m.new_zeros(1), m[:-1]]), idx, torch.zeros_like(idx))
    start = torch.cummax(start, dim=0).values  # the latest response start at or before each position
    return torch.where(m, idx - start, torch.full_like(idx, -1))


def sample_anchors(response_mask: torch.Tensor, num_blocks: int, rng: random.Random,
                   early_tokens: int = 0, early_weight: float = 1.0) -> torch.Tensor:
    """Up to ``num_blocks`` distinct anchors among :func:`valid_anchors`, sorted ascending.

    Uniform by default. With ``early_weight != 1``, an anchor among the first ``early_tokens`` tokens of its response
    is ``early_weight`` times as likely as a later one (weighted sampling without replacement: the Efraimidis-Spirakis
    keys ``u ** (1 / w)``): serving drafts every response from its first token on, and those first tokens, with the
    least of the response as context, are the hardest to draft. Returns an empty ``(0,)`` tensor when the sequence
    has no valid anchor.
    """
    return _draw(valid_anchors(response_mask), response_mask, num_blocks, rng, early_tokens, early_weight)


def _draw(cand: torch.Tensor, response_mask: torch.Tensor, num_blocks: int, rng: random.Random,
          early_tokens: int, early_weight: float) -> torch.Tensor:
    """Up to ``num_blocks`` of the ascending positions ``cand``, sorted, drawn as :func:`sample_anchors` says."""
    if cand.numel() <= num_blocks:
        return cand
    if early_weight == 1.0 or early_tokens <= 0:  # the uniform draw of earlier releases (same RNG stream)
        return torch.tensor(sorted(rng.sample(cand.tolist(), num_blocks)), dtype=torch.long)
    early = (response_offsets(response_mask)[cand] < early_tokens).tolist()
    keys = [rng.random() ** (1.0 / (early_weight if e else 1.0)) for e in early]
    top = sorted(range(len(keys)), key=keys.__getitem__, reverse=True)[:num_blocks]
    return cand[sorted(top)]


def sample_anchor_pairs(response_mask: torch.Tensor, num_blocks: int, rng: random.Random,
                        early_tokens: int = 0, early_weight: float = 1.0) -> torch.Tensor:
    """Up to ``num_blocks`` anchors drawn as adjacent pairs ``(a - 1, a)``, sorted ascending.

    ``num_blocks // 2`` (at least 1) second anchors ``a`` are drawn as :func:`sample_anchors` draws (``a - 1`` must
    be a valid anchor too), and each brings its predecessor ``a - 1``; pairs may share anchors, so fewer blocks can
    result. Block ``a - 1``'s first draft slot predicts token ``a``, so one training pass tells whether the drafter
    missed the token block ``a`` is anchored on: the anchors the serving loop visits, which mostly follow a
    rejection (:func:`previous_blocks`, ``post_miss_weight`` in :func:`~dflash2_hf.training.losses.drafter_loss`).
    """
    cand = valid_anchors(response_mask)
    seconds = cand[1:][cand[1:] - 1 == cand[:-1]]
    chosen = _draw(seconds, response_mask, max(1, num_blocks // 2), rng, early_tokens, early_weight)
    return torch.unique(torch.cat([chosen - 1, chosen]))  # sorted


def previous_blocks(anchors: torch.Tensor) -> torch.Tensor:
    """``(N,)`` int64: for each of the ascending ``anchors``, the index of the block anchored one position earlier,
    or -1 when there is none."""
    where = {int(a): i for i, a in enumerate(anchors.tolist())}
    return torch.tensor([where.get(int(a) - 1, -1) for a in anchors.tolist()], dtype=torch.long)


def block_labels(input_ids: torch.Tensor, response_mask: torch.Tensor, anchors: torch.Tensor, block_size: int,
                 target_next: torch.Tensor | None = None):
    """Labels and true predecessors of the blocks of one sequence.

    Args:
        input_ids: ``(T,)`` int64.
        response_mask: ``(T,)`` bool.
        anchors: ``(N,)`` int64 anchor positions.
        block_size: ``B``.
        target_next: optional ``(T,)`` int64 greedy next tokens of the target: target labels (module docstring).

    Returns:
        ``(labels, predecessors)``, each ``(N, B)`` int64: ``labels[n, j] = x_{a_n + j}`` for valid slots ``j >= 1``
        (see the module docstring), else ``-100``; ``predecessors[n, j] = x_{a_n + j - 1}`` (the anchor for
        ``j = 1``) where the label is valid, else 0.
    """
    T = input_ids.shape[0]
    n = anchors.shape[0]
    offs = torch.arange(block_size)
    pos = anchors[:, None] + offs[None, :]  # (N, B)
    inside = pos < T
    pos_c = pos.clamp(max=T - 1)
    resp = response_mask.bool()[pos_c] & inside
    resp[:, 0] = True  # slot 0 (the anchor) does not break the chain; it is never a label itself
    if target_next is None:
        truth = input_ids[pos_c]
    else:
        truth = target_next[(pos_c - 1).clamp(min=0)]  # what the target emits at a+j given the text before it
        agree = torch.ones_like(resp)
        agree[:, 2:] = (input_ids[pos_c] == truth)[:, 1:-1]  # slot j needs x_{a+i} == next[a+i-1], 1 <= i < j
        resp &= torch.cumprod(agree.long(), dim=1).bool()
    ok = torch.cumprod(resp.long(), dim=1).bool()
    ok[:, 0] = False
    labels = torch.where(ok, truth, torch.full((n, block_size), IGNORE_INDEX, dtype=torch.long))
    prev = input_ids[(pos_c - 1).clamp(min=0)]
    predecessors = torch.where(ok, prev, torch.zeros_like(prev))
    return labels, predecessors


@dataclass
class BlockCollator:
    """Turns dataset items into one multi-block drafter training batch.

    Each item is a dict with ``input_ids`` ``(T,)`` int64, ``response_mask`` ``(T,)`` bool and
    ``context_hidden_states`` ``(T, n*H_t)`` (the cached target features, any float dtype; at least ``T`` rows).
    Items longer than ``max_length`` are cut to it.

    Output batch (``b`` items, ``T`` = longest item, ``N`` = most blocks of an item, ``Q = N * B``):

    * ``block_input_ids`` ``(b, Q)`` int64: per block ``[x_a, MASK, ..., MASK]`` (padding blocks: all MASK);
    * ``context_hidden_states`` ``(b, T, n*H_t)``, zero-padded, in the features' dtype;
    * ``position_ids`` ``(b, T + Q)`` int64: context ``0 .. T-1``, block ``n`` at ``a_n .. a_n + B - 1``
      (padding blocks at ``0 .. B-1``);
    * ``attention_mask`` ``(b, 1, Q, T + Q)`` bool, True = attend: block ``n`` sees context ``< a_n`` and its own
      ``B`` slots; a padding block sees only itself (no fully masked row, so no NaN);
    * ``labels`` ``(b, Q)`` int64, ``-100`` where not trained (slot 0, padding, past the response);
    * ``predecessor_ids`` ``(b, Q)`` int64: the true previous token of each labelled slot (for the selector);
    * ``anchors`` ``(b, N)`` int64, ``-1`` for padding blocks;
    * with ``post_miss_weight != 1``: ``previous_block`` ``(b, N)`` int64, the index of the block anchored one
      position earlier in the same sequence, -1 where none (anchors are then drawn in pairs,
      :func:`sample_anchor_pairs`);
    * with distillation targets in the items: ``soft_logits`` ``(b, Q, k)`` float32 and ``soft_ids`` ``(b, Q, k)``
      int64, the target's top-k next-token logits for each slot (meaningful where ``labels`` is set, 0 elsewhere).

    Anchors are re-drawn on every call (``rng`` seeded by ``seed``); ``early_anchor_tokens`` /
    ``early_anchor_weight`` favour anchors near the start of each response (:func:`sample_anchors`). With ``epoch``
    set (the Trainer sets it at every epoch start), an item with a ``record_id`` draws from its own RNG seeded by
    ``(seed, epoch, record_id)`` instead: the same anchors whichever process, batch or resumed run collates it
    (data-parallel ranks then train exactly the blocks one process would).

    Raises:
        ValueError: an item is malformed (length mismatch, too few feature rows), or only some items of a batch
            carry distillation targets.
    """

    block_size: int
    mask_token_id: int
    num_blocks: int = 32
    max_length: int | None = None
    seed: int = 0
    drop_empty: bool = True
    early_anchor_tokens: int = 0
    early_anchor_weight: float = 1.0
    post_miss_weight: float = 1.0
    epoch: int | None = None
    rng: random.Random = field(init=False, repr=False)

    def __post_init__(self):
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.early_anchor_weight <= 0 or self.early_anchor_tokens < 0:
            raise ValueError(f"early_anchor_weight must be > 0 and early_anchor_tokens >= 0, got "
                             f"{self.early_anchor_weight} and {self.early_anchor_tokens}")
        if self.post_miss_weight <= 0:
            raise ValueError(f"post_miss_weight must be > 0, got {self.post_miss_weight}")
        self.rng = random.Random(self.seed)

    def _rng_for(self, item: dict) -> random.Random:
        rid = item.get("record_id")
        if self.epoch is None or rid is None:
            return self.rng
        return random.Random(f"{self.seed}:{self.epoch}:{int(rid)}")  # str seeds hash with sha512: same everywhere

    def _prepare(self, item: dict):
        ids = torch.as_tensor(item["input_ids"], dtype=torch.long).flatten()
        mask = torch.as_tensor(item["response_mask"]).flatten().bool()
        feats = item["context_hidden_states"]
        nxt = item.get("target_next")
        if mask.shape != ids.shape:
            raise ValueError(f"response_mask has {mask.numel()} entries for {ids.numel()} input_ids")
        if feats.shape[0] < ids.shape[0]:
            # features may be stored for a prefix only (the cache truncates at its max_length)
            ids, mask = ids[: feats.shape[0]], mask[: feats.shape[0]]
        if self.max_length is not None and ids.shape[0] > self.max_length:
            ids, mask = ids[: self.max_length], mask[: self.max_length]
        if nxt is not None:
            nxt = torch.as_tensor(nxt, dtype=torch.long).flatten()[: ids.shape[0]]
            if nxt.shape != ids.shape:
                raise ValueError(f"target_next has {nxt.numel()} entries for {ids.numel()} input_ids")
        soft = None
        if "target_topk_logits" in item:
            soft = (item["target_topk_logits"][: ids.shape[0]].float(), item["target_topk_ids"][: ids.shape[0]].long())
            if soft[0].shape[0] != ids.shape[0] or soft[0].shape != soft[1].shape:
                raise ValueError(f"target_topk_logits {tuple(soft[0].shape)} / target_topk_ids "
                                 f"{tuple(soft[1].shape)} do not cover the {ids.numel()} input_ids")
        return ids, mask, feats[: ids.shape[0]], nxt, soft

    def __call__(self, items: list[dict]) -> dict[str, torch.Tensor]:
        B = self.block_size
        prepared = []
        if len({"target_topk_logits" in item for item in items}) > 1:
            raise ValueError("only some items of the batch carry distillation targets (target_topk_logits): "
                             "build every feature cache of the run with the same --distill-topk")
        for item in items:
            ids, mask, feats, nxt, soft = self._prepare(item)
            draw = sample_anchor_pairs if self.post_miss_weight != 1.0 else sample_anchors
            anchors = draw(mask, self.num_blocks, self._rng_for(item), self.early_anchor_tokens,
                           self.early_anchor_weight)
            if anchors.numel() == 0 and self.drop_empty and len(items) > 1:
                continue
            prepared.append((ids, mask, feats, anchors, nxt, soft))
        if not prepared:  # every item lacked anchors: keep the first with one padding block (no labels)
            ids, mask, feats, nxt, soft = self._prepare(items[0])
            prepared.append((ids, mask, feats, torch.zeros(0, dtype=torch.long), nxt, soft))
        b = len(prepared)
        T = max(p[0].shape[0] for p in prepared)
        N = max(1, max(p[3].shape[0] for p in prepared))
        Q = N * B
        width = prepared[0][2].shape[-1]
        dtype = prepared[0][2].dtype

        block_ids = torch.full((b, Q), self.mask_token_id, dtype=torch.long)
        ctx = torch.zeros(b, T, width, dtype=dtype)
        pos = torch.empty(b, T + Q, dtype=torch.long)
        attn = torch.zeros(b, 1, Q, T + Q, dtype=torch.bool)
        labels = torch.full((b, Q), IGNORE_INDEX, dtype=torch.long)
        preds = torch.zeros(b, Q, dtype=torch.long)
        anchors_out = torch.full((b, N), -1, dtype=torch.long)
        prev_out = torch.full((b, N), -1, dtype=torch.long)
        k = prepared[0][5][0].shape[-1] if prepared[0][5] is not None else 0
        soft_logits = torch.zeros(b, Q, k) if k else None
        soft_ids = torch.zeros(b, Q, k, dtype=torch.long) if k else None

        slot_block = torch.arange(Q) // B  # block index of each query slot
        same_block = slot_block[:, None] == slot_block[None, :]  # (Q, Q)
        offs = torch.arange(B)
        ctx_cols = torch.arange(T)
        for r, (ids, mask, feats, anchors, nxt, soft) in enumerate(prepared):
            L, n = ids.shape[0], anchors.shape[0]
            ctx[r, :L] = feats
            pos[r, :T] = torch.arange(T)
            blk_anchor = torch.zeros(N, dtype=torch.long)  # padding blocks: positions 0..B-1, no context
            blk_anchor[:n] = anchors
            pos[r, T:] = (blk_anchor[:, None] + offs[None, :]).flatten()
            attn[r, 0, :, :T] = ctx_cols[None, :] < blk_anchor[slot_block][:, None]
            attn[r, 0, :, T:] = same_block
            if n:
                anchors_out[r, :n] = anchors
                prev_out[r, :n] = previous_blocks(anchors)
                block_ids[r, : n * B : B] = ids[anchors]
                lab, prv = block_labels(ids, mask, anchors, B, target_next=nxt)
                labels[r, : n * B] = lab.flatten()
                preds[r, : n * B] = prv.flatten()
                if k:  # slot j's distribution is the target's at position a+j-1
                    src = (anchors[:, None] + offs[None, :] - 1).clamp(0, L - 1).flatten()
                    soft_logits[r, : n * B], soft_ids[r, : n * B] = soft[0][src], soft[1][src]
        out = {
            "block_input_ids": block_ids,
            "context_hidden_states": ctx,
            "position_ids": pos,
            "attention_mask": attn,
            "labels": labels,
            "predecessor_ids": preds,
            "anchors": anchors_out,
        }
        if self.post_miss_weight != 1.0:
            out["previous_block"] = prev_out
        if k:
            out["soft_logits"], out["soft_ids"] = soft_logits, soft_ids
        return out


__all__ = ["BlockCollator", "IGNORE_INDEX", "block_labels", "previous_blocks", "response_offsets", "sample_anchor_pairs",
           "sample_anchors", "valid_anchors"]
