"""scripts/setup.sh skips its pip steps when a completed set-up's stamp matches pyproject.toml + setup.sh."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _clone(tmp_path: Path) -> Path:
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')  # this test's interpreter, with every package
    python.chmod(0o755)
    return tmp_path


def test_a_matching_stamp_skips_the_pip_steps(tmp_path):
    clone = _clone(tmp_path)
    digest = hashlib.sha256((clone / "pyproject.toml").read_bytes() + (clone / "scripts" / "setup.sh").read_bytes())
    (clone / ".venv" / ".setup-stamp").write_text(digest.hexdigest() + "\n")
    done = subprocess.run(["bash", str(clone / "scripts" / "setup.sh")], capture_output=True, text=True, timeout=20)
    assert done.returncode == 0 and "is up to date" in done.stdout, done.stderr


def test_a_stale_stamp_runs_the_set_up(tmp_path):
    clone = _clone(tmp_path)
    (clone / ".venv" / ".setup-stamp").write_text("stale\n")
    (clone / ".venv" / "bin" / "python").write_text(  # records each pip call instead of installing
        '#!/bin/sh\ncase "$*" in *"-m pip"*) echo "$*" >> "$(dirname "$0")/../pip.log"; exit 0;; esac\n'
        f'exec "{sys.executable}" "$@"\n')
    done = subprocess.run(["bash", str(clone / "scripts" / "setup.sh")], capture_output=True, text=True, timeout=20)
    assert done.returncode == 0, done.stderr
    assert len((clone / ".venv" / "pip.log").read_text().splitlines()) == 3  # torch, the package, the assets
    assert (clone / ".venv" / ".setup-stamp").read_text().strip() != "stale"  # written again at the end
