"""One-time conversion of a JSONL folder written by an older ``dflash2 prepare-data`` (``meta.json``,
``shard-*.jsonl``, ``skipped.jsonl``) into a dataset folder (``dflash2 export-data``; format: :mod:`.prepared`)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from .folder import RegenerationFolder
from .hub_dataset import check_split_range, provenance
from .prepared import PreparedDataError, get_dotted, is_legacy_folder, validate_record

logger = logging.getLogger(__name__)


def _read_jsonl(path: Path) -> list[dict]:
    """The objects of a JSONL file; an undecodable LAST line (a write cut by a kill) is ignored with a warning."""
    lines = [line for line in path.read_bytes().split(b"\n") if line.strip()]
    out = []
    for i, raw in enumerate(lines):
        try:
            out.append(json.loads(raw))
        except ValueError:
            if i == len(lines) - 1:
                logger.warning("%s: torn last line ignored (left by an interrupted run)", path)
                continue
            raise PreparedDataError(f"{path}, line {i + 1}: not valid JSON; delete the file (its records are lost "
                                    "to the conversion) or regenerate") from None
    return out


def convert_jsonl_folder(jsonl_dir: str | os.PathLike, dataset_dir: str | os.PathLike, split: str = "train") -> dict:
    """Adds the records of an old JSONL folder that ``dataset_dir`` lacks to it, as one new shard.

    Args:
        jsonl_dir: a folder of an older ``prepare-data`` (``meta.json`` + ``shard-*.jsonl``).
        dataset_dir: the dataset folder (created when missing; else it must have the same settings).
        split: ``"train"`` or ``"dev"`` (packaged ShareGPT: train [0, 16000), dev [16000, 17000)).

    Returns:
        ``{"new_records": int, "total_records": int}``.

    Raises:
        ValueError: ``jsonl_dir`` is not such a folder, records lie outside the split's range, or the dataset folder
            holds data made with other settings.
        PreparedDataError: a corrupt line (not the last) or an invalid record.
    """
    src = Path(jsonl_dir)
    if not is_legacy_folder(src):
        raise ValueError(f"{src} is not a JSONL folder of an older `dflash2 prepare-data` (no meta.json); folders of "
                         "the current prepare-data are dataset folders already")
    old = json.loads((src / "meta.json").read_text(encoding="utf-8"))
    prov, vocab = provenance(old), get_dotted(old, "target.vocab_size") or None
    records = []
    for shard in sorted(src.glob("shard-*.jsonl")):
        for i, rec in enumerate(_read_jsonl(shard)):
            problem = validate_record(rec, vocab)
            if problem is not None:
                raise PreparedDataError(f"{shard}, record {i + 1}: {problem}")
            records.append(rec)
    skipped = _read_jsonl(src / "skipped.jsonl") if (src / "skipped.jsonl").is_file() else []
    ids = [r["record_id"] for r in records]
    if ids:
        check_split_range(split, prov.get("source", {}), min(ids), max(ids) + 1)
    folder = RegenerationFolder(dataset_dir, prov, split, max(len(records), 1),
                                get_dotted(old, "source.record_range") or None)
    new = [r for r in {r["record_id"]: r for r in records}.values() if r["record_id"] not in folder.done]
    for s in skipped:
        if s["record_id"] not in folder.done:
            folder.writer.skip(s["record_id"], s["reason"])
    for rec in new:
        folder.writer.add(rec)
    counts = folder.finish(old.get("status") == "complete")
    return {"new_records": len(new), "total_records": counts["kept"]}


__all__ = ["convert_jsonl_folder"]
