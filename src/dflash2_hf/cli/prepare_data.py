"""Regenerate ShareGPT assistant turns with the target (training data for the drafter).

Renders ShareGPT V3 conversations with the target's chat template, lets the target write the assistant turns
itself (greedy, batched), and writes a Hub-style dataset folder to --output-dir: Parquet shards under data/, each
written atomically once it holds --shard-size conversations, plus dflash2_dataset.json and a README card (format:
dflash2_hf.data.prepared). Rerun the same command to resume after an interruption (it continues after the last
complete shard), or with a larger --stop to add records. Under torchrun every rank regenerates its own slice into
its own shards.

Example:
  dflash2 prepare-data --target smollm2 --output-dir data/smollm2-sharegpt --start 0 --stop 16000 \\
      --batch-size 8 --max-new-tokens 256 --num-threads 2
  torchrun --nproc_per_node 4 $(which dflash2) prepare-data --target smollm2 --output-dir data/smollm2-sharegpt ...
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from dflash2_cli.arguments import GENERATION_DTYPES as _DTYPES
from dflash2_cli.arguments import add_prepare_data_arguments as add_arguments  # noqa: F401 (the options: torch-free)

from . import resolve_device, sigterm_as_ctrl_c


def _torchrun_device(device):
    """Under torchrun, rank ``LOCAL_RANK``'s own GPU for a plain ``cuda`` device; starts a gloo process group (for
    the final barrier, so rank 0's card counts every rank's shards) when none is. -> (device, whether to end it)."""
    import os

    import torch
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", 1)) <= 1 or not dist.is_available():
        return device, False
    if device.type == "cuda" and device.index is None and "LOCAL_RANK" in os.environ:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    if dist.is_initialized():
        return device, False
    dist.init_process_group("gloo")
    return device, True


def record_range(args: argparse.Namespace) -> tuple[int, int]:
    """``(start, stop)`` of ``--start/--stop``, each defaulting to the ``--split``'s ShareGPT range (train [0, 16000),
    dev [16000, 17000)) or, with ``--source``, to [0, 16000).

    Raises:
        ValueError: ``start >= stop``, or a range reaching into the held-out records (the message names the option).
    """
    from ..data.sharegpt import DEV_RANGE, HELDOUT_START, TRAIN_RANGE

    lo, hi = DEV_RANGE if args.split == "dev" and args.source is None else TRAIN_RANGE
    start = lo if args.start is None else args.start
    stop = hi if args.stop is None else args.stop
    if start >= stop:
        raise ValueError(f"--start ({start}) must be < --stop ({stop})")
    if stop > HELDOUT_START:
        raise ValueError(f"--stop {stop}: records from {HELDOUT_START} on are held out for the final evaluation "
                         "(DESIGN.md section 7), so the command line never reads them (there is no option for it: data "
                         f"made from them would leak into the measurements); use --stop {HELDOUT_START} or less")
    return start, stop


def run(args: argparse.Namespace) -> int:
    import torch

    from ..data.folder import folder_progress

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args.start, args.stop = record_range(args)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    device, own_group = _torchrun_device(resolve_device(args.device))
    try:
        with sigterm_as_ctrl_c():
            return _run(args, device)
    except KeyboardInterrupt:
        shards, records = folder_progress(args.output_dir)
        print(f"interrupted: {shards} complete shard(s) ({records} records) kept in {args.output_dir}; rerun the same "
              "command to continue", file=sys.stderr)
        return 130
    finally:
        if own_group:
            torch.distributed.destroy_process_group()


def _settings(args: argparse.Namespace) -> dict:
    """The provenance values (dotted keys) a regeneration with ``args`` writes that are known before the target
    loads: a folder made with the same ones and holding every record of the range has nothing left to do."""
    from pathlib import Path

    from ..data.hub_dataset import source_sha256
    from ..data.sharegpt import SHAREGPT_FILE

    source = {"source.sha256": source_sha256(args.source)} if args.source and os.path.isfile(args.source) else {}
    return {**source, "target.name": args.target, "target.dtype": _DTYPES[args.dtype],
            "generation.max_new_tokens": args.max_new_tokens, "generation.max_prompt_tokens": args.max_prompt_tokens,
            "generation.max_turns": args.max_turns, "source.dataset": Path(args.source).name if args.source else SHAREGPT_FILE,
            "source.filter": "code" if args.only_code else {}}


def _run(args: argparse.Namespace, device) -> int:
    import torch

    from ..data.folder import nothing_left
    from ..data.regenerate import prepare_data
    from ..targets import load_target

    if not args.original_answers and nothing_left(args.output_dir, args.start, args.stop, _settings(args)):
        print(f"nothing left to do: {args.output_dir} already holds every record of [{args.start}, {args.stop}) "
              "with these settings (a larger --stop adds records)", file=sys.stderr)
        return 0
    if args.source:  # a missing file or one of another format: refused before the target loads
        from ..data.regenerate import check_source_file

        check_source_file(args.source)
    fresh = not os.path.exists(args.output_dir) or not os.listdir(args.output_dir)
    dtype = getattr(torch, _DTYPES[args.dtype])
    model, tokenizer = load_target(args.target, dtype=dtype, device=device)
    if args.original_answers:
        from ..data.original import prepare_original

        counts = prepare_original(model, tokenizer, args.output_dir, start=args.start, stop=args.stop,
                                  max_tokens=args.max_prompt_tokens, target_name=args.target, source_path=args.source,
                                  shard_size=args.shard_size, split=args.split)
        print(json.dumps(counts, indent=2, default=str))
        if not counts.get("kept"):
            _remove_if_fresh(args.output_dir, fresh)
        return 0 if counts.get("kept") else 1
    note = args.note
    if dtype != torch.float32 and not note:
        note = f"generated in {args.dtype}: greedy output can differ from float32 serving"
    counts = prepare_data(model, tokenizer, args.output_dir, start=args.start, stop=args.stop, max_turns=args.max_turns,
                          max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_new_tokens,
                          batch_size=args.batch_size, target_name=args.target, shard_size=args.shard_size,
                          split=args.split, sort_window=args.sort_window, num_threads=args.num_threads, max_batches=args.max_batches,
                          progress=not args.no_progress, note=note,
                          cache_implementation=None if args.cache_implementation == "dynamic" else "static",
                          record_filter="code" if args.only_code else None, source_path=args.source,
                          skip_records_in=args.skip_records_in)
    print(json.dumps(counts, indent=2, default=str))
    if not counts.get("kept"):
        skipped = dict(counts.get("skipped") or {})
        print(f"dflash2 prepare-data: error: no conversation kept (skipped: {skipped}). Turns need \"from\": "
              "human/user, gpt/assistant or system and a string \"value\" (or chat-style \"messages\" with \"role\" and "
              "\"content\"); see `dflash2 prepare-data --help`" + _remove_if_fresh(args.output_dir, fresh),
              file=sys.stderr)
        return 1
    return 0


def _remove_if_fresh(output_dir: str, fresh: bool) -> str:
    """Removes the folder a run that kept nothing created (a rerun with fixed input would otherwise find every record
    "done" there); returns what to tell the user."""
    if not fresh:
        return ""
    import shutil

    shutil.rmtree(output_dir, ignore_errors=True)
    return f"; {output_dir} was not kept, so a rerun with fixed input starts afresh"
