"""Append regenerated data to a committed, Hub-style dataset folder (Parquet shards + dataset card).

Copies the records of a `dflash2 prepare-data --output-dir` folder that the dataset folder does not hold yet into one new
Parquet shard (earlier shards are never rewritten, so git and the Hub only ever receive new files), and rewrites the
card (README.md) and dflash2_dataset.json. Safe while prepare-data is still writing. Format: dflash2_hf.data.hub_dataset.

Example:
  dflash2 export-data --data data/smollm2-sharegpt-mt --output-dir dataset_cards/smollm2-sharegpt-regenerated
"""

from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", required=True, help="a dflash2 prepare-data --output-dir folder")
    parser.add_argument("--output-dir", required=True, help="the dataset folder (created if missing)")
    parser.add_argument("--split", default="train", choices=["train", "dev"],
                        help="train: ShareGPT [0, 16000); dev: [16000, 17000)")


def run(args: argparse.Namespace) -> int:
    from ..data.hub_dataset import export_prepared

    result = export_prepared(args.data, args.output_dir, split=args.split)
    print(json.dumps(result, indent=2))
    return 0
