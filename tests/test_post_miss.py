"""Post-miss weighting: anchors drawn in adjacent pairs, and blocks whose anchor token the drafter missed from the
position before weighted in the loss (training/collator.py, training/losses.py)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dflash2_hf import DFlash2DraftModel
from dflash2_hf.training import IGNORE_INDEX, BlockCollator, drafter_loss, slot_weights, valid_anchors
from dflash2_hf.training.collator import previous_blocks, sample_anchor_pairs
from dflash2_hf.training.config import DataArguments

torch.set_num_threads(1)
B = 4


def test_pairs_bring_their_predecessor_and_previous_blocks_index_it():
    mask = torch.tensor(([0] * 5 + [1] * 30) * 2)
    valid = set(valid_anchors(mask).tolist())
    rng = random.Random(0)
    for _ in range(50):
        anchors = sample_anchor_pairs(mask, 8, rng)
        got = anchors.tolist()
        assert got == sorted(set(got)) and set(got) <= valid and 2 <= len(got) <= 8
        prev = previous_blocks(anchors).tolist()
        for i, a in enumerate(got):
            assert prev[i] == (got.index(a - 1) if a - 1 in got else -1)
        # every anchor is part of a pair: its predecessor or its successor is there too
        assert all(a - 1 in got or a + 1 in got for a in got)
        assert sum(p >= 0 for p in prev) >= len(got) // 2
    # a response of two tokens has one anchor and no pair
    assert sample_anchor_pairs(torch.tensor([0, 1, 1, 0]), 8, rng).numel() == 0


def test_collator_outputs_previous_block_only_when_weighting():
    ids = torch.arange(40) % 17
    mask = torch.tensor([0] * 8 + [1] * 32).bool()
    item = {"input_ids": ids, "response_mask": mask, "context_hidden_states": torch.zeros(40, 3)}
    plain = BlockCollator(block_size=B, mask_token_id=0, num_blocks=6, seed=0)([item])
    assert "previous_block" not in plain
    batch = BlockCollator(block_size=B, mask_token_id=0, num_blocks=6, seed=0, post_miss_weight=3.0)([item, item])
    anchors, prev = batch["anchors"], batch["previous_block"]
    assert prev.shape == anchors.shape
    for r in range(2):
        for n, p in enumerate(prev[r].tolist()):
            if p >= 0:
                assert anchors[r, p] == anchors[r, n] - 1
            elif anchors[r, n] >= 0:
                assert int(anchors[r, n]) - 1 not in anchors[r].tolist()
    with pytest.raises(ValueError, match="post_miss_weight"):
        BlockCollator(block_size=B, mask_token_id=0, post_miss_weight=0.0)
    with pytest.raises(ValueError, match="--post-miss-weight"):
        DataArguments(data="x", post_miss_weight=-1.0)


@pytest.fixture(scope="module")
def drafter_and_head():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    target = LlamaForCausalLM(cfg).eval()
    drafter = DFlash2DraftModel.from_target(target, num_hidden_layers=1, block_size=B, selector_rank=8,
                                            selector_top_k=4)
    return drafter, target.lm_head


@pytest.mark.parametrize("first_slot_hits", [False, True])
def test_loss_weighs_the_block_after_a_slot_1_miss(drafter_and_head, first_slot_hits):
    drafter, head = drafter_and_head
    torch.manual_seed(1)
    hidden = torch.randn(1, 2 * B, drafter.config.hidden_size)
    with torch.no_grad():
        pred = drafter.compute_logits(hidden[0], head).argmax(-1)
    labels = torch.full((1, 2 * B), IGNORE_INDEX)
    labels[0, 1] = pred[1] if first_slot_hits else (pred[1] + 1) % 64  # block 0, slot 1
    labels[0, 2] = (pred[2] + 1) % 64
    labels[0, B + 1], labels[0, B + 2] = pred[B + 1], (pred[B + 2] + 3) % 64  # block 1
    preds = torch.zeros(1, 2 * B, dtype=torch.long)
    previous = torch.tensor([[-1, 0]])
    res = drafter_loss(drafter, hidden, labels, preds, head, B, selector_weight=0.0, previous_block=previous,
                       post_miss_weight=3.0)
    slots = [1, 2, B + 1, B + 2]
    ce = torch.nn.functional.cross_entropy(drafter.compute_logits(hidden[0, slots], head), labels[0, slots],
                                           reduction="none")
    w = slot_weights(B)[[1, 2, 1, 2]]
    factor = torch.tensor([1.0, 1.0, 1.0, 1.0] if first_slot_hits else [1.0, 1.0, 3.0, 3.0])
    torch.testing.assert_close(res.loss, (w * factor * ce).sum() / (w * factor).sum())
    off = drafter_loss(drafter, hidden, labels, preds, head, B, selector_weight=0.0)
    torch.testing.assert_close(off.loss, (w * ce).sum() / w.sum())
    assert torch.equal(res.stats["slot_correct"], off.stats["slot_correct"])  # metrics are not weighted
