"""The drafters shipped with the repository (its ``model_cards/`` folder), found from any working directory.

``DFlash2DraftModel.from_pretrained("dflash2-smollm2-135m-instruct")`` (or the old spelling
``"model_cards/dflash2-smollm2-135m-instruct"`` when no such folder exists under the working directory) loads the
shipped drafter; :func:`shipped_drafter_path` gives its folder. The folder is found next to the package sources (an
editable install, ``pip install -e .`` from a clone: what ``scripts/setup.sh`` does) or under
``$DFLASH2_MODEL_CARDS``. A non-editable install does not carry ``model_cards/``: the error says what to do.

How a drafter name or path resolves (:func:`resolve_name_or_path`): an existing file or folder (relative to the working
directory) first; then a shipped name; then a path that looks local but is missing is refused at once (no Hub
lookup and no network retries); anything else is a Hub id.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

from .errors import ShippedDrafterNotFoundError

SHIPPED_DRAFTER = "dflash2-smollm2-135m-instruct"
SHIPPED_ADAPTER = "dflash2-smollm2-135m-instruct-code-lora"
SHIPPED = (SHIPPED_DRAFTER, SHIPPED_ADAPTER)
MODEL_CARDS_ENV = "DFLASH2_MODEL_CARDS"


def model_cards_dir() -> Path | None:
    """The folder holding the shipped drafters: ``$DFLASH2_MODEL_CARDS``, else the repository's ``model_cards/``
    next to ``src/`` (editable install); None when neither exists."""
    env = os.environ.get(MODEL_CARDS_ENV)
    if env:
        return Path(env).expanduser()
    folder = Path(__file__).resolve().parents[2] / "model_cards"
    return folder if folder.is_dir() else None


def shipped_name(name_or_path: str | os.PathLike) -> str | None:
    """The shipped drafter ``name_or_path`` names (``"dflash2-smollm2-135m-instruct"``, ``"model_cards/..."``,
    ``"./model_cards/..."``), else None."""
    name = os.fspath(name_or_path).rstrip("/")
    for prefix in ("./", "model_cards/"):
        name = name.removeprefix(prefix)
    return name if name in SHIPPED else None


def shipped_drafter_path(name: str = SHIPPED_DRAFTER) -> str:
    """The local folder of a shipped drafter (default: the SmolLM2-135M-Instruct drafter; also
    ``"dflash2-smollm2-135m-instruct-code-lora"``, its code LoRA adapter).

    Raises:
        ValueError: ``name`` is not a shipped drafter.
        ShippedDrafterNotFoundError: the ``model_cards/`` folder is not on this machine (a non-editable install).
    """
    if name not in SHIPPED:
        raise ValueError(f"{name!r} is not a shipped drafter; the shipped ones are {', '.join(SHIPPED)}")
    folder = model_cards_dir()
    if folder is None or not (folder / name).is_dir():
        where = (f"${MODEL_CARDS_ENV}={os.environ[MODEL_CARDS_ENV]} has no {name}/" if os.environ.get(MODEL_CARDS_ENV)
                 else "this install of dflash2_hf has no model_cards/ folder next to its sources (a non-editable install)")
        raise ShippedDrafterNotFoundError(
            f"The shipped drafter {name!r} is not on this machine: {where}. Install from a clone "
            f"(git clone ...; pip install -e .), or set {MODEL_CARDS_ENV} to the clone's model_cards folder, or pass "
            "a drafter folder or Hub id."
        )
    return str(folder / name)


def resolve_name_or_path(name_or_path: str | os.PathLike) -> str:
    """The path or Hub id to load for a drafter (or adapter) name: an existing path as given, a shipped name as its
    folder (:func:`shipped_drafter_path`), anything else unchanged (a missing local-looking path is refused later by
    :func:`dflash2_hf.hub.is_local_path`'s callers, before any Hub lookup).

    Raises:
        ValueError: a bare name (no ``/``) that is no folder here and close to a shipped name, e.g.
            ``"dflash2-smollm2"``: a typo, refused at once instead of a Hub lookup (and its retries when offline).
    """
    path = os.fspath(name_or_path)
    if os.path.exists(path):
        return path
    name = shipped_name(path)
    if name is None and "/" not in path:
        close = difflib.get_close_matches(path, SHIPPED, n=1, cutoff=0.6)
        if close:
            raise ValueError(f"{path!r} is neither a folder here nor a shipped drafter: did you mean {close[0]!r}? "
                             "(a Hub id has the form org/name)")
    return shipped_drafter_path(name) if name else path
