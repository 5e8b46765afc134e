"""Recall by block position, teacher-forced (issue 38, item 1: the DFlash2 blog's table for our drafter).

On held-out records whose responses are the target's own greedy output, every response position ``a`` whose next
``B - 1`` tokens are all labelled is an anchor. One drafter pass per group of anchors (a block mask, as in
training: block ``n`` sees the target features of positions ``< a_n`` and its own ``B`` slots, which is what a
single serving call with context ``[0, a_n)`` computes) gives, at every slot ``t = 1 .. B-1``:

* ``recall@1``: the target's greedy token is the drafter's top-1 (over its draft vocabulary, mapped to target ids);
* ``recall@k``: it is among the top-``k`` candidates (``k`` = ``selector_top_k``, 16 for the shipped drafter);
* ``selector top-1 | true predecessor``: ``argmax_b S_t(x_{a+t-1}, b)`` over the top-k is the true token (teacher
  forced pair scoring: the predecessor is the true token at slot ``t - 1``, the anchor for slot 1);
* the cumulative "path correct so far" figures: the chance that a path is right at every slot ``1 .. t`` for the
  top-1 path, the selector's own greedy path (walked from the anchor as the serving loop does,
  :func:`~dflash2_hf.generation.candidate_generator.walk_greedy`), and the perfect-selector bound (the true token
  is in the top-k at every slot ``1 .. t``).

Every row shares one denominator (the blocks), so ``1 + sum_t cumulative_t`` is the teacher-forced greedy ``tau``
of that path with full blocks. Labels are the target's greedy next tokens computed in the same target forward that
gives the features (``argmax logits[p - 1]``), and a block counts only while the record's text agrees with them
(:func:`~dflash2_hf.training.collator.block_labels` with ``target_next``), so they are what verification accepts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..generation.candidate_generator import draft_lm_head
from ..training.collator import IGNORE_INDEX, block_labels, valid_anchors
from ..training.target_features import target_features

ROWS = (
    ("recall1", "Recall@1"),
    ("recallk", "Recall@{k}"),
    ("selector_tf", "selector top-1 \\| true predecessor"),
    ("path_top1", "path correct so far: top-1 path"),
    ("path_selector", "path correct so far: selector path"),
    ("path_perfect", "path correct so far: perfect selector (top-{k} bound)"),
)
CUMULATIVE = ("path_top1", "path_selector", "path_perfect")


@dataclass
class RecallByPosition:
    """Per-slot hit counts over full blocks (``slots = B - 1`` columns).

    Attributes:
        slots: draft slots per block (``B - 1``).
        top_k: the candidate count ``k`` of ``recall@k`` and the selector.
        blocks: blocks counted (the common denominator of every row).
        counts: row name (:data:`ROWS`) -> ``slots`` hit counts.
        records: records read; ``partial_blocks``: anchors left out because fewer than ``slots`` slots had labels
            (end of a response or of the cut record, or text that leaves the target's greedy path);
        label_agreement: positions whose record token equals the target's greedy token / response positions checked.
    """

    slots: int
    top_k: int
    blocks: int = 0
    counts: dict[str, list[int]] = field(default_factory=dict)
    records: int = 0
    partial_blocks: int = 0
    agree: int = 0
    checked: int = 0

    def __post_init__(self):
        for name, _ in ROWS:
            self.counts.setdefault(name, [0] * self.slots)

    def add(self, hits: dict[str, torch.Tensor]) -> None:
        """Adds :func:`block_metrics` output (``(N, slots)`` bool per row)."""
        n = None
        for name, _ in ROWS:
            h = hits[name]
            n = h.shape[0]
            self.counts[name] = [c + int(v) for c, v in zip(self.counts[name], h.long().sum(0).tolist())]
        self.blocks += n or 0

    def rates(self) -> dict[str, list[float]]:
        """Row name -> per-slot rates (hits / blocks)."""
        d = max(self.blocks, 1)
        return {name: [c / d for c in self.counts[name]] for name, _ in ROWS}

    def tau(self) -> dict[str, float]:
        """Implied teacher-forced ``tau = 1 + sum_t cumulative_t`` of each cumulative row."""
        r = self.rates()
        return {name: 1.0 + sum(r[name]) for name in CUMULATIVE}

    def to_dict(self) -> dict:
        return {"slots": self.slots, "top_k": self.top_k, "blocks": self.blocks, "records": self.records,
                "partial_blocks_left_out": self.partial_blocks,
                "label_agreement": {"agree": self.agree, "checked": self.checked},
                "counts": self.counts, "rates": self.rates(), "tau": self.tau()}

    def markdown(self, digits: int = 3) -> str:
        """The table: one row per metric, one column per slot, plus the implied ``tau`` of the cumulative rows."""
        r, tau = self.rates(), self.tau()
        head = "| metric | " + " | ".join(str(t) for t in range(1, self.slots + 1)) + " | implied tau |"
        lines = [head, "|---|" + "---:|" * (self.slots + 1)]
        for name, label in ROWS:
            cells = [f"{v:.{digits}f}" for v in r[name]]
            t = f"{tau[name]:.{digits}f}" if name in tau else "-"
            lines.append(f"| {label.format(k=self.top_k)} | " + " | ".join(cells) + f" | {t} |")
        return "\n".join(lines)


@torch.no_grad()
def block_metrics(
    logits: torch.Tensor,
    hidden: torch.Tensor,
    labels: torch.LongTensor,
    anchor_ids: torch.LongTensor,
    selector: nn.Module | None,
    top_k: int,
    vocab_ids: torch.LongTensor | None = None,
) -> dict[str, torch.Tensor]:
    """Per-slot hits of full blocks.

    Args:
        logits: ``(N, P, V')`` drafter logits at slots ``1 .. P`` (over the draft vocabulary when ``vocab_ids``).
        hidden: ``(N, P, H)`` drafter hidden states at those slots (the selector's context).
        labels: ``(N, P)`` target token ids, all valid.
        anchor_ids: ``(N,)`` the anchors' tokens (slot 1's predecessor).
        selector: the drafter's :class:`~dflash2_hf.modeling_dflash2.CandidateSelector`, or None (then the selector
            rows repeat the top-1 path: what the serving loop drafts without one).
        top_k: candidates per slot.
        vocab_ids: ``(V',)`` draft-vocabulary index -> target id, or None (identity).

    Returns:
        row name (:data:`ROWS`) -> ``(N, P)`` bool, and ``"selector_path"``: ``(N, P)`` the token ids of the
        selector's own greedy path (the top-1 path without a selector).
    """
    N, P, _ = logits.shape
    to_ids = (lambda i: i) if vocab_ids is None else (lambda i: vocab_ids[i])
    k = min(top_k, logits.shape[-1])
    top_vals, top_idx = logits.float().topk(k, dim=-1)  # (N, P, k), descending
    cand = to_ids(top_idx)
    is_true = cand == labels[..., None]
    recall1 = is_true[..., 0]
    recallk = is_true.any(-1)
    if selector is None:
        sel_tf = recall1
        sel_path = cand[..., 0]
    else:
        true_pred = torch.cat([anchor_ids[:, None], labels[:, :-1]], dim=1)[..., None]  # (N, P, 1)
        tf_scores = selector.pair_scores(hidden, true_pred, cand, top_vals).squeeze(-2).float()  # (N, P, k)
        sel_tf = cand.gather(-1, tf_scores.argmax(-1, keepdim=True)).squeeze(-1) == labels
        # own path, as walk_greedy: slot 1 from the anchor, slot t from the candidate the path took at t - 1
        preds = torch.cat([anchor_ids[:, None, None].expand(N, 1, k), cand[:, :-1]], dim=1)  # (N, P, k)
        best = selector.pair_scores(hidden, preds, cand, top_vals).float().argmax(-1)  # (N, P, k) best successor
        idx = best[:, 0, 0]
        picks = [idx]
        for t in range(1, P):
            idx = best[:, t].gather(-1, idx[:, None]).squeeze(-1)
            picks.append(idx)
        sel_path = cand.gather(-1, torch.stack(picks, 1)[..., None]).squeeze(-1)
    return {
        "recall1": recall1,
        "recallk": recallk,
        "selector_tf": sel_tf,
        "path_top1": torch.cumprod(recall1.long(), 1).bool(),
        "path_selector": torch.cumprod((sel_path == labels).long(), 1).bool(),
        "path_perfect": torch.cumprod(recallk.long(), 1).bool(),
        "selector_path": sel_path,
    }


def full_blocks(input_ids: torch.LongTensor, response_mask: torch.Tensor, target_next: torch.LongTensor,
                block_size: int) -> tuple[torch.LongTensor, torch.LongTensor, int]:
    """Anchors whose ``B - 1`` slots are all labelled, their ``(N, B)`` labels, and how many anchors were not."""
    anchors = valid_anchors(response_mask)
    if anchors.numel() == 0:
        return anchors, torch.zeros(0, block_size, dtype=torch.long), 0
    labels, _ = block_labels(input_ids, response_mask, anchors, block_size, target_next=target_next)
    full = (labels[:, 1:] != IGNORE_INDEX).all(-1)
    return anchors[full], labels[full], int((~full).sum())


@torch.no_grad()
def drafter_block_hidden(drafter: nn.Module, features: torch.Tensor, input_ids: torch.LongTensor,
                         anchors: torch.LongTensor, embedding_weight: torch.Tensor) -> torch.Tensor:
    """``(N, B, H)`` drafter hidden states of blocks at ``anchors`` of one sequence, in one pass.

    ``features``: ``(T, n*H_t)`` target features of the sequence; block ``n`` sees those of positions ``< a_n`` and
    its own slots (the training block mask, :class:`~dflash2_hf.training.collator.BlockCollator`).
    """
    B = drafter.config.block_size
    N = anchors.numel()
    T = int(anchors.max()) if N else 0  # no block sees position max(a) or later
    ctx = features[:T][None]
    block_ids = torch.full((N, B), drafter.config.mask_token_id, dtype=torch.long)
    block_ids[:, 0] = input_ids[anchors]
    embeds = drafter.embed_block(block_ids.reshape(1, N * B), embedding_weight)
    offs = torch.arange(B)
    slot_block = torch.arange(N * B) // B
    pos = torch.cat([torch.arange(T), (anchors[:, None] + offs).flatten()])[None]
    attn = torch.zeros(1, 1, N * B, T + N * B, dtype=torch.bool)
    attn[0, 0, :, :T] = torch.arange(T)[None, :] < anchors[slot_block][:, None]
    attn[0, 0, :, T:] = slot_block[:, None] == slot_block[None, :]
    dev = next(drafter.parameters()).device
    out = drafter(noise_embeds=embeds.to(dev), context_hidden_states=ctx.to(dev), position_ids=pos.to(dev),
                  attention_mask=attn.to(dev)).last_hidden_state
    return out.reshape(N, B, -1)


@torch.no_grad()
def recall_by_position(
    drafter: nn.Module,
    target: nn.Module,
    records: list[dict],
    max_length: int | None = 1024,
    blocks_per_pass: int = 64,
    use_selector: bool = True,
    progress=None,
) -> RecallByPosition:
    """Teacher-forced recall by block position of ``drafter`` on ``records`` (module docstring).

    Args:
        drafter: a :class:`~dflash2_hf.DFlash2DraftModel` (eval mode).
        target: its target; run once per record with the features' layers and its LM head (greedy labels).
        records: ``{"input_ids", "response_mask"}`` dicts
            (:func:`~dflash2_hf.training.load_training_records` with ``train_only=False`` for held-out data).
        max_length: cut each record to this many tokens.
        blocks_per_pass: anchors per drafter pass.
        use_selector: False scores the selector rows as the top-1 path (a drafter without a selector).
        progress: optional callable ``(i, n, stats)`` after each record.

    Returns:
        :class:`RecallByPosition`.
    """
    cfg = drafter.config
    B = cfg.block_size
    selector = drafter.candidate_selector if use_selector else None
    top_k = min(cfg.selector_top_k, cfg.draft_vocab_size or cfg.vocab_size)
    stats = RecallByPosition(slots=B - 1, top_k=top_k)
    emb = target.get_input_embeddings().weight
    head = draft_lm_head(target.get_output_embeddings(), drafter)
    vocab = getattr(drafter, "draft_vocab_ids", None)
    dev = next(drafter.parameters()).device
    tdev = next(target.parameters()).device
    for i, rec in enumerate(records):
        ids = torch.as_tensor(rec["input_ids"], dtype=torch.long)[:max_length]
        mask = torch.as_tensor(rec["response_mask"]).bool()[: ids.numel()]
        feats, nxt = target_features(target, ids[None].to(tdev), cfg.target_layer_ids, with_next=True)
        feats, nxt = feats[0].cpu(), nxt[0].cpu()
        # the record's response tokens vs the target's greedy choice given the record's own prefix
        resp = torch.nonzero(mask[1:]).flatten() + 1
        stats.agree += int((ids[resp] == nxt[resp - 1]).sum())
        stats.checked += resp.numel()
        anchors, labels, partial = full_blocks(ids, mask, nxt, B)
        stats.partial_blocks += partial
        for s in range(0, anchors.numel(), blocks_per_pass):
            a, lab = anchors[s : s + blocks_per_pass], labels[s : s + blocks_per_pass, 1:]
            hidden = drafter_block_hidden(drafter, feats, ids, a, emb)[:, 1:]  # (n, B-1, H)
            logits = drafter.compute_logits(hidden, head).to(dev)
            v = None if vocab is None or logits.shape[-1] != vocab.numel() else vocab.to(dev)
            stats.add(block_metrics(logits, hidden, lab.to(dev), ids[a].to(dev), selector, top_k, v))
        stats.records += 1
        if progress is not None:
            progress(i, len(records), stats)
    return stats


__all__ = ["CUMULATIVE", "ROWS", "RecallByPosition", "block_metrics", "drafter_block_hidden", "full_blocks",
           "recall_by_position"]
