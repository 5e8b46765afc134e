"""Reading JSON Lines files (one JSON value per line), shared by the ShareGPT reader and the bench's prompt files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator


def iter_json_lines(path: str | Path) -> Iterator[tuple[int, Any]]:
    """``(line_number, value)`` for every non-blank line of ``path`` (UTF-8), numbered from 1.

    Raises:
        ValueError: a line is not JSON; the message names the file and the line.
        OSError: the file cannot be read.
    """
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}: line {line_number} is no JSON record ({err.msg}); a JSON Lines file holds "
                                 "one record per line") from None
            yield line_number, value


__all__ = ["iter_json_lines"]
