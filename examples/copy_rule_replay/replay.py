"""Step 2 of the copy-rule replay: replays the decoding loop over collect.py's records under several copy rules and
prints tau, a modelled speedup over plain decoding and position-1 acceptance per data set.

    python examples/copy_rule_replay/replay.py runs/copysim/all.jsonl   # cat of collect.py's outputs

A cycle at sequence length L proposes the rule's tokens; the accepted ones are the common prefix with the greedy
answer; the cycle costs COST[n] (the target's forward over n tokens in decoding steps: the prepacked fp32 cost curve
of a 2-core AMD EPYC with AVX2, 2 threads, `python examples/cost_curve.py`) plus T_DRAFT where the drafter ran.
Copies are recomputed from each record's token sequence with the library's own search
(`dflash2_hf.generation.prompt_lookup`): the longest recurring suffix of at most `nmax` tokens, the tokens that
followed its most recent occurrence. Rules: "agree" = copy where the drafter's first draft equals the 1-gram copy's
first token; "match>=K" = copy without a drafter pass where a suffix of K or more tokens recurs (up to M tokens, or
M2 where exactly K match); "adaptive" = also copy while the last copy was accepted.
"""
import json
import sys

import torch

from dflash2_hf.generation.prompt_lookup import continuation, longest_recurring_suffix

COST = {1: 1.0, 2: 1.10, 3: 1.22, 4: 1.34, 6: 1.40, 8: 1.43, 12: 1.68, 16: 1.76}
T_DRAFT = 0.25


def cost(n):
    if n in COST:
        return COST[n]
    ks = sorted(COST)
    lo = max(x for x in ks if x < n)
    hi = min((x for x in ks if x > n), default=None)
    if hi is None:
        return COST[lo] + (n - lo) * 0.03
    return COST[lo] + (COST[hi] - COST[lo]) * (n - lo) / (hi - lo)


def copy_of(seq, cur, nmax, nmin, m):
    """(n, the copy of up to m tokens) after seq[:cur], from its longest recurring suffix of nmin..nmax tokens."""
    n, start = longest_recurring_suffix(seq[:, :cur], nmax, nmin)
    return n, (continuation(seq[:, :cur], start, m).tolist() if n else [])


def rule_factory(M=15, K=None, M2=None, nmax=3, skip=True, agree=True, adaptive=False):
    nmax = max(nmax, K or 1)

    def rule(seq, cur, path, st):
        st["copied"] = False
        if K is not None or adaptive:
            n, copy = copy_of(seq, cur, nmax, K if K is not None else 1, M)
            if n and (K is not None or st["last_copy_ok"]):
                st["copied"] = True
                return (copy[:M2] if M2 and n == K else copy), not skip
        if agree:
            _, copy = copy_of(seq, cur, 1, 1, M)
            if len(copy) >= 2 and copy[0] == path[0]:
                st["copied"] = True
                return copy, True
        return path, True
    return rule


def lookup_only(seq, cur, path, st):
    st["copied"] = False
    return copy_of(seq, cur, 3, 1, 10)[1], False


def run(rec, rule):
    seq, lp = torch.tensor([rec["seq"]]), rec["prompt_len"]
    end = seq.shape[1]
    cur = lp + 1
    tokens = cycles = time = first = proposed = 0
    state = {"last_copy_ok": None}
    while cur < end:
        prop, drafted = rule(seq, cur, rec["paths"][cur - lp], state)
        prop = prop[:end - cur]
        acc = 0
        while acc < len(prop) and prop[acc] == rec["seq"][cur + acc]:
            acc += 1
        if state.get("copied"):
            state["last_copy_ok"] = acc >= min(len(prop), 4)
        first += acc >= 1 and bool(prop)
        proposed += bool(prop)
        cur += acc + 1
        tokens += acc + 1
        cycles += 1
        time += cost(len(prop) + 1) + (T_DRAFT if drafted else 0)
    return tokens, cycles, time, first, proposed


RULES = {
    "drafter only": rule_factory(agree=False, skip=False, M=7),
    "prompt lookup (10)": lookup_only,
    "agree, 7": rule_factory(M=7),
    "agree, 15": rule_factory(M=15),
    "agree|lastcopyok, 10": rule_factory(M=10, adaptive=True),
}
for K in (2, 3, 4):
    for M in (7, 15):
        RULES[f"agree|match>={K}, {M}, drafting"] = rule_factory(M=M, K=K, skip=False)
        RULES[f"agree|match>={K}, {M}, skip"] = rule_factory(M=M, K=K)
for nmax in (3, 8):
    for M2 in (None, 5, 7, 10):
        RULES[f"agree|match>=2, 15 (M2 {M2}), skip, nmax {nmax}"] = rule_factory(M=15, K=2, M2=M2, nmax=nmax)

if __name__ == "__main__":
    recs = [json.loads(line) for line in open(sys.argv[1])]
    for ds in sorted({r["dataset"] for r in recs}) + ["all"]:
        sub = [r for r in recs if ds in ("all", r["dataset"])]
        print(f"\n{ds}: {len(sub)} prompts")
        for name, rule in RULES.items():
            t = c = ti = f = p = 0
            for r in sub:
                out = run(r, rule)
                t, c, ti, f, p = t + out[0], c + out[1], ti + out[2], f + out[3], p + out[4]
            print(f"  {name:48s} tau {t / c:5.3f}  modelled speedup {t / ti:5.3f}  position 1 {f / p:5.3f}", flush=True)
