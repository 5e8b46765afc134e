"""Training on the target's own greedy labels (FeatureCache with_next, collator target labels, original answers)."""

from __future__ import annotations

import torch

from dflash2_hf.training import IGNORE_INDEX, BlockCollator, FeatureCache, FeatureDataset
from dflash2_hf.training.collator import block_labels
from test_training import _drafter, _records, _target

torch.set_num_threads(1)


def test_block_labels_follow_the_target_until_the_text_disagrees():
    ids = torch.tensor([10, 11, 12, 13, 14, 15, 16, 17])
    nxt = torch.tensor([11, 12, 99, 14, 15, 15, 17, 0])  # the target agrees with the text except at 2->3, 5->6
    resp = torch.ones(8, dtype=torch.bool)
    labels, preds = block_labels(ids, resp, torch.tensor([0, 3]), 4, target_next=nxt)
    # anchor 0: slot1 = next[0] = 11 (= x1), slot2 = next[1] = 12 (= x2), slot3 = next[2] = 99 (x2 agreed: trained)
    assert labels[0].tolist() == [IGNORE_INDEX, 11, 12, 99]
    # anchor 3: slot1 = next[3] = 14, slot2 = next[4] = 15, slot3 needs x5 == next[4]: 15 == 15 -> next[5] = 15
    assert labels[1].tolist() == [IGNORE_INDEX, 14, 15, 15]
    assert preds[1].tolist() == [0, 13, 14, 15]
    labels, _ = block_labels(ids, resp, torch.tensor([1]), 4, target_next=nxt)
    # anchor 1: slot1 = next[1] = 12, slot2 = next[2] = 99, slot3 needs x3 == next[2]: 13 != 99 -> not trained
    assert labels[0].tolist() == [IGNORE_INDEX, 12, 99, IGNORE_INDEX]
    # the target writing the text itself (next == the following token): the plain labels again
    plain, _ = block_labels(ids, resp, torch.tensor([0, 2]), 4)
    same, _ = block_labels(ids, resp, torch.tensor([0, 2]), 4, target_next=torch.cat([ids[1:], ids[:1]]))
    assert torch.equal(plain, same)


def test_feature_cache_stores_the_targets_greedy_tokens(tmp_path):
    target = _target()
    drafter = _drafter(target)
    recs = _records(3, seed=4)
    cache = FeatureCache(tmp_path, "tiny", drafter.config.target_layer_ids, with_next=True)
    assert cache.dir.name.endswith("__next")
    cache.build(target, recs, max_length=30, progress=False)
    for r in recs:
        L = cache.length(r["record_id"])
        ref = target(torch.tensor([r["input_ids"][:L]])).logits[0].argmax(-1)
        assert torch.equal(cache.get_next(r["record_id"]), ref)
    items = [FeatureDataset(recs, cache, max_length=30)[i] for i in range(3)]
    batch = BlockCollator(block_size=4, mask_token_id=0, num_blocks=4)(items)
    lab = batch["labels"][batch["labels"] != IGNORE_INDEX]
    assert lab.numel() > 0
    allowed = set(torch.cat([it["target_next"] for it in items]).tolist())
    assert set(lab.tolist()) <= allowed  # every label is one of the target's own choices


def test_original_answer_records_keep_each_answer_as_a_span():
    from dflash2_hf.data.original import original_record
    from test_data import _tiny_tokenizer

    tok = _tiny_tokenizer()
    rec = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there"},
                             {"from": "human", "value": "and?"}, {"from": "gpt", "value": "bye"}]}
    out = original_record(tok, rec, stop_ids=[2], max_tokens=1000)
    assert out["num_turns"] == 2
    texts = [tok.decode(out["input_ids"][s:e]) for s, e in out["response_spans"]]
    assert texts == ["hello there<|im_end|>", "bye<|im_end|>"]
    cut = original_record(tok, rec, stop_ids=[2], max_tokens=out["response_spans"][0][0] + 4)
    assert cut["truncated"] and cut["num_turns"] == 1 and len(cut["input_ids"]) == out["response_spans"][0][0] + 4


def test_cli_original_answers_and_target_labels_train_with_extra_data(tmp_path, monkeypatch):
    """prepare-data --original-answers + a regenerated folder, trained together with train --target-labels."""
    import json

    from dflash2_hf.cli import main
    from test_data import _good_records, _tiny_llama, _tiny_tokenizer, _write_array

    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path / "cache"))
    tok = _tiny_tokenizer()
    target = _tiny_llama(len(tok))
    target.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    t, src = str(tmp_path / "target"), str(_write_array(tmp_path / "sg.json", _good_records(8)))
    assert main(["prepare-data", "--target", t, "--source", src, "--output-dir", str(tmp_path / "orig"), "--stop", "8",
                 "--original-answers", "--max-prompt-tokens", "400"]) == 0
    meta = json.loads((tmp_path / "orig" / "dflash2_dataset.json").read_text())
    assert meta["provenance"]["generation"]["original_answers"] and meta["counts"]["kept"] == 8
    assert main(["prepare-data", "--target", t, "--source", src, "--output-dir", str(tmp_path / "regen"), "--stop", "4",
                 "--max-new-tokens", "6", "--no-progress"]) == 0
    out = tmp_path / "run"
    assert main(["train", "--target", t, "--data", str(tmp_path / "orig"), "--extra-data", str(tmp_path / "regen"),
                 "--target-labels", "--output-dir", str(out), "--num-layers", "1", "--block-size", "4",
                 "--target-layer-ids", "0,1",
                 "--num-blocks", "4", "--max-steps", "3", "--save-steps", "100", "--disable-tqdm", "true"]) == 0
    caches = json.loads((out / "training_summary.json").read_text())["feature_cache"]
    assert len(caches) == 2 and all(c.endswith("__next") for c in caches)


def test_loss_over_the_draft_vocabulary_matches_the_restricted_softmax():
    """With a draft vocabulary the block CE is the softmax over its rows only; labels outside it train nothing."""
    import torch.nn.functional as F

    from dflash2_hf.training import drafter_loss, slot_weights

    target = _target()
    drafter = _drafter(target)
    vocab = torch.arange(3, 128, 2)  # odd ids only
    drafter.set_draft_vocab(vocab)
    torch.manual_seed(0)
    hidden = torch.randn(1, 8, drafter.config.hidden_size)
    labels = torch.tensor([[IGNORE_INDEX, 5, 7, 4, IGNORE_INDEX, 9, 11, 13]])  # 4 is outside the draft vocabulary
    preds = torch.tensor([[0, 1, 5, 7, 0, 3, 9, 11]])
    out = drafter_loss(drafter, hidden, labels, preds, target.get_output_embeddings(), 4, selector_weight=0.0)
    logits = drafter.compute_logits(hidden[0], target.get_output_embeddings())[:, vocab]
    w = slot_weights(4).repeat(2)
    w[3] = 0.0  # slot 3 of block 0: label 4 is outside the draft vocabulary
    idx = {int(t): i for i, t in enumerate(vocab)}
    y = torch.tensor([idx.get(int(t), 0) for t in labels[0]])
    ce = F.cross_entropy(logits, y, reduction="none")
    torch.testing.assert_close(out.ce_loss, (w * ce).sum() / w.sum())
    assert out.stats["labels"] == 6 and out.stats["top1_correct"] <= 5  # the outside label is always a miss
