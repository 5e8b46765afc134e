"""scripts/gpu_train.sh at tiny scale on the CPU: regenerate, train with online features, bring the drafter back."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_train_script_at_tiny_scale(tmp_path):
    from test_data import _good_records, _write_array, tiny_chat_target_folder

    target = tiny_chat_target_folder(tmp_path / "target")
    prompts = _write_array(tmp_path / "prompts.json", _good_records(4))
    env = dict(os.environ, OUT=str(tmp_path / "out"), TARGET=target, PROMPTS_FILE=str(prompts), PROMPTS="4",
               NEW_TOKENS="8", GEN_BATCH="4", MAX_PROMPT_TOKENS="4000", STEPS="2", LAYERS="1", BLOCK="4", BLOCKS="4",
               BATCH="1", MAX_LENGTH="2048", DEVICE="cpu", PYTHON=sys.executable, OMP_NUM_THREADS="1",
               DFLASH2_CACHE=str(tmp_path / "cache"))
    res = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_train.sh")], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    out = tmp_path / "out"
    summary = json.loads((out / "drafter" / "training_summary.json").read_text())
    assert summary["features"] == "online" and summary["global_step"] == 2
    assert json.loads((out / "check.json").read_text())["identical"]
    assert not list((out / "drafter").glob("checkpoint-*"))  # only the final drafter comes back
    assert not (tmp_path / "cache" / "features").exists()

    # a second run from that drafter, grown by one layer, on the prepared folder (no regeneration)
    env2 = dict(env, OUT=str(tmp_path / "out2"), DATA=str(out / "work" / "data"), INIT=str(out / "drafter"),
                GROW="1", EXTRA_ARGS="--early-anchor-weight 2 --early-anchor-tokens 4")
    res = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_train.sh")], env=env2, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "regenerated" not in res.stdout
    grown = json.loads((tmp_path / "out2" / "drafter" / "config.json").read_text())
    assert grown["num_hidden_layers"] == 2 and json.loads((tmp_path / "out2" / "check.json").read_text())["identical"]
    command = json.loads((tmp_path / "out2" / "drafter" / "train_command.json").read_text())
    assert "--grow-layers" in json.dumps(command) and "--early-anchor-weight" in json.dumps(command)
