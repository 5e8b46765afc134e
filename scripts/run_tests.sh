#!/usr/bin/env bash
# The test command: set up on a fresh machine, then run the whole suite (CPU, no downloads).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Two worker processes (pytest-xdist), one test file each at a time; DFLASH2_TEST_WORKERS=0 runs in this process.
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "${DFLASH2_TEST_WORKERS:-2}" --dist loadfile "$@"
