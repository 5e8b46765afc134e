#!/usr/bin/env bash
# The test command: set up on a fresh machine, then run the whole suite (CPU, no downloads).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
