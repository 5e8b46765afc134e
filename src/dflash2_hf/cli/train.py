"""Train a DFlash2 drafter on target-regenerated data (cached or online target features; torchrun / accelerate DDP).

Every option is a field of the typed configs of ``dflash2_hf.training`` (DataArguments, FeatureArguments,
DrafterArguments, LoraArguments, DFlash2TrainingArguments = transformers.TrainingArguments + the drafter loss), parsed
with transformers' HfArgumentParser; this command only parses them and calls ``dflash2_hf.training.train``.
TrainingArguments fields keep their transformers names (--output-dir, --learning-rate, --num-train-epochs,
--per-device-train-batch-size, --resume-from-checkpoint, ...). A single .yaml / .json file of the same field names
works too (the command line wins).

Examples:
  dflash2 train --target smollm2 --data data/smollm2-sharegpt --output-dir runs/smollm2-v1 \\
      --num-layers 5 --block-size 16 --max-steps 1000 --num-threads 1
  dflash2 train ... --resume-from-checkpoint last   # continue from the last checkpoint in --output-dir
  dflash2 train ... --features online               # the target runs in each training step; no feature cache
  dflash2 train run.yaml --max-steps 10             # options from a file
  torchrun --nproc_per_node 2 $(which dflash2) train ...   # data parallel (also: accelerate launch)

Renamed (the old spelling is refused with the new name): --output -> --output-dir, --lr -> --learning-rate,
--warmup -> --warmup-steps, --batch-size -> --per-device-train-batch-size, --grad-accum ->
--gradient-accumulation-steps, --epochs -> --num-train-epochs, --resume -> --resume-from-checkpoint last,
--no-progress -> --disable-tqdm, --selector-no-detach -> --no-selector-detach.

Logged every --logging-steps: loss, ce_loss, selector_loss, acc_slot_j (top-1 accuracy of draft slot j),
acc_top1, acc_selector, topk_recall, tau_top1 / tau_selector (teacher-forced greedy acceptance estimate on the
training blocks) and pred_tokens_per_s. docs/distributed_training.md: online features, DDP, FSDP / ZeRO.
"""

from __future__ import annotations

import argparse
import sys

from dflash2_cli.arguments import add_train_arguments as add_arguments  # noqa: F401 (the options; need transformers)


def run(args: argparse.Namespace) -> int:
    from ..training import train
    from ..training.parser import configs_from_namespace

    from . import sigterm_as_ctrl_c

    config = configs_from_namespace(args)
    try:
        with sigterm_as_ctrl_c():
            train(**config._asdict())
    except KeyboardInterrupt:  # Ctrl-C or `kill PID`: say what is kept and how to go on
        from ..training.records import last_complete_checkpoint

        out = config.training_args.output_dir
        last = last_complete_checkpoint(out) if out else None
        print(f"interrupted: {'the last complete checkpoint is ' + last if last else 'no checkpoint was saved yet'}"
              + ("; continue with the same command plus --resume-from-checkpoint last" if last else ""),
              file=sys.stderr)
        return 130
    finally:
        _close_process_group()
    return 0


def _close_process_group() -> None:
    """Under torchrun / accelerate: every rank leaves the process group before the interpreter exits (a gloo group
    torn down at exit can abort a rank with "terminate called without an active exception" once its work is done)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
