"""Does a smarter walk through the selector's scores accept more? Greedy walk vs the expected-length-optimal path.

The serving loop walks the candidate selector's pair scores greedily (DESIGN.md section 3: from the anchor, at each
position the best successor of the previous pick). Treating ``q_t(a, .) = softmax(S_t(a, .) / T)`` as the chance
that each candidate is right given its predecessor, the path with the highest expected acceptance length is found
exactly by a backward pass over the 7 positions (``V_t(a) = max_b q_t(a, b) (1 + V_{t+1}(b))``; 16 x 16 per
position). This script scores both walks teacher-forced on the same blocks (the labels are the target's greedy
tokens, as in :mod:`dflash2_hf.analysis.recall`) and prints the implied tau (1 + the mean length of the correct
prefix, full blocks) and the per-slot rate of "path correct so far"::

    OMP_NUM_THREADS=1 .venv/bin/python examples/selector_path_search.py \\
        --data dataset_cards/smollm2-135m-instruct-sharegpt-regenerated --records 15

Only the drafts change, never the output (verification decides): this is a question of acceptance alone.
"""

from __future__ import annotations

import argparse
import time

import torch

from dflash2_hf import DFlash2DraftModel
from dflash2_hf.analysis.recall import drafter_block_hidden, full_blocks
from dflash2_hf.generation.candidate_generator import draft_lm_head
from dflash2_hf.targets import load_target
from dflash2_hf.training import load_training_records
from dflash2_hf.training.target_features import target_features


def greedy_walk(scores: torch.Tensor) -> torch.LongTensor:
    """``(N, P)`` candidate indices of the greedy walk through ``scores`` ``(N, P, k, k)`` (row 0 of slot 1: anchor)."""
    best = scores.argmax(-1)
    idx = best[:, 0, 0]
    picks = [idx]
    for t in range(1, scores.shape[1]):
        idx = best[:, t].gather(-1, idx[:, None]).squeeze(-1)
        picks.append(idx)
    return torch.stack(picks, 1)


def expected_length_walk(scores: torch.Tensor, temperature: float) -> torch.LongTensor:
    """``(N, P)`` candidate indices of the path maximising the expected acceptance length under
    ``softmax(scores / temperature)`` read as per-step acceptance probabilities (a first-order chain)."""
    q = torch.softmax(scores / temperature, -1)
    n, p, k, _ = scores.shape
    value = scores.new_zeros(n, k)
    choice = [None] * p
    for t in range(p - 1, -1, -1):
        value, choice[t] = (q[:, t] * (1 + value)[:, None, :]).max(-1)  # per predecessor
    idx = choice[0][:, 0]
    picks = [idx]
    for t in range(1, p):
        idx = choice[t].gather(-1, idx[:, None]).squeeze(-1)
        picks.append(idx)
    return torch.stack(picks, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default="model_cards/dflash2-smollm2-135m-instruct")
    parser.add_argument("--data", required=True, help="a regenerated dataset folder; its dev split is read")
    parser.add_argument("--records", type=int, default=15)
    parser.add_argument("--temperatures", default="0.5,1,2", help="temperatures of the expected-length walk")
    parser.add_argument("--num-threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)

    target, _ = load_target("smollm2", dtype=torch.float32)
    drafter = DFlash2DraftModel.from_pretrained(args.drafter, dtype=torch.float32).eval()
    cfg = drafter.config
    k = cfg.selector_top_k
    emb = target.get_input_embeddings().weight
    head = draft_lm_head(target.get_output_embeddings(), drafter)
    vocab = getattr(drafter, "draft_vocab_ids", None)
    temps = [float(t) for t in args.temperatures.split(",")]
    totals: dict[str, torch.Tensor] = {}
    blocks = 0
    t0 = time.time()
    for rec in load_training_records(args.data, max_records=args.records, train_only=False):
        ids = torch.as_tensor(rec["input_ids"], dtype=torch.long)[:1024]
        mask = torch.as_tensor(rec["response_mask"]).bool()[: ids.numel()]
        with torch.no_grad():
            feats, nxt = target_features(target, ids[None], cfg.target_layer_ids, with_next=True)
        anchors, labels, _ = full_blocks(ids, mask, nxt[0], cfg.block_size)
        for s in range(0, anchors.numel(), 64):
            a, lab = anchors[s : s + 64], labels[s : s + 64, 1:]
            with torch.no_grad():
                hidden = drafter_block_hidden(drafter, feats[0], ids, a, emb)[:, 1:]
                top_vals, top_idx = drafter.compute_logits(hidden, head).float().topk(k, -1)
                cand = top_idx if vocab is None else vocab[top_idx]
                preds = torch.cat([ids[a][:, None, None].expand(-1, 1, k), cand[:, :-1]], 1)
                scores = drafter.candidate_selector.pair_scores(hidden, preds, cand, top_vals).float()
            walks = {"top-1 path": torch.zeros_like(cand[..., 0]), "selector, greedy walk": greedy_walk(scores)}
            for t in temps:
                walks[f"selector, expected-length walk T={t:g}"] = expected_length_walk(scores, t)
            for name, picks in walks.items():
                right = cand.gather(-1, picks[..., None]).squeeze(-1) == lab
                totals[name] = totals.get(name, 0) + torch.cumprod(right.long(), 1).sum(0)
            blocks += a.numel()
    print(f"{args.data}: {args.records} dev records, {blocks} full blocks, {time.time() - t0:.0f} s\n")
    print("| walk | tau | " + " | ".join(f"slot {t}" for t in range(1, cfg.block_size)) + " |")
    print("|---|---:|" + "---:|" * (cfg.block_size - 1))
    for name, tot in totals.items():
        rates = (tot.float() / blocks).tolist()
        print(f"| {name} | {1 + sum(rates):.3f} | " + " | ".join(f"{r:.3f}" for r in rates) + " |")


if __name__ == "__main__":
    main()
