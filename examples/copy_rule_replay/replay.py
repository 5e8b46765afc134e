"""Step 2 of the copy-rule replay: replays the decoding loop over collect.py's records under several copy rules and
prints tau and a modelled speedup over plain decoding per data set.

    python examples/copy_rule_replay/replay.py runs/copysim/all.jsonl   # cat of collect.py's outputs

A cycle at sequence length L proposes the rule's tokens; the accepted ones are the common prefix with the greedy
answer; the cycle costs COST[n] (the target's forward over n tokens in decoding steps: the prepacked fp32 cost curve
of a 2-core AMD EPYC with AVX2, 2 threads, `python examples/cost_curve.py`) plus T_DRAFT where the drafter ran.
Rules: "agree" = copy where the drafter's first draft equals the copy's first token; "match>=K" = also copy where
the sequence's last K tokens recur; "skip" = no drafter pass in those cycles; the number = most tokens copied.
"""
import sys, json
COST = {1: 1.0, 2: 1.10, 3: 1.22, 4: 1.34, 6: 1.40, 8: 1.43, 12: 1.68, 16: 1.76}
def cost(n):
    if n in COST: return COST[n]
    ks = sorted(COST); lo = max(x for x in ks if x < n); hi = min((x for x in ks if x > n), default=None)
    if hi is None: return COST[lo] + (n - lo) * 0.03
    return COST[lo] + (COST[hi] - COST[lo]) * (n - lo) / (hi - lo)
T_DRAFT = 0.25
recs = [json.loads(l) for l in open(sys.argv[1])]

def run(rec, rule):
    seq, Lp = rec["seq"], rec["prompt_len"]
    end = len(seq)
    cur = Lp + 1
    cycles = time = 0.0; tokens = 0
    state = {"last_copy_ok": None}
    while cur < end:
        i = cur - 1 - (Lp - 1)
        budget = end - cur
        path, conf, copy, ml = rec["paths"][i], rec["confs"][i], rec["copies"][i], rec["matchlen"][i]
        prop, drafted = rule(path, conf, copy, ml, budget, state)
        prop = prop[:budget]
        acc = 0
        while acc < len(prop) and prop[acc] == seq[cur + acc]: acc += 1
        if state.get("copied"):
            state["last_copy_ok"] = acc >= min(len(prop), 4)
        cur += acc + 1; tokens += acc + 1; cycles += 1
        time += cost(len(prop) + 1) + (T_DRAFT if drafted else 0)
    return tokens, cycles, time

def rule_factory(M=7, K=None, skip=False, adaptive=False):
    def rule(path, conf, copy, ml, budget, st):
        st["copied"] = False
        long_match = K is not None and ml >= K
        if len(copy) >= 2 and (long_match or (adaptive and st["last_copy_ok"])):
            st["copied"] = True
            return copy[:M], not skip
        if len(copy) >= 2 and copy[0] == path[0]:
            st["copied"] = True
            return copy[:M], True
        return path, True
    return rule

def none_rule(path, conf, copy, ml, budget, st):
    st["copied"] = False; return path, True

def lookup_only(path, conf, copy, ml, budget, st):
    st["copied"] = False
    return copy[:10], False

rules = {"drafter only": none_rule, "prompt lookup (10)": lookup_only, "R0 agree, 7": rule_factory(7)}
for M in (10, 16):
    rules[f"agree, {M}"] = rule_factory(M)
for K in (2, 3, 4):
    for M in (7, 10, 15, 16):
        rules[f"agree|match>={K}, {M}"] = rule_factory(M, K)
        rules[f"agree|match>={K}, {M}, skip"] = rule_factory(M, K, skip=True)
rules["agree|lastcopyok, 10"] = rule_factory(10, adaptive=True)
rules["agree|lastcopyok|match>=8, 10"] = rule_factory(10, 8, adaptive=True)
for ds in sorted({r["dataset"] for r in recs}) + ["all"]:
    sub = [r for r in recs if ds in ("all", r["dataset"])]
    print(f"\n{ds}: {len(sub)} prompts")
    base = None
    for name, rule in rules.items():
        T = C = Ti = 0; plain = 0
        for r in sub:
            t, c, ti = run(r, rule); T += t; C += c; Ti += ti
        plain = T  # plain: one step per token
        sp = plain / Ti
        print(f"  {name:38s} tau {T / C:5.2f}  modelled speedup {sp:5.2f}")
