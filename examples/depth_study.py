"""Depth x local convolution x block size: fresh drafters trained side by side at equal budget (round robin).

Every arm is a fresh drafter trained with the SAME data, seed, schedule (constant learning rate after a warm-up, so a
run can be extended without changing its past) and number of steps; the arms take turns: round ``r`` brings every
arm to ``r * --chunk-steps`` steps (``dflash2 train --resume-from-checkpoint last``), so whenever the study stops, all
arms have had the same budget. After each chunk the run's held-out evaluation (teacher-forced per-slot accuracy and
tau, ``--eval-data``) is appended to ``<study-dir>/curves.jsonl``; ``--plot`` draws the curves. Restart the same
command to continue (a finished chunk is never redone; a killed one resumes from its last checkpoint).

    setsid nohup .venv/bin/python examples/depth_study.py --study-dir runs/depth-study --rounds 8 \\
        > runs/depth-study/study.log 2>&1 &
    .venv/bin/python examples/depth_study.py --study-dir runs/depth-study --plot   # curves.png + a table
    .venv/bin/python examples/depth_study.py --study-dir runs/depth-study --evaluate L3-conv  # the real loop

``--evaluate ARM[,ARM]`` runs ``dflash2 bench`` (plain, the drafter alone and the shipped loop that also copies from
the context; float32 target and drafter, greedy, 96 new tokens, one thread) on the tuning prompts (ShareGPT 16500..
and the code validation prompts of ``examples/make_heldout_prompts.py``) and writes ``<study-dir>/<arm>-bench/``;
``--plot`` adds their tau, per-position acceptance and drafting ms per cycle to the table.

The features of the training records are cached once (``--features-dir``) and shared by every arm.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# name: fresh-drafter options (everything else is shared)
ARMS = {
    "L1-conv": ["--num-layers", "1"],
    "L1-noconv": ["--num-layers", "1", "--no-conv"],
    "L3-conv": ["--num-layers", "3"],
    "L3-noconv": ["--num-layers", "3", "--no-conv"],
    "L5-conv": ["--num-layers", "5"],
    "L5-noconv": ["--num-layers", "5", "--no-conv"],
    "L2-conv": ["--num-layers", "2"],
    "L8-conv": ["--num-layers", "8"],
    "L8-noconv": ["--num-layers", "8", "--no-conv"],
    "L5-conv-B16": ["--num-layers", "5", "--block-size", "16"],
}
DEFAULT_ARMS = "L1-conv,L1-noconv,L3-conv,L3-noconv,L5-conv,L5-noconv,L2-conv,L8-conv,L8-noconv,L5-conv-B16"

SHARED = [
    "--target", "smollm2",
    "--data", "dataset_cards/smollm2-135m-instruct-sharegpt-regenerated-bf16",
    "--extra-data", "dataset_cards/smollm2-135m-instruct-code-regenerated",
    "--max-records", "600", "--max-length", "512", "--num-blocks", "32",
    "--features-dir", "/root/.cache/dflash2_hf/features-study",
    "--block-size", "8", "--draft-vocab", "8192",
    "--learning-rate", "6e-4", "--lr-scheduler-type", "constant_with_warmup", "--warmup-steps", "50",
    "--seed", "0", "--logging-steps", "25", "--save-total-limit", "2", "--disable-tqdm", "true",
    "--eval-data", "dataset_cards/smollm2-135m-instruct-sharegpt-regenerated", "--eval-max-records", "40",
    "--eval-steps", "1000000",  # one evaluation per chunk: the run's final evaluation
]


def steps_done(arm_dir: Path) -> int:
    """Global step of the arm's newest complete checkpoint (0 if none)."""
    best = 0
    for ck in arm_dir.glob("checkpoint-*"):
        if (ck / "trainer_state.json").exists():
            best = max(best, int(ck.name.split("-")[1]))
    return best


def run_logged(cmd: list[str], log_path: Path, what: str) -> None:
    """Runs ``cmd`` with its output appended to ``log_path`` (after the command line); stops the study if it fails."""
    with open(log_path, "a") as log:
        log.write(f"\n$ {' '.join(cmd)}\n")
        log.flush()
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
    if rc != 0:
        raise SystemExit(f"{what} exited {rc} (see {log_path})")


def run_chunk(study: Path, arm: str, arm_args: list[str], until: int, threads: int) -> dict:
    out = study / arm
    cmd = [os.path.join(os.path.dirname(sys.executable), "dflash2"), "train", *SHARED, *arm_args,
           "--output-dir", str(out), "--max-steps", str(until), "--save-steps", str(until),
           "--resume-from-checkpoint", "last", "--num-threads", str(threads)]
    # the arm's own options come last: --block-size of an arm overrides the shared one
    t0 = time.time()
    run_logged(cmd, study / f"{arm}.log", f"{arm}: dflash2 train")
    summary = json.loads((out / "training_summary.json").read_text())
    return {"arm": arm, "step": until, "wall_s": round(time.time() - t0, 1), "final_eval": summary.get("final_eval"),
            "train_runtime_s": summary.get("train_runtime_s"), "last_metrics": summary.get("last_metrics")}


BENCH = ["--target", "smollm2", "--drafter-dtype", "float32", "--num-prompts", "10", "--max-new-tokens", "96",
         "--datasets", "runs/heldout/sharegpt-16500.jsonl,runs/heldout/validation-code.jsonl",
         "--methods", "plain,dflash2_no_lookup,dflash2", "--no-progress"]


def evaluate(study: Path, arm: str, threads: int) -> None:
    out = study / f"{arm}-bench"
    cmd = [os.path.join(os.path.dirname(sys.executable), "dflash2"), "bench", *BENCH, "--drafter", str(study / arm),
           "--num-threads", str(threads), "--output-dir", str(out)]
    run_logged(cmd, study / f"{arm}-bench.log", f"{arm}: dflash2 bench")


def bench_row(study: Path, arm: str) -> dict | None:
    path = study / f"{arm}-bench" / "results.json"
    if not path.exists():
        return None
    agg = {(a["dataset"], a["method"]): a for a in json.loads(path.read_text())["aggregates"]}
    sel, loop = agg[("all", "dflash2_no_lookup")], agg[("all", "dflash2")]
    return {"tau": sel["tau"], "tau_loop": loop["tau"], "pos": sel["per_position_acceptance"],
            "draft_ms": sel["time_split_ms_per_cycle"]["draft"], "select_ms": sel["time_split_ms_per_cycle"]["select"],
            "identical": all(a["identical_all"] for a in agg.values()),
            "chat": agg[("sharegpt-16500", "dflash2_no_lookup")]["tau"],
            "code": agg[("validation-code", "dflash2_no_lookup")]["tau"]}


def plot(study: Path, at_step: int | None = None, chunk_steps: int = 150) -> None:
    rows = [json.loads(line) for line in (study / "curves.jsonl").read_text().splitlines() if line.strip()]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"L1": "C0", "L2": "C1", "L3": "C2", "L5": "C3", "L8": "C4"}  # depth: colour; no conv: dashed
    for arm in sorted(dict.fromkeys(r["arm"] for r in rows), key=lambda a: (int(a.split("-")[0][1:]), a)):
        pts = sorted(((r["step"], r["final_eval"]) for r in rows if r["arm"] == arm), key=lambda x: x[0])
        steps = [s for s, _ in pts]
        style = dict(marker="o", label=arm, color=colors.get(arm.split("-")[0]),
                     linestyle="--" if "noconv" in arm else (":" if "B16" in arm else "-"))
        axes[0].plot(steps, [e["eval_tau_selector"] for _, e in pts], **style)
        axes[1].plot(steps, [e["eval_acc_slot_1"] for _, e in pts], **style)
    axes[0].set(xlabel="training steps", ylabel="teacher-forced tau (selector path)")
    axes[1].set(xlabel="training steps", ylabel="slot-1 accuracy (held out)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(study / "curves.png", dpi=110)
    last = {}
    for r in rows:
        if (at_step is None or r["step"] <= at_step) and r["step"] >= last.get(r["arm"], {}).get("step", -1):
            last[r["arm"]] = r
    print("| arm | steps | slot 1 | slot 1, mean of the last 3 evaluations | slot 2 | slot 3 | slot 4 | tau, top-1 path | "
          "tau, selector path | train s / step (median chunk) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for arm, r in sorted(last.items(), key=lambda kv: (int(kv[0].split("-")[0][1:]), kv[0])):
        e = r["final_eval"]
        recent = sorted((x for x in rows if x["arm"] == arm and x["step"] <= r["step"]), key=lambda x: x["step"])[-3:]
        slot1_mean = sum(x["final_eval"]["eval_acc_slot_1"] for x in recent) / len(recent)
        chunks = sorted(x["train_runtime_s"] / chunk_steps for x in rows
                        if x["arm"] == arm and x["step"] <= r["step"] and x["train_runtime_s"])
        per_step = chunks[len(chunks) // 2] if chunks else float("nan")  # median chunk: a paused chunk is not cost
        print(f"| {arm} | {r['step']} | {e['eval_acc_slot_1']:.3f} | {slot1_mean:.3f} | {e['eval_acc_slot_2']:.3f} | "
              f"{e['eval_acc_slot_3']:.3f} | {e['eval_acc_slot_4']:.3f} | {e['eval_tau_top1']:.3f} | "
              f"{e['eval_tau_selector']:.3f} | {per_step:.2f} |")
    print("\nReal loop, the drafter alone (dflash2_no_lookup; tuning prompts, 10 chat + 10 code, fp32, greedy, 96 tokens,"
          " 1 thread):\n")
    print("| arm | tau chat | tau code | tau all | tau with copying | position 1 | draft ms / cycle | identical |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for arm in last:
        b = bench_row(study, arm)
        if b:
            print(f"| {arm} | {b['chat']:.2f} | {b['code']:.2f} | {b['tau']:.2f} | {b['tau_loop']:.2f} | "
                  f"{b['pos'][0]:.2f} | {b['draft_ms']:.1f} | {b['identical']} |")
    print(f"\nwrote {study / 'curves.png'}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--study-dir", default="runs/depth-study")
    p.add_argument("--arms", default=DEFAULT_ARMS, help=f"comma-separated, of {', '.join(ARMS)}")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--chunk-steps", type=int, default=150)
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--plot", action="store_true", help="only draw curves.png and print the table")
    p.add_argument("--at-step", type=int, help="with --plot: the table at this step (default: each arm's last)")
    p.add_argument("--evaluate", metavar="ARMS", help="only run the real-loop bench of these trained arms")
    args = p.parse_args(argv)
    study = Path(args.study_dir)
    study.mkdir(parents=True, exist_ok=True)
    if args.plot:
        return plot(study, args.at_step, args.chunk_steps)
    if args.evaluate:
        for arm in args.evaluate.split(","):
            evaluate(study, arm, args.num_threads)
        return None
    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"unknown arm(s) {unknown}; choose from {list(ARMS)}")
    for r in range(1, args.rounds + 1):
        until = r * args.chunk_steps
        for arm in arms:
            if steps_done(study / arm) >= until:
                continue
            row = run_chunk(study, arm, ARMS[arm], until, args.num_threads)
            with open(study / "curves.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            e = row["final_eval"] or {}
            print(f"{time.strftime('%H:%M:%S')} {arm} step {until}: tau_selector {e.get('eval_tau_selector')} "
                  f"slot1 {e.get('eval_acc_slot_1')} ({row['wall_s']} s)", flush=True)


if __name__ == "__main__":
    main()
