"""A dataset folder opened by one rank of a data-preparation run: the settings check, what is already done, the
shard writer and the metadata updates (used by :func:`~.regenerate.prepare_data`,
:func:`~.original.prepare_original` and the one-time JSONL conversion of :mod:`.legacy`)."""

from __future__ import annotations

import logging
import os
import platform
import time
import uuid
from pathlib import Path
from typing import Iterable

from .hub_dataset import check_same_provenance, folder_counts, write_folder_meta
from .prepared import (DATASET_META, done_record_ids, get_dotted, is_dataset_folder, read_dataset_meta, read_meta,
                       refuse_legacy, shard_files)
from .shards import ShardWriter, rank_and_world_size

logger = logging.getLogger(__name__)


class RegenerationFolder:
    """Opens ``dataset_dir`` for this process's rank (see :func:`~.shards.rank_and_world_size`).

    Args:
        dataset_dir: the folder (created when missing).
        prov: the run's provenance (:func:`~.hub_dataset.provenance`); an existing folder must have the same
            settings.
        split, shard_size: as :class:`~.shards.ShardWriter`.
        record_range: the ``[start, stop)`` asked for.
        skip_records_in: other dataset folders (same settings) whose records count as done.

    Attributes:
        rank, world_size: this process's place in the job.
        done: record ids held or skipped by the complete shards of the folder (all ranks) and ``skip_records_in``.
        writer: the :class:`~.shards.ShardWriter` to add records / skips to.
        run: this run's record in ``dflash2_dataset.json`` (add fields to it; rank 0 writes it with every shard).

    Raises:
        ValueError: the folder (or a ``skip_records_in`` folder) holds data made with other settings, or files that
            are no dataset.
        PreparedDataError: ``dataset_dir`` is a JSONL folder of an older version.
    """

    def __init__(self, dataset_dir: str | os.PathLike, prov: dict, split: str, shard_size: int,
                 record_range: list | None = None, skip_records_in: Iterable[str | os.PathLike] = ()):
        self.root = Path(dataset_dir)
        refuse_legacy(self.root)
        self.rank, self.world_size = rank_and_world_size()
        if is_dataset_folder(self.root):
            check_same_provenance(read_meta(self.root), prov, self.root)
        elif self.root.is_dir() and (names := sorted(  # what a dataset folder holds itself (another rank's start)
                p.name for p in self.root.iterdir() if p.name not in ("data", "README.md", DATASET_META)
                and not p.name.startswith("."))):
            raise ValueError(f"{self.root} holds files that are no dflash2 dataset ({', '.join(names[:5])}"
                             f"{', ...' if len(names) > 5 else ''}): write to a new or empty --output-dir")
        self.done = done_record_ids(self.root)
        if self.done and self.rank == 0:
            logger.info("resuming: %d records already in %d shards", len(self.done), len(shard_files(self.root)))
        for other in skip_records_in:
            check_same_provenance(read_meta(other), prov, other)
            self.done |= done_record_ids(other)
        self.prov = prov
        self.run = {"id": f"{time.strftime('%Y%m%dT%H%M%S')}-{platform.node()}-{uuid.uuid4().hex[:8]}",
                    "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "record_range": record_range, "split": split,
                    "resumed_with": len(self.done), "world_size": self.world_size,
                    "python": platform.python_version(), "host": platform.node()}
        self.root.mkdir(parents=True, exist_ok=True)
        self.writer = ShardWriter(self.root, split, shard_size, self.rank, self.world_size, record_range,
                                  on_shard=lambda _path: self._write_meta("running"))
        self._write_meta("running")

    def _write_meta(self, status: str) -> dict | None:
        if self.rank != 0:
            return None
        self.run["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        return write_folder_meta(self.root, self.prov, status, self.run)

    def interrupted(self) -> None:
        """Marks the folder ``interrupted`` (rank 0) after a Ctrl-C: its complete shards stay, the shard being filled
        is dropped, and rerunning the same command continues after them."""
        self._write_meta("interrupted")

    def finish(self, complete: bool) -> dict:
        """Writes the last shard, waits for the other ranks (when ``torch.distributed`` is initialised), and returns
        the folder's counts (rank 0 rewrites the metadata and card with ``status`` complete / incomplete)."""
        import torch.distributed as dist

        self.writer.close()
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        meta = self._write_meta("complete" if complete else "incomplete")
        return meta["counts"] if meta is not None else folder_counts(self.root)


def folder_progress(dataset_dir: str | os.PathLike) -> tuple[int, int]:
    """``(complete shards, records they hold)`` of a dataset folder: what an interrupted run keeps; (0, 0) when the
    folder holds none."""
    root = Path(dataset_dir)
    if not (root / "data").is_dir():
        return 0, 0
    return len(shard_files(root)), folder_counts(root)["kept"]


def nothing_left(dataset_dir: str | os.PathLike, start: int, stop: int, settings: dict) -> bool:
    """Whether a run over records ``[start, stop)`` would find every one of them (those of this rank under
    torchrun) already held or skipped in ``dataset_dir``, made with ``settings`` (dotted provenance keys ->
    values, e.g. ``{"generation.max_new_tokens": 256}``): then it can stop before loading the target. False when
    any of ``settings`` differs (the run itself then names the option)."""
    root = Path(dataset_dir)
    if not is_dataset_folder(root):
        return False
    prov = read_dataset_meta(root)["provenance"]
    if any(get_dotted(prov, k) != v for k, v in settings.items()):
        return False
    rank, world_size = rank_and_world_size()
    done = done_record_ids(root)
    return all(i in done for i in range(start, stop) if i % world_size == rank)


__all__ = ["RegenerationFolder", "folder_progress", "nothing_left"]
