"""Convert a JSONL folder of an older prepare-data into a Hub-style dataset folder (Parquet shards + dataset card).

prepare-data writes dataset folders directly now; this command is only for folders an older version wrote
(meta.json + shard-*.jsonl): it copies their records that the dataset folder does not hold yet into one new Parquet
shard and rewrites the card (README.md) and dflash2_dataset.json. Format: dflash2_hf.data.prepared.

Example:
  dflash2 export-data --data data/old-jsonl-folder --output-dir data/smollm2-sharegpt
"""

from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", required=True, help="a JSONL folder of an older `dflash2 prepare-data`")
    parser.add_argument("--output-dir", required=True, help="the dataset folder (created if missing)")
    parser.add_argument("--split", default="train", choices=["train", "dev"],
                        help="train: ShareGPT [0, 16000); dev: [16000, 17000)")


def run(args: argparse.Namespace) -> int:
    from ..data.legacy import convert_jsonl_folder

    result = convert_jsonl_folder(args.data, args.output_dir, split=args.split)
    print(json.dumps(result, indent=2))
    return 0
