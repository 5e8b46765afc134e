"""Teacher-forced evaluation of a drafter on held-out sequences with cached target features.

For each sequence, blocks are drawn by a :class:`~dflash2_hf.training.collator.BlockCollator` with a FIXED seed
(the same blocks for every checkpoint), run through the drafter exactly as in training (no gradient), and scored
with :func:`~dflash2_hf.training.losses.drafter_loss`. With exact target features, a block's run of correct slots
from slot 1 on is what greedy verification would accept, so ``tau_top1`` / ``tau_selector`` estimate the greedy
acceptance length of the top-1 path / the selector path on that data (without the serving loop; blocks cut by the
end of a response count as they are).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .collator import BlockCollator
from .losses import accumulate_stats, drafter_loss, lm_head_on, summarize_stats


@torch.no_grad()
def evaluate_blocks(
    drafter: nn.Module,
    target_embedding: torch.Tensor,
    target_lm_head: nn.Module,
    dataset,
    collator: BlockCollator,
    batch_size: int = 1,
    max_sequences: int | None = None,
    gamma: float | None = None,
    seed: int = 1234,
) -> dict[str, float]:
    """Teacher-forced metrics of ``drafter`` over ``dataset``.

    Args:
        drafter: a :class:`~dflash2_hf.DFlash2DraftModel` (put in eval mode for the call, then restored).
        target_embedding: ``(V, H_t)`` frozen target input embedding weight.
        target_lm_head: the frozen target LM head.
        dataset: items as :class:`~dflash2_hf.training.dataset.FeatureDataset` gives them.
        collator: template collator; a copy re-seeded with ``seed`` draws the blocks.
        batch_size: sequences per forward.
        max_sequences: evaluate the first N sequences only.
        gamma: slot-weight decay for the reported ``ce_loss``.

    Returns:
        :func:`~dflash2_hf.training.losses.summarize_stats` of all blocks (``acc_slot_j``, ``acc_top1``,
        ``acc_selector``, ``topk_recall``, ``ce_loss``, ``selector_loss``, ``tau_top1``, ``tau_selector``, ``labels``)
        plus ``sequences``.
    """
    # __post_init__ builds a fresh RNG from `seed`; uniform anchors whatever the run trains on, so every run's
    # estimate is over the same blocks
    col = dataclasses.replace(collator, seed=seed, early_anchor_weight=1.0, post_miss_weight=1.0, epoch=None)
    was_training = drafter.training
    drafter.eval()
    n = len(dataset) if max_sequences is None else min(len(dataset), max_sequences)
    total = None
    param = next(drafter.parameters())
    target_lm_head = lm_head_on(target_lm_head, param.device)
    try:
        for start in range(0, n, batch_size):
            batch = col([dataset[i] for i in range(start, min(n, start + batch_size))])
            batch = {k: v.to(param.device) for k, v in batch.items()}
            embeds = drafter.embed_block(batch["block_input_ids"], target_embedding.to(param.device))
            out = drafter(noise_embeds=embeds, context_hidden_states=batch["context_hidden_states"],
                          position_ids=batch["position_ids"], attention_mask=batch["attention_mask"])
            res = drafter_loss(drafter, out.last_hidden_state, batch["labels"], batch["predecessor_ids"],
                               target_lm_head, drafter.config.block_size, gamma=gamma)
            total = accumulate_stats(total, res.stats)
    finally:
        drafter.train(was_training)
    out = summarize_stats(total) if total is not None else {}
    out["sequences"] = n
    return out


__all__ = ["evaluate_blocks"]
