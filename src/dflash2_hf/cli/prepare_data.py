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
import sys

from . import add_device_argument, non_negative_int, positive_int, resolve_device

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="smollm2",
                        help="target alias (smollm2, gemma3-270m) or a local transformers folder (default: smollm2)")
    parser.add_argument("--output-dir", required=True,
                        help="the dataset folder (continued if it already holds data of the same settings)")
    parser.add_argument("--split", default="train", choices=["train", "dev"],
                        help="split the shards belong to (default train; dev: evaluation data, e.g. ShareGPT "
                             "[16000, 17000) or a validation --source)")
    parser.add_argument("--source", default=None,
                        help="a ShareGPT-format JSON array file (your own conversations: a list of {\"id\", "
                             "\"conversations\": [{\"from\": \"human\"|\"gpt\"|\"system\", \"value\"}]}) instead of the "
                             "packaged ShareGPT; chat-style records {\"messages\": [{\"role\", \"content\"}]} work too; record ids "
                             "are the indexes in the array")
    parser.add_argument("--start", type=non_negative_int, default=None,
                        help="first record (default: the split's first: train 0, dev 16000; with --source 0)")
    parser.add_argument("--stop", type=positive_int, default=None,
                        help="end of the record range, exclusive (default: the split's end: train 16000, dev 17000; "
                             "with --source 16000). Records from 17000 on are held out: never read from here")
    parser.add_argument("--batch-size", type=positive_int, default=8)
    parser.add_argument("--max-new-tokens", type=positive_int, default=256, help="cap per regenerated assistant turn")
    parser.add_argument("--max-prompt-tokens", type=positive_int, default=512,
                        help="records with a longer first prompt are skipped (default 512)")
    parser.add_argument("--max-turns", type=positive_int, default=1, help="assistant turns regenerated per conversation")
    parser.add_argument("--dtype", default="float32", choices=sorted(_DTYPES),
                        help="target dtype while generating (default float32: bf16 is faster but its greedy output "
                             "differs from fp32 serving)")
    parser.add_argument("--num-threads", type=positive_int, default=None, help="torch CPU threads")
    parser.add_argument("--shard-size", type=positive_int, default=256,
                        help="conversations per Parquet shard (default 256); a shard is written once complete, so an "
                             "interruption loses at most the one being filled")
    parser.add_argument("--sort-window", type=positive_int, default=8,
                        help="batches' worth of records read ahead and sorted by length (less padding)")
    parser.add_argument("--max-batches", type=positive_int, default=None, help="stop after N batches (benchmarking)")
    parser.add_argument("--cache-implementation", default="static", choices=["static", "dynamic"],
                        help="KV cache used by generate (static: default, ~1.8x faster on CPU, same tokens)")
    parser.add_argument("--only-code", action="store_true",
                        help="keep only conversations whose first human turn or its original answer holds a fenced "
                             "code block (a code-domain set, e.g. for a LoRA adapter); others are skipped as "
                             "filtered_out")
    parser.add_argument("--skip-records-in", action="append", default=[], metavar="DATASET",
                        help="another dataset folder of the same settings (e.g. a committed one): its records, kept or "
                             "skipped, are not regenerated again (repeatable)")
    parser.add_argument("--original-answers", action="store_true",
                        help="keep ShareGPT's own assistant turns instead of regenerating them (no generation: seconds "
                             "for thousands of records); conversations are cut at --max-prompt-tokens tokens. Train on "
                             "them with `dflash2 train --target-labels` (labels = the target's own greedy tokens)")
    parser.add_argument("--note", default=None, help="free text stored in the folder's provenance and card")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    add_device_argument(parser, "the target's regeneration")


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

    from ..data.sharegpt import SHAREGPT_FILE

    return {"target.name": args.target, "target.dtype": _DTYPES[args.dtype],
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
    dtype = getattr(torch, _DTYPES[args.dtype])
    model, tokenizer = load_target(args.target, dtype=dtype, device=device)
    if args.original_answers:
        from ..data.original import prepare_original

        counts = prepare_original(model, tokenizer, args.output_dir, start=args.start, stop=args.stop,
                                  max_tokens=args.max_prompt_tokens, target_name=args.target, source_path=args.source,
                                  shard_size=args.shard_size, split=args.split)
        print(json.dumps(counts, indent=2, default=str))
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
              "\"content\"); see `dflash2 prepare-data --help`",
              file=sys.stderr)
        return 1
    return 0
