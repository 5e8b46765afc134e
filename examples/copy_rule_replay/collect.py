"""Step 1 of the copy-rule replay: for every position of each prompt's plain greedy answer, the drafter's selector
path and confidences (teacher-forced: the target's features of that answer, the serving block mask), the n-gram
continuation, and the longest recurring suffix. One JSON line per prompt; replay.py then scores rules on them.

    OMP_NUM_THREADS=1 .venv/bin/python examples/copy_rule_replay/collect.py runs/copysim/chat.jsonl \
        runs/copysim/sharegpt-16200.jsonl 60      # prompts: examples/make_heldout_prompts.py --start 16200
    OMP_NUM_THREADS=1 .venv/bin/python examples/copy_rule_replay/collect.py runs/copysim/code.jsonl \
        runs/heldout/validation-code.jsonl 40

Arguments: output JSONL, comma-separated bench data sets (``dflash2 bench --datasets``), prompts per set, and
optionally the drafter (default: the shipped one). fp32 target
and drafter, greedy, 96 new tokens, one thread (~10 s per prompt on a 2-core AMD EPYC).
"""
import sys, json, time, torch
from transformers import AutoTokenizer
from dflash2_hf import DFlash2DraftModel
from dflash2_hf.analysis.recall import drafter_block_hidden
from dflash2_hf.bench.prompts import load_bench_prompts
from dflash2_hf.generation.candidate_generator import draft_lm_head
from dflash2_hf.generation.prompt_lookup import ngram_continuation
from dflash2_hf.targets import load_target
from dflash2_hf.training.target_features import target_features
torch.set_num_threads(1)
out_path, datasets, n = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3])
drafter_path = sys.argv[4] if len(sys.argv) > 4 else "model_cards/dflash2-smollm2-135m-instruct"
target, tok = load_target("smollm2", dtype=torch.float32)
d = DFlash2DraftModel.from_pretrained(drafter_path, dtype=torch.float32).eval()
cfg = d.config; k = 16; sel = d.candidate_selector
emb = target.get_input_embeddings().weight
head = draft_lm_head(target.get_output_embeddings(), d)
vocab = d.draft_vocab_ids
prompts, skipped = load_bench_prompts(datasets, tok, n, max_prompt_tokens=1024)
print({k_: len(v) for k_, v in prompts.items()}, skipped, file=sys.stderr)
t0 = time.time()
with open(out_path, "w") as f:
    for name, plist in prompts.items():
        for p in plist:
            ids = torch.tensor([p.input_ids if hasattr(p, "input_ids") else p.tokens])
            with torch.no_grad():
                gen = target.generate(ids, max_new_tokens=96, do_sample=False, attention_mask=torch.ones_like(ids))
            s = gen[0]; Lp = ids.shape[1]
            with torch.no_grad():
                feats, nxt = target_features(target, s[None], cfg.target_layer_ids, with_next=True)
                anchors = torch.arange(Lp - 1, s.numel() - 1)
                paths, confs = [], []
                for st in range(0, anchors.numel(), 32):
                    a = anchors[st:st + 32]
                    hidden = drafter_block_hidden(d, feats[0], s, a, emb)[:, 1:]
                    tv, ti = d.compute_logits(hidden, head).float().topk(k, -1)
                    cand = vocab[ti]
                    preds = torch.cat([s[a][:, None, None].expand(-1, 1, k), cand[:, :-1]], 1)
                    S = sel.pair_scores(hidden, preds, cand, tv).float()
                    best = S.argmax(-1); idx = best[:, 0, 0]; picks = [idx]
                    for t in range(1, S.shape[1]):
                        idx = best[:, t].gather(-1, idx[:, None]).squeeze(-1); picks.append(idx)
                    pk = torch.stack(picks, 1)
                    prev = torch.cat([torch.zeros_like(pk[:, :1]), pk[:, :-1]], 1)
                    rows = torch.softmax(S.gather(2, prev[:, :, None, None].expand(-1, -1, 1, k)).squeeze(2), -1)
                    paths += cand.gather(-1, pk[..., None]).squeeze(-1).tolist()
                    confs += rows.gather(-1, pk[..., None]).squeeze(-1).tolist()
            copies, matchlen = [], []
            for i, a in enumerate(anchors.tolist()):
                pre = s[: a + 1][None]
                copies.append(ngram_continuation(pre, 3, 16).tolist())
                # longest suffix of pre that occurs earlier (up to 64)
                m = 0
                ids0 = pre[0]
                for L in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32):
                    if L >= ids0.numel(): break
                    w = ids0.unfold(0, L, 1)[:-1]
                    if (w == ids0[-L:]).all(1).any(): m = L
                    else: break
                matchlen.append(m)
            f.write(json.dumps({"dataset": name, "id": p.prompt_id if hasattr(p, "prompt_id") else None, "prompt_len": Lp,
                                "seq": s.tolist(), "eos": int(s[-1]) == tok.eos_token_id, "paths": paths, "confs": confs,
                                "copies": copies, "matchlen": matchlen}) + "\n")
            f.flush()
            print(name, Lp, s.numel() - Lp, f"{time.time() - t0:.0f}s", file=sys.stderr, flush=True)
