#!/usr/bin/env bash
# The main job: set up on a fresh machine, then speculative generation with the shipped drafter on the bundled
# real target (SmolLM2-135M-Instruct), real prompts (ShareGPT dev records + HumanEval): text, tau, speedup.
# It runs in the fastest dtype the machine has (`--dtype auto`: bf16 where the GPU/CPU computes it natively, else fp32)
# and its first line says which and why. Extra arguments go to `dflash2 demo` (e.g. --num-prompts 10 --dtype fp32).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/dflash2 demo "$@"
