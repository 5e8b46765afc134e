"""Command-line options of ``dflash2 train`` and what they mean for the run (feature caches, loss mix).

Kept apart from :mod:`dflash2_hf.cli.train` (which runs the training) the way ``transformers`` keeps
``TrainingArguments`` apart from ``Trainer``.
"""

from __future__ import annotations

import argparse

from . import add_device_argument


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data and target")
    g.add_argument("--target", default="smollm2", help="target alias (smollm2, gemma3-270m) or a transformers folder")
    g.add_argument("--data", required=True, help="prepared data folder (dflash2 prepare-data --out)")
    g.add_argument("--features-dir", default=None,
                   help="feature cache root (default: $DFLASH2_CACHE/features/<name of DATA>, i.e. "
                        "~/.cache/dflash2_hf/features/...; outside DATA so that regenerating the data folder does not "
                        "delete it; features of records whose tokens changed are recomputed)")
    g.add_argument("--feature-dtype", default="float32", choices=["auto", "float32", "bfloat16"],
                   help="dtype of the target forward that computes the features (stored as bfloat16 either way; "
                        "one cache holds one dtype). float32 (default) = the bar's serving dtype; bfloat16 is 2.6x "
                        "faster on a CPU with AVX512-BF16 and slower where bf16 is emulated (AVX2 only); auto = "
                        "bfloat16 where the device computes it natively, else float32 (examples/train_step_cost.py "
                        "--compare dtype measures both)")
    g.add_argument("--max-length", type=int, default=1024, help="longest context per sequence (tokens)")
    add_device_argument(g, "the target's feature pass and the training")
    g.add_argument("--max-records", type=int, default=None, help="use the first N records (by record_id)")
    g.add_argument("--feature-time-budget", type=float, default=None,
                   help="stop computing features after this many minutes (per data folder; with --follow-data "
                        "also per refresh) and train on what is cached")
    g.add_argument("--features-only", action="store_true", help="fill the feature cache and exit")
    g.add_argument("--follow-data", action="store_true",
                   help="keep picking up records a still-running prepare-data job adds to --data, and features "
                        "another process (a --features-only job) caches for any part (at every epoch start and "
                        "every --follow-every steps); features still missing are computed in this process, within "
                        "--feature-time-budget per part and refresh (0: leave them to that other job)")
    g.add_argument("--follow-every", type=int, default=None, help="with --follow-data: also refresh every N steps")
    g.add_argument("--extra-data", action="append", default=[], metavar="DIR",
                   help="another prepared folder trained together with --data (its own feature cache next to "
                        "--data's; repeatable), e.g. original-answer records next to regenerated ones")
    g.add_argument("--target-labels", action="store_true",
                   help="label every slot with the target's own greedy token (stored with the features: a "
                        "separate cache) and train a slot only while the text agrees with the target before it; "
                        "needed for `prepare-data --original-answers` folders, the same labels on regenerated data")
    g.add_argument("--distill-topk", type=int, default=0, metavar="K",
                   help="also store the target's K largest next-token logits with the features (a separate "
                        "cache, which also holds the target's greedy tokens; the labels stay the text's tokens "
                        "unless --target-labels) and distil them: see --distill-weight")
    g.add_argument("--distill-weight", type=float, default=None, metavar="W",
                   help="block loss = (1 - W) * cross entropy on the true token + W * cross entropy to the target's "
                        "top-K distribution (default 0.5 with --distill-topk, else 0)")
    g.add_argument("--eval-data", default=None,
                   help="held-out prepared data folder (e.g. regenerated dev records 16000-17000): teacher-forced "
                        "per-slot accuracy and tau estimates on it are logged as eval_* every --eval-steps")
    g.add_argument("--eval-steps", type=int, default=200)
    g.add_argument("--eval-max-records", type=int, default=100, help="evaluate on the first N held-out records")
    g.add_argument("--eval-only", action="store_true",
                   help="only evaluate (needs --eval-data) the drafter given by --init, or by --resume (last "
                        "checkpoint in --output); prints the metrics as JSON. The estimate depends on which anchors "
                        "are drawn: compare drafters only at the same --num-blocks and --eval-max-records (the "
                        "in-training eval_* metrics use the run's --num-blocks)")

    g = parser.add_argument_group("drafter")
    g.add_argument("--output", required=True, help="run folder: checkpoints and the final drafter")
    g.add_argument("--init", default=None, help="start from this drafter (folder or Hub id) instead of a fresh one")
    g.add_argument("--num-layers", type=int, default=5, help="drafter decoder layers (fresh drafter)")
    g.add_argument("--block-size", type=int, default=16, help="B: anchor + B-1 draft slots (fresh drafter)")
    g.add_argument("--target-layer-ids", default=None, help="comma-separated target layers (default: spread)")
    g.add_argument("--mask-token-id", type=int, default=None, help="mask token id (default: pad / unk / last id)")
    g.add_argument("--selector-top-k", type=int, default=None)
    g.add_argument("--selector-rank", type=int, default=None)
    g.add_argument("--no-conv", action="store_true", help="fresh drafter without the local convolutions")
    g.add_argument("--no-selector", action="store_true", help="fresh drafter without the candidate selector")
    g.add_argument("--layer-types", default=None, metavar="TYPES",
                   help="fresh drafter: attention per layer, comma-separated full / sliding (one value: every layer; "
                        "default: every layer full)")
    g.add_argument("--sliding-window", type=int, default=None, metavar="N",
                   help="fresh drafter: window of the sliding layers, in positions")
    g.add_argument("--causal", choices=["auto", "yes", "no"], default="auto",
                   help="fresh drafter: every layer causal (yes), bidirectional (no), or sliding layers causal and "
                        "full ones bidirectional (auto, the published DFlash rule)")
    g.add_argument("--init-layers-from-target", choices=["first", "last", "spread"], default=None,
                   help="fresh drafter: copy these target decoder layers into the drafter layers")
    g.add_argument("--init-norm", type=float, default=None,
                   help="fresh drafter: initial value of the final norm weight (e.g. 0.2: small initial logits, "
                        "no loss spike at the start)")
    g.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="(re)choose the draft vocabulary: the N most frequent response tokens of --data and "
                        "--extra-data (plus EOS), replacing the one --init was trained with; the loss then runs over "
                        "those rows (default: keep --init's, or the whole vocabulary for a fresh drafter)")
    g.add_argument("--init-norm-from-target", action="store_true",
                   help="fresh drafter: copy the target's final norm weight into the drafter's final norm")
    # LoRA options: `add_lora_arguments` below; the model wrapping: `dflash2_hf.cli.train.wrap_model`.

    g = parser.add_argument_group("training")
    g.add_argument("--max-steps", type=int, default=None, help="optimizer steps (overrides --epochs)")
    g.add_argument("--epochs", type=float, default=1.0, help="passes over the cached sequences")
    g.add_argument("--num-blocks", type=int, default=32, help="blocks (anchors) sampled per sequence per pass")
    g.add_argument("--early-anchor-tokens", type=int, default=96, metavar="N",
                   help="with --early-anchor-weight: the first N tokens of each response count as early")
    g.add_argument("--early-anchor-weight", type=float, default=1.0, metavar="W",
                   help="an anchor among the early tokens of its response is W times as likely to be drawn as a "
                        "later one (default 1: uniform). Serving drafts every response from its first token, where "
                        "the drafter has the least context and accepts least")
    g.add_argument("--batch-size", type=int, default=1, help="sequences per step")
    g.add_argument("--grad-accum", type=int, default=1)
    g.add_argument("--lr", type=float, default=6e-4)
    g.add_argument("--warmup", type=float, default=0.04, help="warm-up: ratio of the steps (<1) or a step count")
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--max-grad-norm", type=float, default=1.0)
    g.add_argument("--gamma", type=float, default=None, help="slot weight decay (default: 7@16, 5@10, 4@8)")
    g.add_argument("--selector-weight", type=float, default=1.0, help="selector loss weight (0 = off)")
    g.add_argument("--selector-no-detach", action="store_true", help="let the selector loss reach the drafter")
    g.add_argument("--bf16", nargs="?", const="yes", default="no", choices=["auto", "yes", "no"],
                   help="bfloat16 autocast of the training step (fp32 master weights): 2x faster per step on a CPU "
                        "with AVX512-BF16, slower where bf16 is emulated; auto = where the device computes bf16 "
                        "natively (`--bf16` alone = yes)")
    g.add_argument("--save-steps", type=int, default=100)
    g.add_argument("--save-total-limit", type=int, default=3)
    g.add_argument("--logging-steps", type=int, default=10)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--num-threads", "--threads", dest="threads", type=int, default=None, metavar="N",
                   help="torch CPU threads (same flag name as generate/bench/prepare-data; --threads still works)")
    g.add_argument("--resume", action="store_true", help="resume from the last checkpoint in --output")
    g.add_argument("--no-progress", action="store_true", help="no tqdm bars (default when not on a terminal)")
    add_lora_arguments(parser)


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    """LoRA fine-tuning options (``--lora`` with ``--init``: adapt a trained drafter, save only the adapter)."""
    g = parser.add_argument_group("LoRA (adapt a trained drafter; see dflash2_hf.lora)")
    g.add_argument("--lora", action="store_true",
                   help="train a LoRA adapter on the drafter given by --init instead of all its weights; "
                        "--output then holds only the adapter (+ the base fingerprint)")
    g.add_argument("--lora-r", type=int, default=16)
    g.add_argument("--lora-alpha", type=int, default=32)
    g.add_argument("--lora-dropout", type=float, default=0.0)
    g.add_argument("--lora-target-modules", default=None,
                   help="comma-separated module names (default: q/k/v/o and gate/up/down projections)")
    g.add_argument("--lora-modules-to-save", default=None, metavar="NAMES",
                   help="comma-separated module names trained in full next to the LoRA layers and saved in the "
                        "adapter (peft's modules_to_save), e.g. the small per-layer modules of "
                        "dflash2_hf.lora.SMALL_MODULES: attention_conv,mlp_conv,input_layernorm,post_attention_layernorm,"
                        "q_norm,k_norm,norm,hidden_norm,hidden_projection (3%% of a SmolLM2 drafter)")
    g.add_argument("--lora-init", default=None, metavar="ADAPTER",
                   help="start from this adapter of the --init drafter (e.g. one from examples/extract_adapter.py) "
                        "instead of a fresh one; its rank, targets and modules to save are kept")
    g.add_argument("--lora-save-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="precision of the saved adapter (bf16: half the bytes; loading casts it to the drafter's)")
    g.add_argument("--lora-modules-lr", type=float, default=None, metavar="LR",
                   help="learning rate of the --lora-modules-to-save modules (default: --lr, the LoRA layers' rate)")
    g.add_argument("--only-code", action="store_true",
                   help="train (and --eval-data: evaluate) only on records whose conversation contains a fenced "
                        "code block (a code domain); a --data folder made by prepare-data --only-code is used whole")


def cache_kwargs(args: argparse.Namespace) -> dict:
    """What the feature caches of this run store besides the features (``FeatureCache`` keyword arguments)."""
    return {"with_next": args.target_labels, "topk": args.distill_topk}


def resolve_precision(args: argparse.Namespace, device) -> list[str]:
    """Resolves ``--feature-dtype auto`` and ``--bf16 auto`` for ``device`` in place (``args.feature_dtype`` becomes
    ``"float32"`` / ``"bfloat16"``, ``args.bf16`` a bool); returns what was chosen and why, for the log."""
    from ..generation.precision import bf16_support

    native, reason = bf16_support(device)
    chosen = []
    if args.feature_dtype == "auto":
        args.feature_dtype = "bfloat16" if native else "float32"
        chosen.append(f"features in {args.feature_dtype} (auto: {reason})")
    if args.bf16 == "auto":
        args.bf16 = native
        chosen.append(f"training step {'bf16 autocast' if native else 'float32'} (auto: {reason})")
    else:
        args.bf16 = args.bf16 in ("yes", True)
    return chosen


def distill_weight(args: argparse.Namespace) -> float:
    """``--distill-weight`` (default 0.5 with ``--distill-topk``, else 0).

    Raises:
        ValueError: a weight outside [0, 1], or a weight > 0 without ``--distill-topk`` (no soft targets).
    """
    w = args.distill_weight if args.distill_weight is not None else (0.5 if args.distill_topk else 0.0)
    if not 0.0 <= w <= 1.0:
        raise ValueError(f"--distill-weight must be in [0, 1], got {w}")
    if w and not args.distill_topk:
        raise ValueError("--distill-weight needs --distill-topk K (the target's top-K logits stored with the features)")
    return w
