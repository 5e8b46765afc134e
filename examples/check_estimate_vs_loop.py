"""Does the trainer's teacher-forced tau estimate match what the decoding loop accepts? (a train/serve check)

For regenerated held-out records (the target's own greedy answers, so `generate()` reproduces them token for token)
this runs, per record:

1. the real loop: `target.generate(prompt, assistant_model=drafter, max_new_tokens=N)` -> tau and the anchors it
   used (one per verification cycle);
2. teacher forcing through the inference path: for EVERY response position a as anchor, a fresh drafter call with
   the target's hidden states of [0, a) -> the accepted run against the true continuation;
3. the same runs restricted to the loop's own anchors (2 vs 3 shows whether anchors after a rejection are harder);
4. the trainer's estimator (`BlockCollator` + `drafter_loss`, 64 random blocks per record, as `evaluate_blocks`).

If 1, 2, 3 agree and 4 agrees on the same positions, training and serving compute the same thing and any gap
between the trainer's logged `eval_tau_*` and `dflash2 bench` comes from which records / positions are averaged.

    python examples/check_estimate_vs_loop.py --drafter model_cards/dflash2-smollm2-135m-instruct \
        --data runs/dev-data/smollm2-sharegpt-dev-16000-16200 --records 5
"""

from __future__ import annotations

import argparse

import torch

import dflash2_hf  # noqa: F401  (installs the generate() routing)
from dflash2_hf import DFlash2DraftModel, GenerationStats
from dflash2_hf.data import load_prepared, response_mask
from dflash2_hf.generation.candidate_generator import DFlash2CandidateGenerator
from dflash2_hf.targets import load_target
from dflash2_hf.training import BlockCollator
from dflash2_hf.training.target_features import target_features
from dflash2_hf.training.losses import accumulate_stats, drafter_loss, summarize_stats


def accepted_run(proposal: list[int], truth: list[int]) -> int:
    k = 0
    while k < min(len(proposal), len(truth)) and proposal[k] == truth[k]:
        k += 1
    return k


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--data", required=True, help="a prepare-data folder of HELD-OUT records")
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--records", type=int, default=5, help="first N records with a long enough response")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--num-threads", "--threads", dest="threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target, _ = load_target(args.target)
    drafter = DFlash2DraftModel.from_pretrained(args.drafter).float().eval()
    B, N = drafter.config.block_size, args.max_new_tokens
    recs = sorted(load_prepared(args.data), key=lambda r: r["record_id"])
    recs = [r for r in recs if r["response_spans"][0][1] - r["response_spans"][0][0] >= N + B][: args.records]
    emb, head = target.get_input_embeddings().weight, target.get_output_embeddings()
    loop_stats, all_runs, anchor_runs, trainer_total = [], [], [], None
    for r in recs:
        s, _ = r["response_spans"][0]
        ids = torch.tensor(r["input_ids"])[None]
        out = target.generate(ids[:, :s], assistant_model=drafter, max_new_tokens=N, do_sample=False)
        reproduced = out[0, s:].tolist() == r["input_ids"][s:s + N]
        st = drafter.generation_stats
        loop_stats.append(st)
        anchors = [s]
        for length in st.acceptance_lengths[:-1]:
            anchors.append(anchors[-1] + length)
        with torch.no_grad():
            hidden = target(ids[:, :s + N + B], output_hidden_states=True).hidden_states
        runs = {}
        for a in range(s, s + N - B):
            gen = DFlash2CandidateGenerator(drafter, target, False, 1.0, True, GenerationStats(block_size=B))
            gen.add_context(hidden, a)
            runs[a] = accepted_run(gen.propose(ids[:, :a + 1], B - 1).tokens[0].tolist(),
                                   r["input_ids"][a + 1:a + B])
        all_runs += runs.values()
        anchor_runs += [runs[a] for a in anchors if a in runs]
        # the trainer's estimator on the same response window
        mask = torch.tensor(response_mask(r)).bool()
        mask[s + N:] = False
        window = ids[0, :s + N + B]
        with torch.no_grad():
            feats = target_features(target, window[None], drafter.config.target_layer_ids)[0]
            batch = BlockCollator(block_size=B, mask_token_id=drafter.config.mask_token_id, num_blocks=64,
                                  seed=1234)([{"input_ids": window, "response_mask": mask[:window.shape[0]],
                                               "context_hidden_states": feats}])
            h = drafter(noise_embeds=drafter.embed_block(batch["block_input_ids"], emb),
                        context_hidden_states=batch["context_hidden_states"], position_ids=batch["position_ids"],
                        attention_mask=batch["attention_mask"]).last_hidden_state
            trainer_total = accumulate_stats(trainer_total, drafter_loss(
                drafter, h, batch["labels"], batch["predecessor_ids"], head, B).stats)
        print(f"record {r['record_id']}: loop reproduces the record: {reproduced}; loop tau {st.tau:.3f}; "
              f"teacher-forced at every position {1 + sum(runs.values()) / len(runs):.3f}", flush=True)
    pooled = GenerationStats.merge(loop_stats)
    est = summarize_stats(trainer_total)
    print(f"\n{len(recs)} records, first {N} response tokens:")
    print(f"  real loop tau                              {pooled.tau:.3f}")
    print(f"  teacher-forced, every position             {1 + sum(all_runs) / len(all_runs):.3f} (n={len(all_runs)})")
    print(f"  teacher-forced, the loop's anchors only    {1 + sum(anchor_runs) / len(anchor_runs):.3f} "
          f"(n={len(anchor_runs)})")
    print(f"  trainer estimator (64 random blocks/rec)   {est['tau_selector']:.3f} (top-1 path {est['tau_top1']:.3f})")


if __name__ == "__main__":
    main()
