"""Drafter training losses and metrics (DESIGN.md section 4, "Loss").

* Block loss: cross entropy at slots ``j = 1 .. B-1`` predicting ``x_{a+j}``, weighted ``w_j = exp(-(j-1)/gamma)``
  and normalised by the sum of the weights over the labelled slots of the batch. ``gamma`` is 7 for ``B = 16``,
  5 for ``B = 10``, 4 for ``B = 8`` (:func:`default_gamma` interpolates linearly between those points and
  extrapolates with the end slopes, never below 1).
* Selector loss: at labelled slots whose true token is among the drafter's top-k, cross entropy of
  ``S_t(true predecessor, .)`` over the k candidates (target = the true token's index); same slot weights,
  normalised by their sum over those slots; added with ``selector_weight``. By default the selector trains on
  detached drafter hidden states and logits, so it re-ranks what the drafter proposes without pulling on it.
* Post-miss weighting (optional, ``post_miss_weight`` != 1, with the collator's ``previous_block``): a block
  whose anchor token the drafter missed at slot 1 of the block anchored one position earlier weighs
  ``post_miss_weight`` times as much in both losses. The serving loop anchors mostly right after a rejection, where
  the next token is harder to draft than at an average position (docs/claims.md).
* Distillation (optional, ``distill_weight`` ``w`` > 0, batches with ``soft_logits`` / ``soft_ids``): the block
  loss becomes ``(1 - w) * CE(true token) + w * CE(q, p)``, where ``q`` is the target's next-token distribution
  at the slot's predecessor position restricted to its stored top-k (softmax of those logits, the tokens outside
  the draft vocabulary dropped and ``q`` renormalised) and ``p`` the drafter's; same slot weights. The soft
  targets carry the target's ranking of the alternatives, which hard labels throw away (EAGLE trains on the
  target's probabilities the same way: Li et al. 2024, arXiv:2401.15077; DistillSpec, arXiv:2310.08461).

Logits are only computed for labelled slots (the LM head is the most expensive part of a step), and only over the
drafter's draft vocabulary when it has one (``draft_vocab_ids``: the tokens it can propose when drafting); a label
outside it cannot be drafted, so it has no cross entropy and counts as a miss in the metrics.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..generation.candidate_generator import draft_lm_head
from .collator import IGNORE_INDEX

_GAMMA_POINTS = ((8, 4.0), (10, 5.0), (16, 7.0))


def lm_head_on(lm_head: nn.Module, device: torch.device) -> nn.Module:
    """The frozen target LM head on ``device``: itself if it is there, else a frozen copy moved there.

    A copy, not ``lm_head.to(device)``: the head stays where the target needs it for its own forwards (feature
    building), and the ``(M, V)`` training logits never cross devices. Calling again with the copy is free.
    """
    if lm_head.weight.device == torch.device(device):
        return lm_head
    return copy.deepcopy(lm_head).requires_grad_(False).to(device)


def default_gamma(block_size: int) -> float:
    """Decay ``gamma`` of the slot weights for a block size (7 @ 16, 5 @ 10, 4 @ 8, piecewise linear, >= 1)."""
    pts = _GAMMA_POINTS
    if block_size <= pts[0][0]:
        (x0, y0), (x1, y1) = pts[0], pts[1]
    elif block_size >= pts[-1][0]:
        (x0, y0), (x1, y1) = pts[-2], pts[-1]
    else:
        i = next(i for i in range(1, len(pts)) if block_size <= pts[i][0])
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
    return max(1.0, y0 + (block_size - x0) * (y1 - y0) / (x1 - x0))


def slot_weights(block_size: int, gamma: float | None = None) -> torch.Tensor:
    """``(B,)`` float32 weights: ``w_0 = 0`` (the anchor slot), ``w_j = exp(-(j-1)/gamma)`` for ``j >= 1``."""
    gamma = default_gamma(block_size) if gamma is None else float(gamma)
    if gamma <= 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    w = torch.tensor([0.0] + [math.exp(-(j - 1) / gamma) for j in range(1, block_size)])
    return w


@dataclass
class DrafterLossOutput:
    """Result of :func:`drafter_loss`.

    Attributes:
        loss: scalar, ``ce_loss + selector_weight * selector_loss`` (differentiable); with ``distill_weight``
            ``w`` the block term is ``(1 - w) * ce_loss + w * distillation loss``.
        ce_loss: scalar weighted block cross entropy (differentiable).
        selector_loss: scalar weighted selector cross entropy (0 without selector / eligible slots).
        stats: detached float64 counters to accumulate over steps (see :func:`summarize_stats`):
            ``slot_correct`` / ``slot_count`` ``(B,)`` top-1 hits and labels per slot; ``top1_correct``,
            ``selector_correct`` (selector pick == true token, over all labelled slots), ``topk_hit`` (true token
            in the top-k), ``labels``, the loss sums ``ce_sum``, ``ce_weight``, ``sel_sum``, ``sel_weight``, and
            ``accept_top1`` / ``accept_selector`` / ``blocks`` (teacher-forced accepted runs, see
            :func:`summarize_stats`).
    """

    loss: torch.Tensor
    ce_loss: torch.Tensor
    selector_loss: torch.Tensor
    stats: dict[str, torch.Tensor] = field(default_factory=dict)


def drafter_loss(
    drafter: nn.Module,
    hidden: torch.Tensor,
    labels: torch.LongTensor,
    predecessor_ids: torch.LongTensor,
    lm_head: nn.Module,
    block_size: int,
    gamma: float | None = None,
    selector_weight: float = 1.0,
    selector_detach: bool = True,
    soft_logits: torch.Tensor | None = None,
    soft_ids: torch.LongTensor | None = None,
    distill_weight: float = 0.0,
    previous_block: torch.LongTensor | None = None,
    post_miss_weight: float = 1.0,
) -> DrafterLossOutput:
    """Block cross entropy + selector loss + metrics for one batch.

    Args:
        drafter: the :class:`~dflash2_hf.DFlash2DraftModel` (its ``compute_logits`` and ``candidate_selector``).
        hidden: ``(b, Q)`` query slots' drafter hidden states ``(b, Q, H)``, ``Q`` a multiple of ``block_size``.
        labels: ``(b, Q)`` int64 true tokens, ``-100`` where not trained.
        predecessor_ids: ``(b, Q)`` int64 true previous token of each labelled slot (the anchor for slot 1).
        lm_head: the target's frozen LM head.
        block_size: ``B``.
        gamma: slot-weight decay (default :func:`default_gamma`).
        selector_weight: weight of the selector loss (0 disables it; metrics are still reported).
        selector_detach: train the selector on detached hidden states / logits.
        soft_logits: optional ``(b, Q, k)`` float target top-k next-token logits per slot (the collator's).
        soft_ids: ``(b, Q, k)`` int64 their token ids.
        distill_weight: share ``w`` of the distillation term in the block loss (module docstring); 0 = hard
            labels only.
        previous_block: optional ``(b, N)`` int64, ``N = Q / block_size``: the index of the block anchored one
            position earlier in the same sequence, -1 where none (the collator's, with ``post_miss_weight``).
        post_miss_weight: weight of a block whose previous block's slot 1 (which predicts this block's anchor token)
            has a label and a wrong top-1 draft: the anchors the serving loop lands on after a rejection (module
            docstring). 1 = every block alike.

    Returns:
        :class:`DrafterLossOutput`.

    Raises:
        ValueError: shapes do not match, ``Q`` is not a multiple of ``block_size``, ``distill_weight`` outside
            [0, 1], or ``distill_weight`` > 0 without ``soft_logits`` / ``soft_ids``.
    """
    b, Q = labels.shape
    if hidden.shape[:2] != (b, Q) or Q % block_size:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} / labels {tuple(labels.shape)} do not match, or Q={Q} is not a multiple "
            f"of block_size={block_size}"
        )
    if not 0.0 <= distill_weight <= 1.0:
        raise ValueError(f"distill_weight must be in [0, 1], got {distill_weight}")
    if distill_weight and (soft_logits is None or soft_ids is None):
        raise ValueError("distill_weight > 0 needs soft_logits and soft_ids: build the features with --distill-topk")
    device = hidden.device
    weights = slot_weights(block_size, gamma).to(device)
    slots = (torch.arange(Q, device=device) % block_size).expand(b, Q)
    valid = labels != IGNORE_INDEX
    y = labels[valid]
    s = slots[valid]
    h = hidden[valid]
    stats = {
        "slot_correct": torch.zeros(block_size, dtype=torch.float64),
        "slot_count": torch.zeros(block_size, dtype=torch.float64),
    }
    zero = hidden.sum() * 0.0  # keeps the graph connected when nothing is labelled
    if y.numel() == 0:
        if not zero.requires_grad and torch.is_grad_enabled():  # a frozen drafter body (--train-only selector)
            zero = zero + sum(0.0 * p.sum() for p in drafter.parameters() if p.requires_grad)
        for k in ("top1_correct", "selector_correct", "topk_hit", "labels", "ce_sum", "ce_weight", "sel_sum",
                  "sel_weight", "accept_top1", "accept_selector", "blocks", "selector_on", "distill_sum",
                  "distill_weight"):
            stats[k] = torch.zeros((), dtype=torch.float64)
        return DrafterLossOutput(zero, zero, zero, stats)

    head = draft_lm_head(lm_head, drafter)  # the rows drafting uses (6x fewer for 8192 of 49152)
    logits = drafter.compute_logits(h, head).float()  # (M, V) or (M, V_draft)
    vocab = getattr(drafter, "draft_vocab_ids", None)
    soft_i = soft_ids[valid] if distill_weight else None
    if vocab is None or logits.shape[-1] != vocab.numel():  # logits over the whole vocabulary
        to_idx, to_ids = (lambda ids: ids), (lambda idx: idx)
    else:  # over the draft vocabulary: map token ids to its indices
        vocab = vocab.to(device)
        top = max(int(vocab.max()), int(y.max()), int(soft_i.max()) if soft_i is not None else 0)
        index = torch.full((top + 1,), -1, dtype=torch.long, device=device)
        index[vocab] = torch.arange(vocab.numel(), device=device)
        to_idx, to_ids = (lambda ids: index[ids]), (lambda idx: vocab[idx])  # outside it (-1): cannot be drafted
    y_idx = to_idx(y)
    w = weights[s]
    with torch.no_grad():  # top-1 hits per query slot: the metrics below and the post-miss weights
        top1 = to_ids(logits.argmax(-1)) == y
        full_top1 = torch.zeros(b, Q, dtype=torch.bool, device=device)
        full_top1[valid] = top1
    if previous_block is not None and post_miss_weight != 1.0:
        w = w * _post_miss_factor(full_top1, valid, previous_block, block_size, post_miss_weight)[valid]
    ce = F.cross_entropy(logits, y_idx, reduction="none", ignore_index=-1)
    w_ce = w * (y_idx >= 0)
    ce_loss = (w_ce * ce).sum() / w_ce.sum().clamp(min=1e-12)
    block_loss, distill_stats = ce_loss, {}
    if distill_weight:
        block_loss, distill_stats = _distill(logits, soft_logits[valid].to(device), to_idx(soft_i), w, ce_loss,
                                             distill_weight)
    with torch.no_grad():
        _accept_stats(stats, full_top1, valid, block_size, "top1")
        stats["slot_correct"].index_add_(0, s.cpu(), top1.double().cpu())
        stats["slot_count"].index_add_(0, s.cpu(), torch.ones_like(s, dtype=torch.float64).cpu())
        stats["top1_correct"] = top1.double().sum().cpu()
        stats["labels"] = torch.tensor(float(y.numel()), dtype=torch.float64)
        stats["ce_sum"] = (w_ce * ce).double().sum().cpu()
        stats["ce_weight"] = w_ce.double().sum().cpu()

    selector = getattr(drafter, "candidate_selector", None)
    sel_loss = zero
    if selector is not None:
        k = min(selector.top_k, logits.shape[-1])
        top_vals, top_idx = logits.topk(k, dim=-1)  # (M, k)
        top_ids = to_ids(top_idx)
        is_true = top_ids == y[:, None]
        hit = is_true.any(-1)
        target_idx = is_true.float().argmax(-1)
        h_sel = h.detach() if selector_detach else h
        u_sel = top_vals.detach() if selector_detach else top_vals
        pred = predecessor_ids[valid][:, None]  # (M, 1)
        scores = selector.pair_scores(h_sel, pred, top_ids, u_sel).squeeze(-2).float()  # (M, k)
        if hit.any():
            w_hit = w[hit]
            sel_ce = F.cross_entropy(scores[hit], target_idx[hit], reduction="none")
            sel_loss = (w_hit * sel_ce).sum() / w_hit.sum()
            sel_sum, sel_w = (w_hit * sel_ce).double().sum().detach().cpu(), w_hit.double().sum().cpu()
        else:  # 0, still through the selector: every parameter gets a gradient (DDP without unused-parameter search)
            sel_loss = 0.0 * scores.sum()
            sel_sum = sel_w = torch.zeros((), dtype=torch.float64)
        with torch.no_grad():
            pick = top_ids.gather(-1, scores.argmax(-1, keepdim=True)).squeeze(-1)
            stats["selector_correct"] = (pick == y).double().sum().cpu()
            full_sel = torch.zeros(b, Q, dtype=torch.bool, device=device)
            full_sel[valid] = pick == y
            _accept_stats(stats, full_sel, valid, block_size, "selector")
            stats["topk_hit"] = hit.double().sum().cpu()
            stats["sel_sum"], stats["sel_weight"] = sel_sum, sel_w
            stats["selector_on"] = torch.ones((), dtype=torch.float64)
    else:
        for key in ("selector_correct", "topk_hit", "sel_sum", "sel_weight", "accept_selector", "selector_on"):
            stats[key] = torch.zeros((), dtype=torch.float64)
    stats["distill_sum"] = distill_stats.get("sum", torch.zeros((), dtype=torch.float64))
    stats["distill_weight"] = distill_stats.get("weight", torch.zeros((), dtype=torch.float64))
    loss = block_loss + selector_weight * sel_loss if selector_weight else block_loss + 0.0 * sel_loss
    return DrafterLossOutput(loss, ce_loss, sel_loss, stats)


def _post_miss_factor(hit: torch.Tensor, valid: torch.Tensor, previous_block: torch.LongTensor, block_size: int,
                      post_miss_weight: float) -> torch.Tensor:
    """``(b, Q)`` float weight factor per query slot: ``post_miss_weight`` in the blocks whose previous block
    (``previous_block``) has a labelled slot 1 with a wrong top-1 draft (``hit`` ``(b, Q)`` bool is False there), 1
    elsewhere."""
    b, Q = valid.shape
    n = Q // block_size
    miss = valid.reshape(b, n, block_size)[:, :, 1] & ~hit.reshape(b, n, block_size)[:, :, 1]  # (b, N)
    prev = previous_block.to(hit.device)
    after_miss = (prev >= 0) & miss.gather(1, prev.clamp(min=0))
    factor = torch.where(after_miss, float(post_miss_weight), 1.0)  # (b, N)
    return factor.repeat_interleave(block_size, dim=1)


def _distill(logits: torch.Tensor, soft_logits: torch.Tensor, soft_idx: torch.LongTensor, w: torch.Tensor,
             ce_loss: torch.Tensor, distill_weight: float):
    """``(1 - w) * ce_loss + w * CE(q, p)`` over the labelled slots (module docstring) and its detached counters.

    ``logits`` ``(M, V')`` drafter logits; ``soft_logits`` ``(M, k)`` target logits; ``soft_idx`` ``(M, k)`` their
    indices into ``logits``' columns (-1: outside the draft vocabulary, dropped); ``w`` ``(M,)`` slot weights.
    """
    inside = soft_idx >= 0
    q = torch.softmax(soft_logits.float().masked_fill(~inside, float("-inf")), dim=-1)
    has = inside.any(-1)
    q = torch.where(has[:, None], q, torch.zeros_like(q))  # no stored token can be drafted: no target (NaN-free)
    logp = torch.log_softmax(logits, dim=-1).gather(-1, soft_idx.clamp(min=0))
    soft_ce = -(q * logp).sum(-1)
    w_soft = w * has
    distill = (w_soft * soft_ce).sum() / w_soft.sum().clamp(min=1e-12)
    counters = {"sum": (w_soft * soft_ce).detach().double().sum().cpu(), "weight": w_soft.detach().double().sum().cpu()}
    return (1.0 - distill_weight) * ce_loss + distill_weight * distill, counters


def _accept_stats(stats: dict, correct: torch.Tensor, valid: torch.Tensor, block_size: int, name: str) -> None:
    """Teacher-forced greedy acceptance: per block, the run of correct slots from slot 1 on.

    With exact target features and the true predecessor, that run is what greedy verification would accept for
    this block, so ``1 + mean(run)`` estimates ``tau`` on the training distribution.
    """
    c = correct.reshape(-1, block_size)[:, 1:].long()
    has = valid.reshape(-1, block_size)[:, 1:].any(-1)
    run = torch.cumprod(c, dim=1).sum(-1)
    stats[f"accept_{name}"] = run[has].double().sum().cpu()
    stats["blocks"] = has.double().sum().cpu()


def accumulate_stats(total: dict[str, torch.Tensor] | None, new: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Adds the counters of ``new`` into ``total`` (a fresh copy when ``total`` is None)."""
    if total is None:
        return {k: v.detach().clone().double().cpu() for k, v in new.items()}
    for k, v in new.items():
        v = v.detach().double().cpu()
        total[k] = total[k] + v if k in total else v.clone()
    return total


def summarize_stats(stats: dict[str, torch.Tensor], prefix: str = "") -> dict[str, float]:
    """Turns accumulated counters into loggable floats.

    Keys: ``acc_slot_{j}`` (top-1 accuracy of slot j, j = 1..B-1), ``acc_top1`` (all slots), ``acc_selector``
    (selector pick == true token), ``topk_recall`` (true token in top-k), ``ce_loss``, ``selector_loss``,
    ``distill_loss`` (the soft cross entropy, when distilling), ``tau_top1`` / ``tau_selector`` (``1 +`` mean
    teacher-forced accepted run per block of the top-1 path / the selector path: the greedy ``tau`` these blocks
    would get, truncated blocks included), ``labels``.
    """
    out: dict[str, float] = {}
    n = float(stats["labels"])
    if n <= 0:
        return out
    acc = stats["slot_correct"] / stats["slot_count"].clamp(min=1)
    for j in range(1, acc.shape[0]):
        if stats["slot_count"][j] > 0:
            out[f"{prefix}acc_slot_{j}"] = round(float(acc[j]), 4)
    out[f"{prefix}acc_top1"] = round(float(stats["top1_correct"]) / n, 4)
    if float(stats.get("selector_on", 0)) > 0:
        out[f"{prefix}acc_selector"] = round(float(stats["selector_correct"]) / n, 4)
        out[f"{prefix}topk_recall"] = round(float(stats["topk_hit"]) / n, 4)
    out[f"{prefix}ce_loss"] = round(float(stats["ce_sum"] / stats["ce_weight"].clamp(min=1e-12)), 4)
    if float(stats["sel_weight"]) > 0:
        out[f"{prefix}selector_loss"] = round(float(stats["sel_sum"] / stats["sel_weight"]), 4)
    if float(stats.get("distill_weight", 0)) > 0:
        out[f"{prefix}distill_loss"] = round(float(stats["distill_sum"] / stats["distill_weight"]), 4)
    blocks = float(stats.get("blocks", 0))
    if blocks > 0:
        out[f"{prefix}tau_top1"] = round(1.0 + float(stats["accept_top1"]) / blocks, 3)
        if f"{prefix}acc_selector" in out:
            out[f"{prefix}tau_selector"] = round(1.0 + float(stats["accept_selector"]) / blocks, 3)
    out[f"{prefix}labels"] = n
    return out


__all__ = ["DrafterLossOutput", "accumulate_stats", "default_gamma", "drafter_loss", "lm_head_on", "slot_weights",
           "summarize_stats"]
