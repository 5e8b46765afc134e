"""The prepared-data folder written by :func:`.regenerate.prepare_data` (and ``--original-answers``): its format,
validation, locking and reading (:func:`load_prepared`, :func:`read_meta`).

On-disk format (``out_dir``)
----------------------------
``shard-00000.jsonl``, ``shard-00001.jsonl``, ...
    One kept conversation per line (UTF-8 JSON, ``\\n``-terminated), at most ``shard_size`` lines per shard::

        {"record_id": 123,                # index of the record in the ShareGPT JSON array (unique key)
         "source_id": "QWJhYvA_0",        # the record's own "id" field (not unique in ShareGPT)
         "input_ids": [1, 9690, ...],     # the whole conversation, exactly the token ids the target saw:
                                          #   prompt of turn 1 + its response + template text up to the
                                          #   next assistant turn + its response ...
         "response_spans": [[41, 298]],   # half-open [start, end) index ranges into input_ids of the
                                          #   regenerated responses: assistant content + its end-of-turn token
         "num_response_tokens": 257,      # sum of the span lengths
         "num_turns": 1,                  # regenerated assistant turns
         "truncated": false}              # the last response hit max_new_tokens (it has no end-of-turn token)

    Token ids are ints < vocab size. Lines are appended one batch at a time with flush + fsync; lines appear
    in batch order (not sorted by ``record_id``).
``skipped.jsonl``
    ``{"record_id": 7, "reason": "prompt_too_long"}`` per record left out (reasons: ``malformed``,
    ``unknown_role``, ``no_human_turn``, ``empty_turn``, ``prompt_too_long``, ``filtered_out`` with a
    ``record_filter``).
``meta.json``
    Provenance, rewritten atomically after every batch: format version, package / torch / transformers
    versions, target (name, path, class, dtype, vocab), chat template (sha256 and full text), generation
    settings (greedy, max_new_tokens, max_prompt_tokens, max_turns, stop token ids, batch size, left padding),
    source data set and record range, counts (kept, skipped per reason, tokens), throughput, and ``status``
    (``"running"``, ``"incomplete"`` when stopped by ``max_batches``, ``"complete"``).

``.lock``
    ``flock``-ed by the running prepare-data (a second process on the same folder is refused).

Resuming: running :func:`prepare_data` again on the same ``out_dir`` (same target / template / generation
settings, otherwise ValueError) reads the record ids already in the shards and in ``skipped.jsonl`` and
skips them, so a ``kill -9`` at any moment loses at most the batch in flight and never duplicates a record.
A torn last line (a write cut by the kill) is detected and cut off before appending.
"""

from __future__ import annotations

import json
import logging
import os
import platform
from pathlib import Path

logger = logging.getLogger(__name__)

_SHARD_FMT = "shard-{:05d}.jsonl"
_SKIPPED = "skipped.jsonl"
_META = "meta.json"


class PreparedDataError(ValueError):
    """A prepared-data folder is corrupt or inconsistent (the message names the file, line and the fix)."""


# ----------------------------------------------------------------------------------------------- files


def _fsync_append(path: Path, lines: list[str]) -> None:
    if not lines:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(lines))
        f.flush()
        os.fsync(f.fileno())


def _atomic_write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _shards(out_dir: Path) -> list[Path]:
    return sorted(out_dir.glob("shard-*.jsonl"))


def _validate_record(rec, vocab_size: int | None = None) -> str | None:
    """Why a decoded shard line is not a valid record (None if it is)."""
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


def _read_jsonl(path: Path, validate, repair_tail: bool, allow_torn_tail: bool) -> list[dict]:
    """Records of a JSONL file, each checked by ``validate`` (returns None or the problem).

    A torn tail - a last line without its newline, or an undecodable / invalid LAST line - is what a kill in
    the middle of a write leaves: it is cut off the file (``repair_tail``), ignored with a warning
    (``allow_torn_tail``) or an error. A bad line anywhere else is always an error.
    """
    lines = path.read_bytes().split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline, else the partial last line
    out: list[dict] = []
    offset = 0
    torn = None
    for lineno, raw in enumerate(lines, start=1):
        try:
            rec = json.loads(raw.decode("utf-8"))
            problem = validate(rec)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            problem = f"not valid JSON ({err})"
        if problem is not None:
            if lineno == len(lines) and not tail:
                torn = (lineno, problem)
                break
            raise PreparedDataError(
                f"{path}, line {lineno}: {problem}. The file is corrupt in the middle (not a torn last line): "
                f"delete {path.name} (its records are regenerated by the next `dflash2 prepare-data` run with "
                f"the same --output-dir) or regenerate into a fresh folder.")
        out.append(rec)
        offset += len(raw) + 1
    else:
        if tail:
            torn = (len(lines) + 1, "torn last line (no trailing newline)")
    if torn is not None:
        lineno, problem = torn
        if repair_tail:
            logger.warning("%s, line %d: %s - left by an interrupted run; cutting it off (its records are "
                           "regenerated)", path, lineno, problem)
            with open(path, "r+b") as f:
                f.truncate(offset)
                f.flush()
                os.fsync(f.fileno())
        elif allow_torn_tail:
            logger.warning("%s, line %d: %s - ignored (an interrupted or still running prepare-data; rerun it "
                           "with the same --output-dir to repair the file)", path, lineno, problem)
        else:
            raise PreparedDataError(
                f"{path}, line {lineno}: {problem}. Rerun `dflash2 prepare-data` with the same --output-dir: it cuts the "
                f"torn line off and regenerates its records.")
    return out


def _validate_skip(rec) -> str | None:
    if not isinstance(rec, dict) or not isinstance(rec.get("record_id"), int) or not isinstance(rec.get("reason"), str):
        return "not a {record_id: int, reason: str} object"
    return None


def _scan(out_dir: Path, repair: bool, allow_torn_tail: bool = False, vocab_size: int | None = None):
    """-> (records by shard path, skipped list). Raises PreparedDataError on duplicates / corrupt lines."""
    per_shard: dict[Path, list[dict]] = {}
    seen: dict[int, str] = {}
    for shard in _shards(out_dir):
        recs = _read_jsonl(shard, lambda r: _validate_record(r, vocab_size), repair, allow_torn_tail)
        for lineno, rec in enumerate(recs, start=1):
            rid = rec["record_id"]
            if rid in seen:
                raise PreparedDataError(
                    f"{shard}, line {lineno}: record_id {rid} already in {seen[rid]}; the folder mixes two runs. "
                    "Regenerate into a fresh --output-dir folder.")
            seen[rid] = f"{shard.name}"
        per_shard[shard] = recs
    skipped = []
    sk = out_dir / _SKIPPED
    if sk.exists():
        skipped = _read_jsonl(sk, _validate_skip, repair, allow_torn_tail)
    return per_shard, skipped


class _DirLock:
    """Exclusive ``flock`` on ``out_dir/.lock`` for the life of a run: two prepare-data processes writing the same
    folder would duplicate records. The kernel releases it when the process dies (kill -9 included)."""

    def __init__(self, out_dir: Path):
        self.path = out_dir / ".lock"
        self.fd = None

    def __enter__(self):
        import fcntl

        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(self.fd, 200, 0).decode(errors="replace").strip()
            os.close(self.fd)
            raise RuntimeError(f"{self.path.parent} is being written by another prepare-data process ({holder or 'pid ?'});"
                               " wait for it or stop it before resuming") from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"pid {os.getpid()} on {platform.node()}\n".encode(), 0)
        return self

    def __exit__(self, *exc):
        import fcntl

        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _get(d: dict, dotted: str):
    for k in dotted.split("."):
        d = d.get(k, {}) if isinstance(d, dict) else {}
    return d


# ----------------------------------------------------------------------------------------------- reading


def read_meta(out_dir: str | os.PathLike) -> dict:
    """The ``meta.json`` of a prepared-data folder (for a dataset folder of :mod:`.hub_dataset`: its shared
    provenance, same keys). Raises FileNotFoundError naming the folder."""
    from .hub_dataset import is_dataset_folder, read_dataset_meta

    if is_dataset_folder(out_dir):
        return read_dataset_meta(out_dir)["provenance"]
    path = Path(out_dir) / _META
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {out_dir} is not a prepare-data output folder "
                                "(run `dflash2 prepare-data --output-dir ...` first)")
    return json.loads(path.read_text(encoding="utf-8"))


def load_prepared(out_dir: str | os.PathLike, allow_torn_tail: bool = True, as_dataset: bool = False):
    """Read the regenerated conversations of ``out_dir`` (written by :func:`prepare_data`, or the ``train`` split of a
    dataset folder written by :func:`~.hub_dataset.export_prepared`), sorted by record_id.

    Every line is validated (JSON, keys, ints, spans inside ``input_ids``, token ids < the target's vocab size,
    no duplicate ``record_id``). A torn last line of a file - left by an interrupted or still running
    prepare-data - is ignored with a warning when ``allow_torn_tail`` (the file is not modified).

    Returns:
        A list of dicts (``record_id`` int, ``input_ids`` list[int], ``response_spans`` list[[int, int]],
        ``num_response_tokens`` int, ...; see the module docstring), or a ``datasets.Dataset`` with those
        columns when ``as_dataset``.

    Raises:
        FileNotFoundError: no meta.json / no shard in ``out_dir``.
        PreparedDataError: a corrupt line (the message names the file, the line and the fix).
    """
    from .hub_dataset import is_dataset_folder, load_dataset_folder

    if is_dataset_folder(out_dir):
        recs = load_dataset_folder(out_dir, split="train")
        if as_dataset:
            import datasets

            return datasets.Dataset.from_list(recs)
        return recs
    out = Path(out_dir)
    meta = read_meta(out)
    if not _shards(out):
        raise FileNotFoundError(f"{out} has no shard-*.jsonl files yet")
    per_shard, _ = _scan(out, repair=False, allow_torn_tail=allow_torn_tail,
                         vocab_size=meta.get("target", {}).get("vocab_size"))
    recs = sorted((r for rs in per_shard.values() for r in rs), key=lambda r: r["record_id"])
    if as_dataset:
        import datasets

        return datasets.Dataset.from_list(recs)
    return recs


def response_mask(record: dict) -> list[int]:
    """0/1 list as long as ``record["input_ids"]``: 1 on regenerated response tokens (loss positions)."""
    mask = [0] * len(record["input_ids"])
    for s, e in record["response_spans"]:
        mask[s:e] = [1] * (e - s)
    return mask


__all__ = ["PreparedDataError", "load_prepared", "read_meta", "response_mask"]
