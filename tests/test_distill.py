"""Distillation from the target's stored top-k next-token logits (FeatureCache topk, collator soft targets, loss)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash2_hf.training import IGNORE_INDEX, BlockCollator, FeatureCache, FeatureDataset, drafter_loss, slot_weights
from test_training import _drafter, _records, _target

torch.set_num_threads(1)
K = 8


def _cached_items(tmp_path, target, drafter, n=3):
    recs = _records(n, seed=6)
    cache = FeatureCache(tmp_path, "tiny", drafter.config.target_layer_ids, topk=K)
    cache.build(target, recs, max_length=30, progress=False)
    return recs, cache, [FeatureDataset(recs, cache, max_length=30)[i] for i in range(n)]


def test_cache_stores_the_targets_top_k_logits(tmp_path):
    target = _target()
    drafter = _drafter(target)
    recs, cache, items = _cached_items(tmp_path, target, drafter)
    assert cache.dir.name.endswith("__next__top8") and cache.with_next
    assert cache.meta["target"]["topk"] == K
    for r in recs:
        L = cache.length(r["record_id"])
        with torch.no_grad():
            logits = target(torch.tensor([r["input_ids"][:L]])).logits[0]
        vals, ids = cache.get_topk(r["record_id"])
        ref = logits.topk(K, dim=-1)
        assert torch.equal(ids, ref.indices)
        torch.testing.assert_close(vals, ref.values, rtol=1e-3, atol=2e-3)  # stored in float16
        assert torch.equal(cache.get_next(r["record_id"]), logits.argmax(-1))
    # a cache without top-k logits refuses to give them, and the two never share a folder
    plain = FeatureCache(tmp_path, "tiny", drafter.config.target_layer_ids, with_next=True)
    assert plain.dir != cache.dir
    with pytest.raises(KeyError, match="no top-k"):
        plain.get_topk(recs[0]["record_id"])
    with pytest.raises(ValueError, match="topk"):
        FeatureCache(tmp_path, "tiny", [0], topk=-1)


def test_a_distillation_cache_keeps_the_texts_labels_unless_target_labels_is_asked(tmp_path):
    target = _target()
    drafter = _drafter(target)
    recs, cache, _ = _cached_items(tmp_path, target, drafter)
    plain = FeatureDataset(recs, cache, max_length=30, target_labels=False)[0]
    assert "target_next" not in plain and "target_topk_logits" in plain
    assert "target_next" in FeatureDataset(recs, cache, max_length=30, target_labels=True)[0]
    no_next = FeatureCache(tmp_path, "tiny", drafter.config.target_layer_ids)
    with pytest.raises(ValueError, match="greedy tokens"):
        FeatureDataset(recs, no_next, target_labels=True)
    with pytest.raises(ValueError, match="vocabulary"):
        FeatureCache(tmp_path / "big", "tiny", drafter.config.target_layer_ids, topk=10**6).build(
            target, recs, progress=False)


def test_collator_gives_each_slot_the_distribution_of_its_predecessor_position(tmp_path):
    target = _target()
    drafter = _drafter(target)
    _, _, items = _cached_items(tmp_path, target, drafter)
    B = 4
    batch = BlockCollator(block_size=B, mask_token_id=0, num_blocks=3, seed=1)(items)
    assert batch["soft_logits"].shape == (*batch["labels"].shape, K)
    checked = 0
    for r, item in enumerate(items):
        for n, a in enumerate(batch["anchors"][r].tolist()):
            if a < 0:
                continue
            for j in range(1, B):
                q = n * B + j
                if batch["labels"][r, q] == IGNORE_INDEX:
                    continue
                assert torch.equal(batch["soft_ids"][r, q], item["target_topk_ids"][a + j - 1])
                assert torch.equal(batch["soft_logits"][r, q], item["target_topk_logits"][a + j - 1])
                checked += 1
    assert checked >= 6
    with pytest.raises(ValueError, match="only some items"):
        plain = {k: v for k, v in items[0].items() if not k.startswith("target_topk")}
        BlockCollator(block_size=B, mask_token_id=0)([plain, items[1]])


def _loss_inputs(target, drafter):
    torch.manual_seed(0)
    hidden = torch.randn(1, 8, drafter.config.hidden_size, requires_grad=True)
    labels = torch.tensor([[IGNORE_INDEX, 5, 7, 9, IGNORE_INDEX, 11, 13, IGNORE_INDEX]])
    preds = torch.tensor([[0, 1, 5, 7, 0, 3, 11, 0]])
    return hidden, labels, preds


def test_distillation_loss_is_the_soft_cross_entropy_mixed_with_the_hard_one():
    target = _target()
    drafter = _drafter(target)
    head = target.get_output_embeddings()
    hidden, labels, preds = _loss_inputs(target, drafter)
    g = torch.Generator().manual_seed(1)
    soft_ids = torch.randint(3, 128, (1, 8, K), generator=g)
    soft_logits = torch.randn(1, 8, K, generator=g) * 3
    kw = dict(selector_weight=0.0, soft_logits=soft_logits, soft_ids=soft_ids)
    hard = drafter_loss(drafter, hidden, labels, preds, head, 4, selector_weight=0.0)
    full = drafter_loss(drafter, hidden, labels, preds, head, 4, distill_weight=1.0, **kw)
    half = drafter_loss(drafter, hidden, labels, preds, head, 4, distill_weight=0.5, **kw)
    # by hand: -sum_i softmax(soft_logits)_i log p(soft_ids_i), slot-weighted over the labelled slots
    valid = labels[0] != IGNORE_INDEX
    logp = F.log_softmax(drafter.compute_logits(hidden[0], head).float(), -1)
    soft_ce = -(F.softmax(soft_logits[0], -1) * logp.gather(-1, soft_ids[0])).sum(-1)
    w = slot_weights(4).repeat(2)[valid]
    ref = (w * soft_ce[valid]).sum() / w.sum()
    torch.testing.assert_close(full.loss, ref)
    torch.testing.assert_close(half.loss, 0.5 * hard.ce_loss + 0.5 * ref)
    torch.testing.assert_close(full.ce_loss, hard.ce_loss)  # the reported CE stays the hard one
    assert abs(float(full.stats["distill_sum"] / full.stats["distill_weight"]) - float(ref.detach())) < 1e-5
    full.loss.backward()
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0
    # a one-hot target distribution on the true token is the hard loss again
    one_hot_ids = labels.clamp(min=3)[..., None].repeat(1, 1, K)
    one_hot_ids[..., 1:] = 100 + torch.arange(K - 1)
    one_hot = torch.full((1, 8, K), -1e4)
    one_hot[..., 0] = 0.0
    same = drafter_loss(drafter, hidden, labels, preds, head, 4, selector_weight=0.0, distill_weight=1.0,
                        soft_logits=one_hot, soft_ids=one_hot_ids)
    torch.testing.assert_close(same.loss, hard.ce_loss)


def test_distillation_over_the_draft_vocabulary_drops_tokens_outside_it():
    target = _target()
    drafter = _drafter(target)
    vocab = torch.arange(3, 128, 2)  # odd ids only
    drafter.set_draft_vocab(vocab)
    head = target.get_output_embeddings()
    hidden, labels, preds = _loss_inputs(target, drafter)
    soft_ids = torch.tensor([5, 6, 7, 8, 9, 10, 11, 12]).repeat(1, 8, 1)  # the even ids cannot be drafted
    soft_logits = torch.linspace(2.0, -2.0, K).repeat(1, 8, 1)
    out = drafter_loss(drafter, hidden, labels, preds, head, 4, selector_weight=0.0, distill_weight=1.0,
                       soft_logits=soft_logits, soft_ids=soft_ids)
    logits = drafter.compute_logits(hidden[0], head)[:, vocab].float()
    logp = F.log_softmax(logits, -1)
    keep = torch.tensor([0, 2, 4, 6])
    q = F.softmax(soft_logits[0, 0, keep], -1)
    cols = torch.tensor([{int(t): i for i, t in enumerate(vocab)}[int(t)] for t in soft_ids[0, 0, keep]])
    valid = labels[0] != IGNORE_INDEX
    soft_ce = -(q * logp[:, cols]).sum(-1)
    w = slot_weights(4).repeat(2)[valid]
    torch.testing.assert_close(out.loss, (w * soft_ce[valid]).sum() / w.sum())


def test_a_biased_lm_head_with_a_draft_vocabulary_maps_labels_and_soft_ids():
    """A biased head over the draft rows is an nn.Linear (not a tensor): the loss must still map ids to its rows."""
    target = _target()
    drafter = _drafter(target)
    vocab = torch.arange(3, 128, 2)
    drafter.set_draft_vocab(vocab)
    head = torch.nn.Linear(target.config.hidden_size, target.config.vocab_size, bias=True)
    with torch.no_grad():
        head.weight.copy_(target.get_output_embeddings().weight)
        head.bias.normal_(0, 1.0, generator=torch.Generator().manual_seed(3))
    hidden, labels, preds = _loss_inputs(target, drafter)
    soft_ids = torch.tensor([5, 7, 9, 11, 13, 15, 17, 19]).repeat(1, 8, 1)
    soft_logits = torch.linspace(1.0, -1.0, K).repeat(1, 8, 1)
    out = drafter_loss(drafter, hidden, labels, preds, head, 4, selector_weight=0.0, distill_weight=1.0,
                       soft_logits=soft_logits, soft_ids=soft_ids)
    logp = F.log_softmax(drafter.compute_logits(hidden[0], head)[:, vocab].float(), -1)
    cols = torch.tensor([{int(t): i for i, t in enumerate(vocab)}[int(t)] for t in soft_ids[0, 0]])
    soft_ce = -(F.softmax(soft_logits[0, 0], -1) * logp[:, cols]).sum(-1)
    valid = labels[0] != IGNORE_INDEX
    w = slot_weights(4).repeat(2)[valid]
    torch.testing.assert_close(out.loss, (w * soft_ce[valid]).sum() / w.sum())


def test_distill_weight_needs_soft_targets_and_a_valid_share():
    target = _target()
    drafter = _drafter(target)
    hidden, labels, preds = _loss_inputs(target, drafter)
    head = target.get_output_embeddings()
    with pytest.raises(ValueError, match="--distill-topk"):
        drafter_loss(drafter, hidden, labels, preds, head, 4, distill_weight=0.5)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        drafter_loss(drafter, hidden, labels, preds, head, 4, distill_weight=1.5)


def test_cli_trains_with_distillation_and_refuses_a_weight_without_logits(tmp_path, monkeypatch, capsys):
    import json

    from dflash2_hf.cli import main
    from test_data import regenerated_tiny_chat

    t = regenerated_tiny_chat(tmp_path, monkeypatch)
    common = ["train", "--target", t, "--data", str(tmp_path / "regen"), "--num-layers", "1", "--block-size", "4",
              "--target-layer-ids", "0,1", "--num-blocks", "4", "--max-steps", "2", "--save-steps", "100",
              "--logging-steps", "1", "--disable-tqdm", "true"]
    assert main([*common, "--output-dir", str(tmp_path / "bad"), "--distill-weight", "0.5"]) == 2
    assert "--distill-topk" in capsys.readouterr().err
    out = tmp_path / "run"
    assert main([*common, "--output-dir", str(out), "--distill-topk", "4"]) == 0
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["feature_cache"][0].endswith("__next__top4")
    assert summary["last_metrics"]["distill_loss"] > 0
