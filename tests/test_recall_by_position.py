"""Teacher-forced recall by block position (dflash2_hf.analysis.recall): constructed cases with known answers, and
the batched block pass against the serving loop's own drafting on a tiny random target."""

from __future__ import annotations

import torch
from conftest import make_drafter, make_target, randomize_convs, randomize_selector

from dflash2_hf import GenerationStats
from dflash2_hf.analysis.recall import RecallByPosition, block_metrics, full_blocks, recall_by_position
from dflash2_hf.generation.candidate_generator import DFlash2CandidateGenerator

V, P, K = 96, 5, 8


def constructed(ranks):
    """Logits ``(1, P, V)`` where the label of slot t sits at rank ``ranks[t]`` (0 = top-1, K or more = outside the
    top-K), labels ``(1, P)`` and the anchor."""
    labels = torch.tensor([[10, 11, 12, 13, 14]])
    logits = torch.zeros(1, P, V)
    for t, r in enumerate(ranks):
        # decoys 40.. at descending scores 100, 99, ...; the label takes rank r among them
        logits[0, t, 40 : 40 + V - 40] = 100.0 - torch.arange(V - 40, dtype=torch.float)
        logits[0, t, labels[0, t]] = 100.0 - r + 0.5 if r else 101.0
    return logits, labels, torch.tensor([9])


class BonusSelector:
    """Pair scores = the unary logits, plus a bonus for ``(predecessor, successor)`` pairs in ``bonus`` at slot t."""

    def __init__(self, bonus):
        self.bonus = bonus  # {(slot index, predecessor id, successor id): bonus}

    def pair_scores(self, hidden, predecessor_ids, candidate_ids, candidate_logits):
        s = candidate_logits.unsqueeze(-2).expand(*predecessor_ids.shape, candidate_ids.shape[-1]).clone()
        for (t, a, b), v in self.bonus.items():
            s[:, t] += v * ((predecessor_ids[:, t, :, None] == a) & (candidate_ids[:, t, None, :] == b))
        return s


def rows(hits):
    return {k: v[0].int().tolist() for k, v in hits.items() if k != "selector_path"}


def test_constructed_recall_and_paths():
    hidden = torch.zeros(1, P, 4)
    # slot 1 top-1; slot 2 second; slot 3 outside the top-8; slots 4-5 top-1
    logits, labels, anchor = constructed([0, 1, K + 3, 0, 0])
    got = rows(block_metrics(logits, hidden, labels, anchor, BonusSelector({}), K))
    assert got == {
        "recall1": [1, 0, 0, 1, 1],
        "recallk": [1, 1, 0, 1, 1],
        "selector_tf": [1, 0, 0, 1, 1],  # no bonus: the selector is the top-1
        "path_top1": [1, 0, 0, 0, 0],
        "path_selector": [1, 0, 0, 0, 0],
        "path_perfect": [1, 1, 0, 0, 0],
    }
    # a selector that lifts the true slot-2 token after the true slot-1 token: right at slot 2 where top-1 is not
    sel = BonusSelector({(1, 10, 11): 5.0})
    got = rows(block_metrics(logits, hidden, labels, anchor, sel, K))
    assert got["selector_tf"] == [1, 1, 0, 1, 1]
    assert got["path_selector"] == [1, 1, 0, 0, 0]
    assert got["path_top1"] == [1, 0, 0, 0, 0]

    # slot 1 wrong for both paths, slot 2 lifted after the TRUE slot-1 token only: the teacher-forced row counts
    # slot 2, the selector's own path (which took the decoy at slot 1) does not
    logits, labels, anchor = constructed([1, 1, 0, 0, 0])
    got = rows(block_metrics(logits, hidden, labels, anchor, BonusSelector({(1, 10, 11): 5.0}), K))
    assert got["selector_tf"] == [0, 1, 1, 1, 1]
    assert got["path_selector"] == [0, 0, 0, 0, 0]
    assert got["path_perfect"] == [1, 1, 1, 1, 1]

    stats = RecallByPosition(slots=P, top_k=K)
    stats.add(block_metrics(logits, hidden, labels, anchor, None, K))
    stats.add(block_metrics(constructed([0, 0, 0, 1, 0])[0], hidden, labels, anchor, None, K))
    assert stats.blocks == 2
    assert stats.rates()["recall1"] == [0.5, 0.5, 1.0, 0.5, 1.0]
    assert stats.tau()["path_top1"] == 1.0 + (0 + 3) / 2  # runs of 0 and 3 slots
    assert stats.tau()["path_perfect"] == 1.0 + P
    table = stats.markdown()
    assert "| Recall@8 |" in table and "| path correct so far: top-1 path |" in table


def test_batched_blocks_match_the_serving_drafter():
    torch.manual_seed(0)
    target = make_target("llama")
    drafter = randomize_convs(randomize_selector(make_drafter(target)))
    B = drafter.config.block_size
    records = []
    for seed in range(2):
        g = torch.Generator().manual_seed(seed)
        prompt = torch.randint(6, V, (1, 12), generator=g)
        with torch.no_grad():
            ids = target.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None)[0]
        records.append({"input_ids": ids.tolist(), "response_mask": [0] * 12 + [1] * (ids.numel() - 12)})
    stats = recall_by_position(drafter, target, records, blocks_per_pass=7)
    assert stats.records == 2 and stats.agree == stats.checked > 0  # the records are the target's greedy text

    # the same blocks, one serving call per anchor (context [0, a), the candidate generator's path)
    counts = {name: [0] * (B - 1) for name in ("path_top1", "path_selector")}
    blocks = 0
    for rec in records:
        ids = torch.tensor(rec["input_ids"])
        mask = torch.tensor(rec["response_mask"]).bool()
        with torch.no_grad():
            hidden_states = target(ids[None], output_hidden_states=True).hidden_states
        anchors, labels, _ = full_blocks(ids, mask, torch.cat([ids[1:], ids[-1:]]), B)  # labels: the record
        for a, lab in zip(anchors.tolist(), labels[:, 1:]):
            blocks += 1
            for name, use_selector in (("path_top1", False), ("path_selector", True)):
                gen = DFlash2CandidateGenerator(drafter, target, False, 1.0, use_selector,
                                                GenerationStats(block_size=B))
                gen.add_context(hidden_states, a)
                toks = gen.propose(ids[None, : a + 1], B - 1).tokens[0]
                ok = torch.cumprod((toks == lab).long(), 0).tolist()
                counts[name] = [c + o for c, o in zip(counts[name], ok)]
    assert stats.blocks == blocks == 2 * (24 - B + 1)
    assert stats.counts["path_top1"] == counts["path_top1"]
    assert stats.counts["path_selector"] == counts["path_selector"]
    assert stats.counts["path_selector"] != stats.counts["path_top1"] or stats.counts["path_top1"][0] == 0
