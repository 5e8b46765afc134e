"""Data parallel training under torchrun and accelerate launch (gloo on the CPU): 2 processes train the loss curve of
1 process at the same global batch, resume, and LoRA too.

Tolerance: every logged loss within 2% (relative) of the one-process run. The blocks, records and global batches are
the same (anchors drawn per (seed, epoch, record), batches split across ranks by the Trainer); what differs is the
normalisation: one process averages the block loss over the labelled slots of both sequences, two processes average
each rank's own mean (DDP averages the gradients), which weighs the sequences slightly differently.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

TOLERANCE = 0.02


def _run(tmp_path, nproc: int, out: str, *extra: str, launcher: str = "torchrun") -> None:
    """One process: in this one (``dflash2_hf.cli.main``); more: ``torchrun`` (``python -m torch.distributed.run``) or
    ``accelerate launch --multi_gpu`` (on a CPU-only machine that is gloo DDP too; ``--cpu`` would start one process)."""
    args = ["train", "--target", str(tmp_path / "target"), "--data", str(tmp_path / "data"), "--num-layers", "1",
            "--block-size", "4", "--num-blocks", "4", "--per-device-train-batch-size", str(2 // nproc),
            "--logging-steps", "1", "--learning-rate", "1e-3", "--lr-scheduler-type", "constant", "--warmup-steps", "0",
            "--use-cpu", "--disable-tqdm", "true", "--output-dir", str(tmp_path / out), *extra]
    if nproc == 1:
        from dflash2_hf.cli import main

        assert main(args) == 0
        return
    env = dict(os.environ, OMP_NUM_THREADS="1", DFLASH2_CACHE=str(tmp_path / "cache"))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if launcher == "torchrun":
        start = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    else:
        start = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(nproc),
                 "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                 "--main_process_port", "0"]
    cmd = [*start, "-m", "dflash2_hf.cli", *args]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, "\n".join(line for line in res.stderr.splitlines() if "dflash2 train: error" in line) \
        or res.stderr[-3000:]


def _losses(run_dir) -> list[float]:
    last = max((p for p in run_dir.iterdir() if p.name.startswith("checkpoint-")), key=lambda p: int(p.name[11:]))
    history = json.loads((last / "trainer_state.json").read_text())["log_history"]
    return [h["loss"] for h in history if "loss" in h]


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= TOLERANCE * abs(x) for x, y in zip(a, b))


def _prepare(tmp_path) -> None:
    from dflash2_hf.cli import main
    from test_data import _good_records, _write_array, tiny_chat_target_folder

    tiny_chat_target_folder(tmp_path / "target")
    src = str(_write_array(tmp_path / "sg.json", _good_records(8)))
    assert main(["prepare-data", "--target", str(tmp_path / "target"), "--source", src, "--output-dir", str(tmp_path / "data"),
                 "--stop", "8", "--max-new-tokens", "12", "--no-progress"]) == 0


needs_distributed = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without torch.distributed")


def _resume_copy(src, dst, step: int) -> None:
    """``dst`` holds only ``src``'s ``checkpoint-<step>``: a run stopped there."""
    dst.mkdir()
    shutil.copytree(src / f"checkpoint-{step}", dst / f"checkpoint-{step}")


@needs_distributed
def test_two_processes_train_the_one_process_curve(tmp_path, monkeypatch):
    """Full drafter, online features, 4 steps under torchrun; the 2-process checkpoint of step 2 resumes (in one
    process) onto the same curve."""
    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path / "cache"))
    _prepare(tmp_path)
    online = ["--features", "online", "--save-steps", "2"]
    _run(tmp_path, 2, "two", *online, "--max-steps", "4")
    _run(tmp_path, 1, "one", *online, "--max-steps", "4")
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    print("losses, 1 process:", one, "2 processes:", two)
    assert _close(one, two), (one, two)
    assert one[0] != one[-1]  # it trains
    summary = json.loads((tmp_path / "two" / "training_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_step"] == 4 and summary["features"] == "online"
    assert not (tmp_path / "cache" / "features").exists()  # online: nothing cached
    _resume_copy(tmp_path / "two", tmp_path / "resumed", 2)
    _run(tmp_path, 1, "resumed", *online, "--max-steps", "4", "--resume-from-checkpoint", "last")
    assert _close(one, _losses(tmp_path / "resumed"))


@needs_distributed
def test_two_processes_train_the_one_process_lora_curve_and_resume(tmp_path, monkeypatch):
    """A LoRA adapter on a drafter, cached features (built by the main process first, read by both ranks): 1 process,
    4 steps / its checkpoint of step 2 resumed to 4 by 2 processes under ``accelerate launch``."""
    from transformers import AutoModelForCausalLM

    from dflash2_hf import DFlash2DraftModel

    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path / "cache"))
    _prepare(tmp_path)
    target = AutoModelForCausalLM.from_pretrained(tmp_path / "target")
    torch.manual_seed(0)
    DFlash2DraftModel.from_target(target, num_hidden_layers=1, block_size=4).save_pretrained(tmp_path / "base")
    lora = ["--init", str(tmp_path / "base"), "--lora", "--lora-r", "4", "--save-steps", "2", "--max-steps", "4"]
    _run(tmp_path, 1, "one", *lora)
    _resume_copy(tmp_path / "one", tmp_path / "two", 2)
    _run(tmp_path, 2, "two", *lora, "--resume-from-checkpoint", "last", launcher="accelerate")
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    print("LoRA losses, 1 process:", one, "2 processes from step 3 on:", two)
    assert _close(one, two) and one[:2] == two[:2], (one, two)
    assert one[0] != one[-1]
    summary = json.loads((tmp_path / "two" / "training_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_step"] == 4 and summary["resumed_from"].endswith("-2")
    assert (tmp_path / "two" / "adapter_model.safetensors").is_file() and (tmp_path / "cache" / "features").is_dir()
