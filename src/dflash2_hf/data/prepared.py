"""Reading regenerated training data: the Hub-style dataset folder that ``dflash2 prepare-data`` writes.

Layout (``dataset_dir``)::

    README.md                       dataset card (YAML header with ``configs`` so ``datasets.load_dataset(dir)``
                                    reads the splits; provenance, settings, counts, shard table, license)
    dflash2_dataset.json            format name/version, the generation provenance shared by all shards (target,
                                    chat template and its sha256, generation settings, source file), one entry per
                                    shard, the folder's counts, status and the runs that wrote it
    data/<split>-<NNNNN>.parquet    one complete shard (``<split>-r<rank>-<NNNNN>.parquet`` when written by a rank of
                                    a ``torchrun`` regeneration). Columns: record_id int64, source_id string,
                                    input_ids list<int32> (the whole conversation as the target saw it),
                                    response_spans list<list<int32>> (half-open [start, end) ranges of the
                                    regenerated responses in input_ids, each ending with the end-of-turn token
                                    unless truncated), num_response_tokens int32, num_turns int32, truncated bool.
                                    The file's key-value metadata ``dflash2`` (JSON) holds its counts and the record
                                    ids skipped while it filled (so a resumed run does not retry them).

A shard appears in ``data/`` only complete (written under a hidden temporary name, fsynced, renamed): a reader - a
training run with ``--follow-data`` included - never sees a partial one, so it can read the folder while
``prepare-data`` is still writing it. Shard entries of folders written by ``dflash2 export-data`` before shards carried
their own metadata are read from ``dflash2_dataset.json``.

Reading: :func:`load_prepared` (the ``train`` split) and :func:`load_dataset_folder` (any split) validate every row
(keys, ints, spans inside ``input_ids``, token ids < the target's vocab size, no repeated ``record_id``).
``datasets.load_dataset(dataset_dir)`` reads the same files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

DATASET_FORMAT = "dflash2-regenerated-chat-parquet"
DATASET_FORMAT_VERSION = 1
DATASET_META = "dflash2_dataset.json"
SPLITS = ("train", "dev")
SHARD_INFO_KEY = b"dflash2"  # Parquet key-value metadata of a shard: its counts and skipped record ids (JSON)


class PreparedDataError(ValueError):
    """A dataset folder is corrupt, inconsistent or of an old format (the message names the file and the fix)."""


def validate_record(rec, vocab_size: int | None = None) -> str | None:
    """Why ``rec`` is not a valid record (None if it is): see the column list of the module docstring."""
    if not isinstance(rec, dict):
        return "not a JSON object"
    for key in ("record_id", "input_ids", "response_spans", "num_response_tokens"):
        if key not in rec:
            return f"missing key {key!r}"
    if not isinstance(rec["record_id"], int):
        return "record_id is not an int"
    ids = rec["input_ids"]
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
        return "input_ids is not a non-empty list of non-negative ints"
    if vocab_size is not None and max(ids) >= vocab_size:
        return f"token id {max(ids)} >= vocab size {vocab_size}"
    spans = rec["response_spans"]
    if not isinstance(spans, list):
        return "response_spans is not a list"
    total, prev_end = 0, 0
    for span in spans:
        if (not isinstance(span, list) or len(span) != 2 or not all(isinstance(x, int) for x in span)
                or not prev_end <= span[0] < span[1] <= len(ids)):
            return f"bad response span {span!r} (input length {len(ids)})"
        total += span[1] - span[0]
        prev_end = span[1]
    if rec["num_response_tokens"] != total:
        return f"num_response_tokens {rec['num_response_tokens']} != span total {total}"
    return None


def get_dotted(d: dict, dotted: str):
    """``d["a"]["b"]`` for ``"a.b"``; ``{}`` where a key is missing."""
    for k in dotted.split("."):
        d = d.get(k, {}) if isinstance(d, dict) else {}
    return d


def is_legacy_folder(path: str | os.PathLike) -> bool:
    """True for a JSONL folder of an older ``prepare-data`` (``meta.json`` + ``shard-*.jsonl``)."""
    p = Path(path)
    return (p / "meta.json").is_file() and not (p / DATASET_META).is_file()


def refuse_legacy(path: str | os.PathLike) -> None:
    """Raises PreparedDataError naming the converter when ``path`` is an old JSONL folder."""
    if is_legacy_folder(path):
        raise PreparedDataError(
            f"{path} is a JSONL folder of an older `dflash2 prepare-data` (meta.json + shard-*.jsonl), a format "
            f"that is no longer read. Convert it once: `dflash2 export-data --data {path} --output-dir NEW_FOLDER` "
            "(then use NEW_FOLDER; prepare-data continues it too)")


def is_dataset_folder(path: str | os.PathLike) -> bool:
    """True when ``path`` holds ``dflash2_dataset.json`` (a folder of ``prepare-data`` or ``export-data``)."""
    return (Path(path) / DATASET_META).is_file()


def read_dataset_meta(dataset_dir: str | os.PathLike) -> dict:
    """``dflash2_dataset.json`` of a dataset folder.

    Raises:
        FileNotFoundError: not a dataset folder (the message says how to make one).
        PreparedDataError: an old JSONL folder, or the file is not valid JSON of this format.
    """
    refuse_legacy(dataset_dir)
    path = Path(dataset_dir) / DATASET_META
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {dataset_dir} is not a dataset folder (make one with "
                                "`dflash2 prepare-data --output-dir ...`)")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise PreparedDataError(f"{path} is not valid JSON ({err}); restore it from git "
                                f"(`git checkout -- {path}`)") from None
    if not isinstance(meta, dict) or meta.get("format") != DATASET_FORMAT:
        raise PreparedDataError(f"{path}: format {meta.get('format') if isinstance(meta, dict) else None!r}, "
                                f"expected {DATASET_FORMAT!r}")
    return meta


def read_meta(dataset_dir: str | os.PathLike) -> dict:
    """The generation provenance of a dataset folder (target, tokenizer, chat_template, generation, source).

    Raises:
        FileNotFoundError / PreparedDataError: as :func:`read_dataset_meta`.
    """
    return read_dataset_meta(dataset_dir)["provenance"]


def shard_files(dataset_dir: str | os.PathLike, split: str | None = None) -> list[Path]:
    """The complete shards of ``split`` (all splits: None), sorted by name; temporary files are never listed."""
    pattern = f"{split}-*.parquet" if split else "*.parquet"
    return sorted(p for p in (Path(dataset_dir) / "data").glob(pattern) if not p.name.startswith("."))


def shard_info(path: Path) -> dict | None:
    """The ``dflash2`` key-value metadata of a shard (None for shards written before shards carried it)."""
    import pyarrow.parquet as pq

    kv = pq.read_schema(path).metadata or {}
    return json.loads(kv[SHARD_INFO_KEY]) if SHARD_INFO_KEY in kv else None


def shard_entries(dataset_dir: str | os.PathLike, meta: dict | None = None) -> list[dict]:
    """One entry per complete shard (``file``, ``split``, ``records``, ``skipped_record_ids``, counts, ...): from the
    shard's own metadata, else from the ``shards`` list of ``dflash2_dataset.json`` (older folders)."""
    root = Path(dataset_dir)
    listed = {s["file"]: s for s in (meta or {}).get("shards", [])}
    entries = []
    for path in shard_files(root):
        rel = f"data/{path.name}"
        info = shard_info(path) if rel not in listed else None
        if info is None and rel not in listed:
            raise PreparedDataError(f"{path} carries no dflash2 metadata and is not listed in {root / DATASET_META}; "
                                    "it is not a shard of this folder: move it out of data/")
        entries.append(listed[rel] if info is None else {"file": rel, **info, "bytes": path.stat().st_size})
    return entries


def load_dataset_folder(dataset_dir: str | os.PathLike, split: str = "train") -> list[dict]:
    """Records of one split of a dataset folder (its complete shards), validated, sorted by ``record_id``.

    Returns:
        dicts with keys ``record_id`` int, ``source_id`` str or None, ``input_ids`` list[int], ``response_spans``
        list[[int, int]], ``num_response_tokens`` int, ``num_turns`` int, ``truncated`` bool.

    Raises:
        FileNotFoundError: not a dataset folder, or a shard listed in ``dflash2_dataset.json`` is missing.
        PreparedDataError: an old JSONL folder, a shard is not readable Parquet, a row is invalid, or a record id
            repeats.
    """
    import pyarrow.parquet as pq

    root = Path(dataset_dir)
    meta = read_dataset_meta(root)
    vocab = get_dotted(meta["provenance"], "target.vocab_size") or None
    for s in meta.get("shards", []):
        if s["split"] == split and not (root / s["file"]).is_file():
            raise FileNotFoundError(f"{root / s['file']} is listed in {root / DATASET_META} but missing; restore it "
                                    "from git, or rerun `dflash2 prepare-data` with the folder's settings (it "
                                    "regenerates the shard's records and rewrites the list)")
    recs, seen = [], {}
    for path in shard_files(root, split):
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as err:  # pyarrow raises several types for truncated / foreign files
            raise PreparedDataError(f"{path} is not a readable Parquet file ({err}); restore it from git "
                                    f"(`git checkout -- {path}`) or delete it (prepare-data regenerates it)") from None
        for i, rec in enumerate(rows):
            problem = validate_record(rec, vocab)
            if problem is None and rec["record_id"] in seen:
                problem = f"record_id {rec['record_id']} is already in {seen[rec['record_id']]}"
            if problem is not None:
                raise PreparedDataError(f"{path}, row {i}: {problem}; restore the file from git or delete it")
            seen[rec["record_id"]] = path.name
            recs.append(rec)
    recs.sort(key=lambda r: r["record_id"])
    return recs


def load_prepared(dataset_dir: str | os.PathLike, as_dataset: bool = False):
    """The ``train`` split of a dataset folder (see :func:`load_dataset_folder`), sorted by ``record_id``.

    Returns:
        a list of dicts, or a ``datasets.Dataset`` with those columns when ``as_dataset``.

    Raises:
        FileNotFoundError / PreparedDataError: as :func:`load_dataset_folder`.
    """
    recs = load_dataset_folder(dataset_dir, split="train")
    if as_dataset:
        import datasets

        return datasets.Dataset.from_list(recs)
    return recs


def done_record_ids(dataset_dir: str | os.PathLike) -> set[int]:
    """Record ids a dataset folder holds in a complete shard or skipped (any split; also before rank 0 wrote
    ``dflash2_dataset.json``): a resumed regeneration does not redo them."""
    import pyarrow.parquet as pq

    root = Path(dataset_dir)
    ids: set[int] = set()
    for entry in shard_entries(root, read_dataset_meta(root) if is_dataset_folder(root) else None):
        ids.update(int(i) for i in entry.get("skipped_record_ids", []))
        ids.update(pq.read_table(root / entry["file"], columns=["record_id"]).column(0).to_pylist())
    return ids


def response_mask(record: dict) -> list[int]:
    """0/1 list as long as ``record["input_ids"]``: 1 on regenerated response tokens (loss positions)."""
    mask = [0] * len(record["input_ids"])
    for s, e in record["response_spans"]:
        mask[s:e] = [1] * (e - s)
    return mask


__all__ = ["PreparedDataError", "load_prepared", "load_dataset_folder", "read_meta", "read_dataset_meta",
           "is_dataset_folder", "shard_files", "shard_entries", "done_record_ids", "response_mask",
           "DATASET_FORMAT", "DATASET_META", "SPLITS"]
