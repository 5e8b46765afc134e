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

from dflash2_cli.arguments import add_export_data_arguments as add_arguments  # noqa: F401 (the options: torch-free)


def run(args: argparse.Namespace) -> int:
    from ..data.legacy import convert_jsonl_folder

    result = convert_jsonl_folder(args.data, args.output_dir, split=args.split)
    print(json.dumps(result, indent=2))
    return 0
