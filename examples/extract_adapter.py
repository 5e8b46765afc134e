"""A LoRA adapter from a full fine-tune: ``dflash2_hf.lora.extract_adapter`` from the command line.

    python examples/extract_adapter.py --base model_cards/dflash2-smollm2-135m-instruct --finetuned runs/ub-fullft2 \\
        --out runs/x-ub2-r32 --r 32 --alpha 64 --modules-to-save small --dtype bf16

Each LoRA target's update (finetuned - base) is cut to rank ``--r`` (truncated SVD); the ``--modules-to-save`` are
copied in full. Writes the adapter (``save_adapter``: adapter files + the base fingerprint) and ``extraction.json``:
this command, the adapter's share of the base drafter, and the fine-tune's provenance (its ``train_command.json``
and those of the runs it started from, followed through ``--init``), which ``examples/ship_adapter.py`` puts on the
card. Measure the adapter with ``dflash2 bench --drafter BASE --adapter OUT``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from dflash2_hf import CheckpointError, DFlash2DraftModel
from dflash2_hf.lora import (
    AdapterMismatchError,
    DEFAULT_TARGET_MODULES,
    SMALL_MODULES,
    adapter_size_bytes,
    checkpoint_size_bytes,
    extract_adapter,
    lora_config,
    save_adapter,
)


def training_chain(finetuned: Path) -> list[dict]:
    """``train_command.json`` of ``finetuned`` and of every local ``--init`` before it, oldest first."""
    chain, folder = [], finetuned
    while folder is not None and (folder / "train_command.json").is_file():
        record = json.loads((folder / "train_command.json").read_text())
        summary = folder / "training_summary.json"
        wall = json.loads(summary.read_text()).get("wall_s") if summary.is_file() else None
        chain.append({"output": str(folder), "argv": record["argv"], "threads": record.get("threads"), "wall_s": wall})
        init = record.get("args", {}).get("init")
        folder = Path(init) if init and Path(init).is_dir() and Path(init) != folder else None
    return chain[::-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the drafter the fine-tune started from (the adapter's base)")
    parser.add_argument("--finetuned", required=True, help="the fully fine-tuned drafter (dflash2 train --output-dir)")
    parser.add_argument("--out", required=True, help="folder for the adapter (created)")
    parser.add_argument("--r", type=int, default=32, help="LoRA rank of every target (size: see the printed share)")
    parser.add_argument("--alpha", type=int, default=64, help="lora_alpha (the factors are scaled to match it)")
    parser.add_argument("--target-modules", default=",".join(DEFAULT_TARGET_MODULES + ["fc"]),
                        help="modules that get LoRA factors (default: the projections AND fc, whose update a full "
                             "fine-tune moves; `dflash2 train --lora` leaves fc out unless named)")
    parser.add_argument("--modules-to-save", default="small",
                        help="comma-separated names copied in full; 'small' = dflash2_hf.lora.SMALL_MODULES; '' = none")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16", help="precision of the stored adapter")
    args = parser.parse_args()
    full = SMALL_MODULES if args.modules_to_save == "small" else [m for m in args.modules_to_save.split(",") if m]
    for flag, folder in (("--base", args.base), ("--finetuned", args.finetuned)):
        if Path(folder, "adapter_config.json").is_file():
            parser.error(f"{flag} {folder} is a LoRA adapter; pass a drafter folder (config.json + model.safetensors)")
    try:
        base = DFlash2DraftModel.from_pretrained(args.base, dtype=torch.float32)
        finetuned = DFlash2DraftModel.from_pretrained(args.finetuned, dtype=torch.float32)
    except (OSError, CheckpointError, ValueError) as err:
        parser.error(str(err))
    base_params = sum(p.numel() for p in base.parameters())  # before peft wraps it in place
    config = lora_config(args.r, args.alpha, 0.0, args.target_modules.split(","), full)
    try:
        model = extract_adapter(base, finetuned, config)
    except AdapterMismatchError as err:
        parser.error(str(err))
    save_adapter(model, args.out, dtype=torch.bfloat16 if args.dtype == "bf16" else None)
    size, base_size = adapter_size_bytes(args.out), checkpoint_size_bytes(args.base)
    params = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n or ".modules_to_save." in n)
    record = {
        "argv": ["python", *sys.argv], "adapter_bytes": size, "base_bytes": base_size,
        "adapter_parameters": params, "base_parameters": base_params,
        "finetune": training_chain(Path(args.finetuned)),
    }
    Path(args.out, "extraction.json").write_text(json.dumps(record, indent=2))
    print(f"adapter: {size / 1e6:.2f} MB = {100 * size / base_size:.1f}% of the base drafter's {base_size / 1e6:.1f} MB; "
          f"{params / 1e6:.2f}M parameters = {100 * params / base_params:.1f}% of its {base_params / 1e6:.1f}M -> {args.out}")


if __name__ == "__main__":
    main()
