#!/usr/bin/env bash
# The main job: set up on a fresh machine, then speculative generation with the shipped drafter on the bundled
# real target (SmolLM2-135M-Instruct), real prompts (ShareGPT dev records + HumanEval): text, tau, speedup.
# Extra arguments go to `dflash2 demo` (e.g. --num-prompts 10 --max-new-tokens 128).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/dflash2 demo "$@"
