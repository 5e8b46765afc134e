"""Writing a dataset folder's Parquet shards atomically, one rank at a time (format: :mod:`.prepared`).

:class:`ShardWriter` collects records and writes a shard once it holds ``shard_size`` of them: under a hidden
temporary name in ``data/``, fsynced, then renamed (``os.replace``), so a shard is either complete or absent and a
kill loses at most the records of the shard being filled. Each rank of a ``torchrun`` job writes its own file names
(``<split>-r<rank>-<NNNNN>.parquet``; one process: ``<split>-<NNNNN>.parquet``), so ranks need no lock.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from .prepared import SHARD_INFO_KEY


def atomic_write_json(path: Path, obj: dict) -> None:
    """Writes ``obj`` as indented JSON to ``path`` through a temporary file + fsync + ``os.replace``."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rank_and_world_size() -> tuple[int, int]:
    """``(rank, world_size)`` of this process: from ``torch.distributed`` when it is initialised, else from the
    ``RANK`` / ``WORLD_SIZE`` environment variables that ``torchrun`` sets, else ``(0, 1)``.

    Raises:
        ValueError: RANK / WORLD_SIZE are not integers with 0 <= RANK < WORLD_SIZE.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    try:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    except ValueError:
        raise ValueError(f"RANK={os.environ.get('RANK')!r} / WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} are not "
                         "integers (set by torchrun; unset them for one process)") from None
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is outside [0, WORLD_SIZE={world})")
    return rank, world


def _table(records: list[dict], info: dict):
    import pyarrow as pa

    schema = pa.schema([("record_id", pa.int64()), ("source_id", pa.string()), ("input_ids", pa.list_(pa.int32())),
                        ("response_spans", pa.list_(pa.list_(pa.int32()))), ("num_response_tokens", pa.int32()),
                        ("num_turns", pa.int32()), ("truncated", pa.bool_())],
                       metadata={SHARD_INFO_KEY: json.dumps(info).encode()})
    rows = [{"record_id": r["record_id"], "source_id": r.get("source_id"), "input_ids": r["input_ids"],
             "response_spans": r["response_spans"], "num_response_tokens": r["num_response_tokens"],
             "num_turns": r.get("num_turns", len(r["response_spans"])), "truncated": bool(r.get("truncated"))}
            for r in records]
    return pa.Table.from_pylist(rows, schema=schema)


class ShardWriter:
    """Buffers the records of one rank and writes them as complete Parquet shards of ``dataset_dir/data``.

    Args:
        dataset_dir: the dataset folder (``data/`` is created).
        split: ``"train"`` or ``"dev"``.
        shard_size: records per shard (the last one, written by :meth:`close`, may hold fewer).
        rank, world_size: this process's place in a ``torchrun`` job (file names carry the rank when
            ``world_size > 1``).
        record_range: the ``[start, stop)`` asked for, stored in each shard's metadata.
        on_shard: called with the shard's path after each shard is written (e.g. to refresh the card).

    Temporary files this rank left behind (a kill in the middle of a write) are removed when it starts. Shard
    numbers continue after the highest this rank already wrote, so a restart never overwrites a shard.
    """

    def __init__(self, dataset_dir: str | os.PathLike, split: str, shard_size: int, rank: int = 0,
                 world_size: int = 1, record_range: list | None = None, on_shard=None):
        if shard_size < 1:
            raise ValueError(f"shard_size must be >= 1, got {shard_size}")
        self.data_dir = Path(dataset_dir) / "data"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.prefix = f"{split}-r{rank}-" if world_size > 1 else f"{split}-"
        self.shard_size, self.rank, self.record_range, self.on_shard = shard_size, rank, record_range, on_shard
        pattern = re.compile(re.escape(self.prefix) + r"(\d{5,})\.parquet")
        taken = [int(m.group(1)) for p in self.data_dir.iterdir() if (m := pattern.fullmatch(p.name))]
        self.next_index = max(taken) + 1 if taken else 0
        for stale in self.data_dir.glob(f".{self.prefix}*.tmp*"):
            stale.unlink()
        self.records: list[dict] = []
        self.skipped: dict[int, str] = {}
        self.written: list[Path] = []

    def add(self, record: dict) -> None:
        """Buffers one record (the keys of :func:`~.prepared.load_dataset_folder`); writes the shard when full."""
        self.records.append(record)
        if len(self.records) >= self.shard_size:
            self._write()

    def skip(self, record_id: int, reason: str) -> None:
        """Notes a record left out (stored with the next shard written, so a resume does not retry it)."""
        self.skipped[int(record_id)] = reason

    def close(self) -> None:
        """Writes what is buffered (records or skips) as a last, possibly smaller shard."""
        if self.records or self.skipped:
            self._write()

    def _write(self) -> None:
        import pyarrow.parquet as pq

        recs = sorted(self.records, key=lambda r: r["record_id"])
        reasons: dict[str, int] = {}
        for reason in self.skipped.values():
            reasons[reason] = reasons.get(reason, 0) + 1
        info = {"split": self.prefix.split("-")[0], "rank": self.rank, "record_range": self.record_range,
                "records": len(recs), "response_tokens": sum(r["num_response_tokens"] for r in recs),
                "total_tokens": sum(len(r["input_ids"]) for r in recs),
                "truncated_responses": sum(bool(r.get("truncated")) for r in recs),
                "first_record_id": recs[0]["record_id"] if recs else None,
                "last_record_id": recs[-1]["record_id"] if recs else None,
                "skipped_record_ids": sorted(self.skipped), "skip_reasons": reasons,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        path = self.data_dir / f"{self.prefix}{self.next_index:05d}.parquet"
        tmp = self.data_dir / f".{path.name}.tmp{os.getpid()}"
        pq.write_table(_table(recs, info), tmp, compression="zstd")
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self.records, self.skipped = [], {}
        self.next_index += 1
        self.written.append(path)
        if self.on_shard is not None:
            self.on_shard(path)


__all__ = ["ShardWriter", "atomic_write_json", "rank_and_world_size"]
