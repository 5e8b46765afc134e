"""Independent check of `dflash2 bench` timings: plain generate() vs DFlash2 generate() timed by hand.

Reads a bench run's results.json, rebuilds the same prompts directly with the tokenizer's chat template (not through
dflash2_hf.bench), times `target.generate()` with and without the drafter using time.perf_counter only (no hooks,
no harness), alternating the two per prompt, and prints tokens/s of both and their ratio next to the bench's figure.

    PYTHONPATH=src python examples/check_bench_timing.py runs/bench-smoke/results.json [--repeats 2]

Only greedy runs with the 'sharegpt' / 'humaneval' data sets and a 'fresh' or saved drafter are supported.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import dflash2_hf  # noqa: F401  (installs the generate() routing)
from dflash2_hf import DFlash2DraftModel
from dflash2_hf.data import humaneval_messages, iter_sharegpt, load_humaneval
from dflash2_hf.data.sharegpt import first_human_turn
from dflash2_hf.targets import load_target


def prompt_ids(tokenizer, dataset: str, prompt_id: str) -> list[int]:
    if dataset == "sharegpt":
        rid = int(prompt_id)
        record = next(rec for i, rec in iter_sharegpt(rid, rid + 1))
        messages = [{"role": "user", "content": first_human_turn(record)}]
    elif dataset == "humaneval":
        problem = next(p for p in load_humaneval() if p["task_id"] == prompt_id)
        messages = humaneval_messages(problem)
    else:
        raise SystemExit(f"data set {dataset!r} not supported by this check")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", help="results.json of a `dflash2 bench` run")
    ap.add_argument("--repeats", type=int, default=1, help="timed calls per prompt and method (default 1)")
    ap.add_argument("--num-threads", type=int, default=None,
                    help="torch threads (default: the bench run's torch_threads from results.json)")
    args = ap.parse_args()

    res = json.load(open(args.results))
    torch.set_num_threads(args.num_threads or res["environment"]["machine"]["torch_threads"])
    s, meta = res["settings"], res["meta"]
    if not s["greedy"]:
        raise SystemExit("this check supports greedy runs only")
    # "fp32", "bf16", "fp32 (auto: no native bf16 on this CPU)", or torch's name ("float32") from the Python API
    dtype = torch.bfloat16 if meta["dtype"].split()[0] in ("bf16", "bfloat16") else torch.float32
    torch.manual_seed(s["seed"])  # same order of random draws as the CLI: a 'fresh' drafter gets the same weights
    target, tokenizer = load_target(meta["target"], dtype=dtype)
    if meta["drafter"] == "fresh":
        drafter = DFlash2DraftModel.from_target(target).eval()
    else:
        drafter = DFlash2DraftModel.from_pretrained(meta["drafter"], dtype=dtype).eval()
    print(f"torch threads: {torch.get_num_threads()}")

    prompts = []
    for dataset, plist in res["prompts"].items():
        for p in plist:
            ids = prompt_ids(tokenizer, dataset, p["id"])
            assert len(ids) == p["tokens"], f"{dataset}/{p['id']}: {len(ids)} tokens here, {p['tokens']} in the bench"
            prompts.append((dataset, p["id"], torch.tensor([ids])))

    def timed(method, ids):
        kw = dict(max_new_tokens=s["max_new_tokens"], do_sample=False, attention_mask=torch.ones_like(ids))
        if method == "dflash2":
            kw["assistant_model"] = drafter
        t0 = time.perf_counter()
        out = target.generate(ids, **kw)
        return out.shape[1] - ids.shape[1], time.perf_counter() - t0, out[0, ids.shape[1]:].tolist()

    for method in ("plain", "dflash2"):  # untimed warm-up
        timed(method, prompts[0][2])

    totals = {"plain": [0, 0.0], "dflash2": [0, 0.0]}
    outputs = {}
    for j, (dataset, pid, ids) in enumerate(prompts):
        for r in range(args.repeats):
            order = ("plain", "dflash2") if (j + r) % 2 == 0 else ("dflash2", "plain")
            for method in order:
                n, sec, toks = timed(method, ids)
                totals[method][0] += n
                totals[method][1] += sec
                outputs[(dataset, pid, method)] = toks
                print(f"  {dataset}/{pid:<14} {method:<8} {n:3d} tokens {sec:7.2f} s  {n / sec:6.2f} tok/s")
    tps = {m: n / sec for m, (n, sec) in totals.items()}
    ratio = tps["dflash2"] / tps["plain"]

    # the bench's figure for the same prompts: pooled over its records
    recs = res["records"]
    bench_tps = {}
    for m in ("plain", "dflash2"):
        rs = [r for r in recs if r["method"] == m]
        bench_tps[m] = sum(r["new_tokens"] for r in rs) / sum(r["seconds"] for r in rs)
    bench_ratio = bench_tps["dflash2"] / bench_tps["plain"]
    same = all(outputs[(r["dataset"], r["prompt_id"], r["method"])] == r["output_ids"]
               for r in recs if r["method"] in ("plain", "dflash2"))
    print(f"independent: plain {tps['plain']:.2f} tok/s, dflash2 {tps['dflash2']:.2f} tok/s, ratio {ratio:.3f}")
    print(f"bench      : plain {bench_tps['plain']:.2f} tok/s, dflash2 {bench_tps['dflash2']:.2f} tok/s, "
          f"ratio {bench_ratio:.3f}")
    print(f"ratio independent / bench = {ratio / bench_ratio:.3f}; outputs identical to the bench's: {same}")


if __name__ == "__main__":
    main()
