"""Drafter training: block mask exactness, collator, losses, feature cache, Trainer (freeze, resume, checkpoints).

Everything runs on a tiny random Llama target (hidden 64, 6 layers, vocab 128), fp32, one thread.
"""

from __future__ import annotations

import json
import math
import os
import random

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import randomize_convs, randomize_selector

from dflash2_hf import DFlash2DraftModel
from dflash2_hf.training import (
    IGNORE_INDEX,
    BlockCollator,
    DFlash2Trainer,
    FeatureCache,
    FeatureDataset,
    default_gamma,
    default_training_arguments,
    drafter_loss,
    feature_length,
    response_offsets,
    sample_anchors,
    slot_weights,
    summarize_stats,
    target_features,
    valid_anchors,
)

torch.set_num_threads(1)
B = 4
VOCAB = 128


def _target(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)
    return model


def _drafter(target, seed=1, **kw):
    torch.manual_seed(seed)
    opts = dict(num_hidden_layers=2, block_size=B, selector_rank=16, selector_top_k=8)
    opts.update(kw)
    return DFlash2DraftModel.from_target(target, **opts)


def _perturb(drafter, seed=3):
    """Moves convs and selector away from their identity / zero init so the test really exercises them."""
    return randomize_selector(randomize_convs(drafter, seed=seed), seed=seed, scale=1.0)


def _records(n=6, seed=0, lo=20, hi=40):
    """Synthetic records: a random prompt then a response cycling through 6 record-specific tokens (learnable)."""
    rng = random.Random(seed)
    recs = []
    for rid in range(n):
        L = rng.randint(lo, hi)
        p = rng.randint(4, 10)
        cycle = rng.sample(range(3, VOCAB), 6)
        ids = [rng.randrange(3, VOCAB) for _ in range(p)] + [cycle[i % 6] for i in range(L - p)]
        mask = [0] * p + [1] * (L - p)
        recs.append({"record_id": rid, "input_ids": ids, "response_mask": mask})
    return recs


@pytest.fixture(scope="module")
def target():
    return _target()


def _items(target, drafter, recs):
    ids = drafter.config.target_layer_ids
    out = []
    for r in recs:
        x = torch.tensor([r["input_ids"]])
        out.append({"input_ids": x[0], "response_mask": torch.tensor(r["response_mask"], dtype=torch.bool),
                    "context_hidden_states": target_features(target, x, ids)[0]})
    return out


# ---------------------------------------------------------------------------- key correctness: block mask
def test_multi_block_forward_matches_single_block_inference(target):
    drafter = _perturb(_drafter(target)).eval()
    recs = _records(3, seed=5)
    items = _items(target, drafter, recs)
    collator = BlockCollator(block_size=B, mask_token_id=drafter.config.mask_token_id, num_blocks=6, seed=0)
    batch = collator(items)
    emb_w = target.get_input_embeddings().weight
    embeds = drafter.embed_block(batch["block_input_ids"], emb_w)
    with torch.no_grad():
        multi = drafter(embeds, batch["context_hidden_states"], position_ids=batch["position_ids"],
                        attention_mask=batch["attention_mask"]).last_hidden_state
        checked = 0
        for r in range(len(items)):
            for j, a in enumerate(batch["anchors"][r].tolist()):
                if a < 0:
                    continue
                e = embeds[r : r + 1, j * B : (j + 1) * B]
                ctx = items[r]["context_hidden_states"][None, :a]
                single = drafter(e, ctx, position_ids=torch.arange(0, a + B)[None]).last_hidden_state
                torch.testing.assert_close(multi[r : r + 1, j * B : (j + 1) * B], single, rtol=1e-5, atol=1e-5)
                checked += 1
    assert checked >= 12


def test_target_features_match_output_hidden_states(target):
    ids = torch.randint(3, VOCAB, (2, 17))
    layer_ids = [1, 3, 4]
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    ref = torch.cat([out.hidden_states[i + 1] for i in layer_ids], -1)
    torch.testing.assert_close(target_features(target, ids, layer_ids), ref)
    with pytest.raises(ValueError):
        target_features(target, ids, [6])


# ---------------------------------------------------------------------------- collator
def test_collator_anchors_inside_response_and_labels():
    recs = _records(8, seed=1)
    feats = [torch.zeros(len(r["input_ids"]), 3) for r in recs]
    items = [{"input_ids": torch.tensor(r["input_ids"]), "response_mask": torch.tensor(r["response_mask"]).bool(),
              "context_hidden_states": f} for r, f in zip(recs, feats)]
    # a second response span after a user turn: labels must stop at the first non-response position
    items[0]["response_mask"][12:15] = False
    collator = BlockCollator(block_size=B, mask_token_id=0, num_blocks=5, seed=0)
    seen = set()
    for _ in range(20):
        batch = collator(items)
        T = batch["context_hidden_states"].shape[1]
        for r, item in enumerate(items):
            mask, ids = item["response_mask"], item["input_ids"]
            for j, a in enumerate(batch["anchors"][r].tolist()):
                if a < 0:
                    continue
                seen.add((r, a))
                assert mask[a] and mask[a + 1], "anchor and its successor must be response tokens"
                lab = batch["labels"][r, j * B : (j + 1) * B]
                assert lab[0] == IGNORE_INDEX and lab[1] == ids[a + 1]
                for k in range(1, B):
                    ok = a + k < len(ids) and bool(mask[a + 1 : a + k + 1].all())
                    assert lab[k] == (ids[a + k] if ok else IGNORE_INDEX)
                    if ok:
                        assert batch["predecessor_ids"][r, j * B + k] == ids[a + k - 1]
                assert batch["block_input_ids"][r, j * B] == ids[a]
                assert (batch["block_input_ids"][r, j * B + 1 : (j + 1) * B] == 0).all()
                pos = batch["position_ids"][r, T + j * B : T + (j + 1) * B]
                assert pos.tolist() == list(range(a, a + B))
                row = batch["attention_mask"][r, 0, j * B]
                assert row[:a].all() and not row[a:T].any()
                assert row[T + j * B : T + (j + 1) * B].all() and row[T:].sum() == B
    # anchors are re-drawn on every call
    assert len(seen) > 5 * len(items)


def test_sample_anchors_and_feature_length():
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1, 0])
    anchors = sample_anchors(mask, 10, random.Random(0)).tolist()
    assert anchors == [2, 3, 6]
    assert sample_anchors(torch.tensor([0, 1, 0]), 4, random.Random(0)).numel() == 0
    assert feature_length(list(range(9)), mask.tolist(), None) == 8
    assert feature_length(list(range(9)), mask.tolist(), 5) == 5
    assert feature_length(list(range(9)), [0] * 9, None) == 0


def test_early_anchor_weight_favours_the_start_of_each_response():
    # two responses of 40 tokens after prompts of 10: offsets 0..39 each, -1 outside
    mask = torch.tensor(([0] * 10 + [1] * 40) * 2)
    offsets = response_offsets(mask)
    assert offsets[:10].eq(-1).all() and offsets[10:50].tolist() == list(range(40)) == offsets[60:].tolist()
    valid = set(valid_anchors(mask).tolist())
    early = {a for a in valid if offsets[a] < 8}
    counts = {1.0: 0, 20.0: 0}
    for weight in counts:
        rng = random.Random(0)
        for _ in range(200):
            anchors = sample_anchors(mask, 10, rng, early_tokens=8, early_weight=weight)
            got = anchors.tolist()
            assert got == sorted(set(got)) and len(got) == 10 and set(got) <= valid
            counts[weight] += sum(a in early for a in got)
    # uniform: 16 of 78 anchors are early (~2 of 10 per draw); weight 20 draws them ~ten times as often
    assert 300 < counts[1.0] < 520 and counts[20.0] > 3 * counts[1.0]
    # weight 1 is the uniform draw of earlier releases: the same RNG stream, the same anchors
    assert sample_anchors(mask, 10, random.Random(3), 8, 1.0).tolist() == sample_anchors(mask, 10, random.Random(3)).tolist()
    with pytest.raises(ValueError, match="early_anchor_weight"):
        BlockCollator(block_size=B, mask_token_id=0, early_anchor_weight=0.0)


# ---------------------------------------------------------------------------- losses
def test_slot_weights_and_gamma():
    assert default_gamma(16) == 7 and default_gamma(10) == 5 and default_gamma(8) == 4
    assert 5 < default_gamma(12) < 7 and default_gamma(2) >= 1
    w = slot_weights(16)
    assert w[0] == 0 and w[1] == 1 and math.isclose(float(w[15]), math.exp(-14 / 7), rel_tol=1e-6)


def test_loss_weighting_and_selector_metrics(target):
    drafter = _drafter(target)
    hidden = torch.randn(1, 2 * B, drafter.config.hidden_size, requires_grad=True)
    labels = torch.full((1, 2 * B), IGNORE_INDEX)
    labels[0, 1], labels[0, 3] = 5, 6
    preds = torch.zeros(1, 2 * B, dtype=torch.long)
    res = drafter_loss(drafter, hidden, labels, preds, target.lm_head, B, selector_weight=0.0)
    logits = drafter.compute_logits(hidden[0, [1, 3]], target.lm_head)
    ce = torch.nn.functional.cross_entropy(logits, torch.tensor([5, 6]), reduction="none")
    w = slot_weights(B)[[1, 3]]
    torch.testing.assert_close(res.loss, (w * ce).sum() / w.sum())
    res.loss.backward()
    assert hidden.grad[0, 0].abs().sum() == 0 and hidden.grad[0, 1].abs().sum() > 0
    s = summarize_stats(res.stats)
    assert {"acc_slot_1", "acc_slot_3", "acc_top1", "acc_selector", "tau_top1", "tau_selector"} <= set(s)
    # an untrained selector (zero successor codebook) picks the top-1 token
    assert s["acc_selector"] == s["acc_top1"]
    # nothing labelled: zero loss, still differentiable
    empty = drafter_loss(drafter, hidden, torch.full_like(labels, IGNORE_INDEX), preds, target.lm_head, B)
    assert float(empty.loss.detach()) == 0.0 and empty.loss.requires_grad


# ---------------------------------------------------------------------------- feature cache
def test_feature_cache_build_resume_and_stale(tmp_path, target):
    drafter = _drafter(target)
    recs = _records(5, seed=2)
    cache = FeatureCache(tmp_path, "tiny-llama", drafter.config.target_layer_ids)
    stats = cache.build(target, recs[:3], max_length=30, shard_records=2, progress=False)
    assert stats["computed"] == 3 and len(cache) == 3
    assert not [p for p in os.listdir(cache.dir) if p.endswith(".tmp")]
    ref = target_features(target, torch.tensor([recs[0]["input_ids"][: cache.length(0)]]),
                          drafter.config.target_layer_ids)[0]
    got = cache.get(0)
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape
    torch.testing.assert_close(got.float(), ref, rtol=1e-2, atol=1e-2)
    # resumable: only the new records are computed; a fresh object sees the shards on disk
    cache2 = FeatureCache(tmp_path, "tiny-llama", drafter.config.target_layer_ids)
    assert cache2.build(target, recs, max_length=30, progress=False)["computed"] == 2
    assert cache2.build(target, recs, max_length=30, progress=False)["computed"] == 0
    # a record whose tokens changed is recomputed, the newest shard wins
    changed = dict(recs[1], input_ids=[3] + recs[1]["input_ids"][1:])
    assert [r["record_id"] for r in cache2.missing([changed], 30)] == [1]
    cache2.build(target, [changed], max_length=30, progress=False)
    assert cache2.get_ids(1)[0] == 3
    meta = json.loads((cache2.dir / "meta.json").read_text())
    assert meta["compute_dtype"] == "float32" and meta["target"]["layer_ids"] == drafter.config.target_layer_ids
    with pytest.raises(ValueError, match="dtype"):
        cache2.build(target, _records(7, seed=9)[6:], compute_dtype=torch.bfloat16, progress=False)
    ds = FeatureDataset(recs, cache2, max_length=30)
    assert len(ds) == 4 and ds.skipped == 1  # record 1 changed on disk -> its features are stale for `recs`


def test_bf16_feature_build_leaves_the_fp32_target_exact(tmp_path):
    target = _target()  # its own copy: the build casts it
    tensors = lambda: dict([*target.named_parameters(), *target.named_buffers()])  # noqa: E731 (buffers: rotary)
    before = {k: v.detach().clone() for k, v in tensors().items()}
    assert any("inv_freq" in k for k in before)  # a non-persistent buffer: not in state_dict()
    ids = torch.tensor([_records(1, seed=5)[0]["input_ids"][:20]])
    with torch.no_grad():
        logits = target(ids).logits
    drafter = _drafter(target)
    cache = FeatureCache(tmp_path, "tiny-llama", drafter.config.target_layer_ids)
    assert cache.build(target, _records(2, seed=4), max_length=30, compute_dtype=torch.bfloat16,
                       progress=False)["computed"] == 2
    after = tensors()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())
    with torch.no_grad():
        assert torch.equal(target(ids).logits, logits)



def test_lm_head_on_keeps_a_head_already_there_and_copies_otherwise(target):
    from dflash2_hf.training.losses import lm_head_on

    head = target.get_output_embeddings()
    assert lm_head_on(head, head.weight.device) is head
    moved = lm_head_on(head, torch.device("meta"))  # stands in for another GPU
    assert moved is not head and moved.weight.device.type == "meta" and not moved.weight.requires_grad
    assert head.weight.device.type == "cpu"  # the target's own head stays where the target needs it


# ---------------------------------------------------------------------------- trainer
def _trainer(target, tmp_path, drafter, recs, cache_dir, **overrides):
    cache = FeatureCache(cache_dir, "tiny-llama", drafter.config.target_layer_ids)
    cache.build(target, recs, max_length=64, progress=False)
    ds = FeatureDataset(recs, cache)
    collator = BlockCollator(block_size=B, mask_token_id=drafter.config.mask_token_id, num_blocks=8, seed=0)
    kw = dict(max_steps=30, learning_rate=3e-3, logging_steps=1, save_steps=1000, per_device_train_batch_size=2,
              disable_tqdm=True, warmup_steps=0.0)
    kw.update(overrides)
    args = default_training_arguments(str(tmp_path), **kw)
    return DFlash2Trainer(model=drafter, args=args, target=target, train_dataset=ds, data_collator=collator)


def test_training_loss_decreases_and_frozen_parts_stay_frozen(tmp_path, target):
    drafter = _drafter(target)
    recs = _records(4, seed=3)
    emb_before = target.get_input_embeddings().weight.detach().clone()
    head_before = target.lm_head.weight.detach().clone()
    params_before = {k: v.detach().clone() for k, v in drafter.named_parameters()}
    trainer = _trainer(target, tmp_path / "run", drafter, recs, tmp_path / "feat")
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    ce = [h["ce_loss"] for h in trainer.state.log_history if "ce_loss" in h]
    assert len(losses) == 30 and len(ce) == 30

    def mean(x):
        return sum(x) / len(x)

    assert mean(ce[-5:]) < 0.65 * mean(ce[:5]), ce
    assert mean(losses[-5:]) < 0.8 * mean(losses[:5]), losses
    logged = [h for h in trainer.state.log_history if "acc_slot_1" in h]
    assert logged and "acc_selector" in logged[-1] and "tau_top1" in logged[-1]
    # frozen: target parts untouched, not optimised, not part of the model
    assert torch.equal(target.get_input_embeddings().weight, emb_before)
    assert torch.equal(target.lm_head.weight, head_before)
    opt_params = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert id(target.lm_head.weight) not in opt_params
    assert opt_params == {id(p) for p in drafter.parameters()}
    changed = {k for k, v in drafter.named_parameters() if not torch.equal(v, params_before[k])}
    for prefix in ("fc.", "hidden_norm.", "layers.0.self_attn.", "layers.1.mlp.", "layers.0.attention_conv.",
                   "norm.", "candidate_selector."):
        assert any(k.startswith(prefix) for k in changed), prefix


def test_resume_continues_step_count_and_checkpoints_hold_no_target(tmp_path, target):
    recs = _records(4, seed=4)
    out = tmp_path / "run"
    t1 = _trainer(target, out, _drafter(target), recs, tmp_path / "feat", max_steps=6, save_steps=3)
    t1.train()
    ckpt = out / "checkpoint-6"
    assert (out / "checkpoint-3").is_dir() and ckpt.is_dir()
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    drafter_keys = set(_drafter(target).state_dict())
    assert keys == {k for k in drafter_keys if not k.startswith("rotary_emb")}
    assert not any("embed" in k or "lm_head" in k for k in keys)
    reloaded = DFlash2DraftModel.from_pretrained(ckpt)
    torch.testing.assert_close(reloaded.fc.weight, t1.model.fc.weight)

    t2 = _trainer(target, out, _drafter(target, seed=7), recs, tmp_path / "feat", max_steps=9, save_steps=3)
    t2.train(resume_from_checkpoint=str(ckpt))
    assert t2.state.global_step == 9
    steps = [h["step"] for h in t2.state.log_history if "loss" in h]
    assert steps[:6] == list(range(1, 7)) and steps[6:] == [7, 8, 9]
    t2.save_model(str(out))
    final = DFlash2DraftModel.from_pretrained(out)
    torch.testing.assert_close(final.norm.weight, t2.model.norm.weight)


def test_initialize_from_target_copies_layers(target):
    from dflash2_hf.training.init import initialize_from_target, target_layer_choice

    drafter = _drafter(target)
    assert target_layer_choice(6, 2, "last") == [4, 5] and target_layer_choice(6, 3, "spread") == [0, 2, 5]
    used = initialize_from_target(drafter, target, layers="first", final_norm=True)
    assert used == [0, 1]
    torch.testing.assert_close(drafter.layers[1].mlp.up_proj.weight, target.model.layers[1].mlp.up_proj.weight)
    torch.testing.assert_close(drafter.norm.weight, target.model.norm.weight)
    with pytest.raises(ValueError):
        initialize_from_target(drafter, target, layers="middle")


def test_follow_data_adds_new_records(tmp_path, target):
    from dflash2_hf.training import FollowDataCallback

    drafter = _drafter(target)
    recs = _records(5, seed=6)
    cache = FeatureCache(tmp_path, "tiny-llama", drafter.config.target_layer_ids)
    cache.build(target, recs[:2], progress=False)
    ds = FeatureDataset(recs[:2], cache)
    visible = list(recs[:2])
    cb = FollowDataCallback(ds, cache, target, load_records=lambda: list(visible))
    assert cb.refresh() == 0
    visible.extend(recs[2:])
    assert cb.refresh() == 3 and len(ds) == 5 and len(cache) == 5
    assert ds[4]["context_hidden_states"].shape[0] == len(recs[4]["input_ids"])
    assert cb.refresh() == 0


def test_follow_data_picks_up_a_new_shard_of_the_data_folder(tmp_path, target):
    """--follow-data on a folder prepare-data is still writing: each refresh re-reads the folder's complete shards,
    so a shard written after the start is trained on; a shard being written (a temporary file) is not read."""
    import functools

    from dflash2_hf.data.hub_dataset import write_folder_meta
    from dflash2_hf.data.shards import ShardWriter
    from dflash2_hf.training import FollowDataCallback, load_training_records

    def shard_record(r):
        start = r["response_mask"].index(1)
        end = len(r["input_ids"])
        return {"record_id": r["record_id"], "input_ids": r["input_ids"], "num_response_tokens": end - start,
                "response_spans": [[start, end]]}

    drafter = _drafter(target)
    recs, folder = _records(5, seed=17), tmp_path / "data"
    writer = ShardWriter(folder, "train", shard_size=2)
    for r in recs[:2]:
        writer.add(shard_record(r))
    write_folder_meta(folder, {"target": {"name": "tiny", "vocab_size": VOCAB}, "source": {"dataset": "synthetic"}})
    (folder / "data" / ".train-00001.parquet.tmp1").write_bytes(b"PAR1 being written")
    load = functools.partial(load_training_records, folder)
    cache = FeatureCache(tmp_path / "feat", "tiny-llama", drafter.config.target_layer_ids)
    cache.build(target, load(), progress=False)
    ds = FeatureDataset(load(), cache)
    cb = FollowDataCallback(ds, cache, target, load_records=load)
    assert len(ds) == 2 and cb.refresh() == 0
    for r in recs[2:]:  # prepare-data completes its next shard (2 records) and holds the last one in memory
        writer.add(shard_record(r))
    assert cb.refresh() == 2 and len(ds) == 4 and [r["record_id"] for r in ds.records] == [0, 1, 2, 3]
    writer.close()
    assert cb.refresh() == 1 and len(ds) == 5


def test_follow_data_grows_a_concatenation_with_extra_data(tmp_path, target):
    """--follow-data next to --extra-data: records appended to the first part are drawn (indexable) afterwards."""
    from dflash2_hf.training import FollowDataCallback, GrowingConcatDataset

    drafter = _drafter(target)
    recs, extra = _records(4, seed=12), _records(2, seed=13)
    cache, extra_cache = (FeatureCache(tmp_path / d, "tiny-llama", drafter.config.target_layer_ids) for d in "ab")
    cache.build(target, recs[:1], progress=False)
    extra_cache.build(target, extra, progress=False)
    ds = FeatureDataset(recs[:1], cache)
    both = GrowingConcatDataset([ds, FeatureDataset(extra, extra_cache)])
    assert len(both) == 3
    cb = FollowDataCallback(ds, cache, target, load_records=lambda: list(recs))
    assert cb.refresh() == 3 and len(both) == 6
    assert [both[i]["record_id"] for i in range(6)] == [r["record_id"] for r in recs + extra]


def test_evaluate_is_deterministic_and_logged(tmp_path, target):
    recs = _records(4, seed=8)
    trainer = _trainer(target, tmp_path / "run", _drafter(target), recs, tmp_path / "feat", max_steps=2)
    trainer.eval_dataset = trainer.train_dataset
    m1 = trainer.evaluate()
    m2 = trainer.evaluate()
    assert m1 == m2 and m1["eval_sequences"] == 4
    assert {"eval_acc_slot_1", "eval_tau_top1", "eval_tau_selector", "eval_ce_loss"} <= set(m1)
    assert any("eval_tau_top1" in h for h in trainer.state.log_history)


def test_follow_data_replaces_regenerated_records(tmp_path, target):
    from dflash2_hf.training import FollowDataCallback

    drafter = _drafter(target)
    recs = _records(3, seed=10)
    cache = FeatureCache(tmp_path, "tiny-llama", drafter.config.target_layer_ids)
    cache.build(target, recs, progress=False)
    ds = FeatureDataset(recs, cache)
    regenerated = [dict(recs[0], input_ids=[4] + recs[0]["input_ids"][1:])] + recs[1:]
    cb = FollowDataCallback(ds, cache, target, load_records=lambda: regenerated)
    assert cb.refresh() == 1 and len(ds) == 3
    item = next(ds[i] for i in range(3) if ds.records[i]["record_id"] == 0)
    assert item["input_ids"][0] == 4 and cache.get_ids(0)[0] == 4


def test_follow_data_picks_up_features_another_process_cached(tmp_path, target):
    """A --features-only job on the other core fills the cache: the training run's refresh takes those features
    instead of computing them again, for an --extra-data part too (its records never change)."""
    from dflash2_hf.training import FollowDataCallback, GrowingConcatDataset

    drafter = _drafter(target)
    recs, extra = _records(3, seed=14), _records(4, seed=15)
    ids = drafter.config.target_layer_ids
    cache, extra_cache = (FeatureCache(tmp_path / d, "tiny-llama", ids) for d in "ab")
    cache.build(target, recs, progress=False)
    extra_cache.build(target, extra[:1], progress=False)
    ds, extra_ds = FeatureDataset(recs, cache), FeatureDataset(extra, extra_cache)
    both = GrowingConcatDataset([ds, extra_ds])
    assert len(both) == 4 and extra_ds.skipped == 3
    # time_budget_s=0 computes at most one record per refresh: the other process does the rest
    cb = FollowDataCallback(extra_ds, extra_cache, target, load_records=lambda: list(extra), time_budget_s=0)
    FeatureCache(tmp_path / "b", "tiny-llama", ids).build(target, extra[1:3], progress=False)  # "another process"
    assert cb.refresh() == 3 and len(both) == 7
    assert extra_cache.meta["builds"][-1]["records"] == 1  # only the one record nobody had cached
    assert [both[i]["record_id"] for i in range(7)] == [r["record_id"] for r in recs + extra]


def test_growing_random_sampler_draws_records_added_mid_epoch():
    """Each pass draws every index once, those appended while the pass runs included (RandomSampler fixes its
    permutation when the epoch starts)."""
    from dflash2_hf.training import GrowingRandomSampler

    data = list(range(4))
    sampler = GrowingRandomSampler(data, seed=3)
    it = iter(sampler)
    first = [next(it), next(it)]
    data.extend(range(4, 10))  # the dataset grows during the epoch
    drawn = first + [next(it), next(it)]
    assert len(set(drawn)) == 4 and next(it, None) is None  # the epoch keeps its start length
    drawn += list(sampler)  # 10 indices: the 6 of this pass left, then 4 of the next pass
    assert sorted(drawn[:10]) == list(range(10)) and len(drawn) == 14 and len(set(drawn[10:])) == 4
    again = GrowingRandomSampler(list(range(10)), seed=3)
    assert list(again) != list(range(10)) and sorted(again) == list(range(10))
    assert list(GrowingRandomSampler(list(range(10)), seed=5)) == list(GrowingRandomSampler(list(range(10)), seed=5))


def test_follow_data_records_are_trained_within_the_first_epoch(tmp_path, target):
    """max_steps shorter than the first epoch (the release runs): records that --follow-data adds after the start
    must still be drawn, not only those cached when training began."""
    from dflash2_hf.training import FollowDataCallback

    drafter = _drafter(target)
    recs = _records(10, seed=16)
    trainer = _trainer(target, tmp_path / "run", drafter, recs[:6], tmp_path / "feat", max_steps=6,
                       per_device_train_batch_size=1)
    ds = trainer.train_dataset
    trainer.add_callback(FollowDataCallback(ds, ds.cache, target, load_records=lambda: list(recs), every_steps=1))
    seen, collate = [], trainer.data_collator
    trainer.data_collator = lambda items: (seen.extend(i["record_id"] for i in items), collate(items))[1]
    trainer.train()
    new_ids = {r["record_id"] for r in recs[6:]}
    assert len(ds) == 10 and len(seen) == 6 and len(set(seen)) == 6  # without replacement
    assert new_ids & set(seen), f"only the records cached at the start were drawn: {seen}"
