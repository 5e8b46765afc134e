"""What a training run reads: the training and held-out records (``only_code``), where their target features are
cached, and the checkpoint a resume continues from."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def is_code_record(tokenizer, record: dict) -> bool:
    """True when the rendered conversation holds a fenced code block (Markdown ```)."""
    return "```" in tokenizer.decode(record["input_ids"])


def default_features_root(data_dir: str) -> str:
    """``$DFLASH2_CACHE/features/<basename of data_dir>`` (see ``dflash2_hf.targets.cache_dir``)."""
    from ..targets import cache_dir

    name = os.path.basename(os.path.normpath(os.path.abspath(data_dir))) or "data"
    return str(cache_dir() / "features" / name)


def is_code_folder(data_dir: str) -> bool:
    """True for a folder made by ``prepare-data --only-code``: code-domain as a whole (its records were chosen by the
    original conversation; the target's own answer need not hold a fenced block), so --only-code keeps all of it."""
    from ..data import read_meta
    from ..data.prepared import is_dataset_folder

    return is_dataset_folder(data_dir) and read_meta(data_dir).get("source", {}).get("filter") == "code"


def keep_code(only_code: bool, tokenizer, data_dir: str, records: list[dict]) -> tuple[list[dict], bool]:
    """With ``only_code``: the records with a fenced code block, unless ``data_dir`` is code-domain as a whole
    (:func:`is_code_folder`). Returns ``(records, filtered)``."""
    filtered = only_code and not is_code_folder(data_dir)
    return ([r for r in records if is_code_record(tokenizer, r)] if filtered else records), filtered


def load_eval_records(data, tokenizer) -> list[dict]:
    """The first ``data.eval_max_records`` records of ``data.eval_data`` (a :class:`~.config.DataArguments`; with
    ``only_code``: of its code records, so the evaluation is in the training domain).

    Raises:
        ValueError: no record to evaluate on.
    """
    from .dataset import load_training_records

    recs = load_training_records(data.eval_data, max_records=None if data.only_code else data.eval_max_records,
                                 train_only=False)
    recs, code_filter = keep_code(data.only_code, tokenizer, data.eval_data, recs)
    recs = recs[:data.eval_max_records]
    if code_filter:
        logger.info("--only-code: %d held-out records with a fenced code block", len(recs))
    if not recs:
        raise ValueError(f"--eval-data {data.eval_data}: no record to evaluate on"
                         + (" (none has a fenced code block; drop --only-code or use a code folder)" if code_filter
                            else ""))
    return recs


def last_complete_checkpoint(output: str) -> str | None:
    """Newest ``checkpoint-N`` folder of ``output`` that a resume can use, or None.

    A checkpoint counts only if it holds ``trainer_state.json`` (written last by the Trainer) and the drafter
    weights; a folder left half-written by a kill is skipped with a warning (``transformers``'
    ``get_last_checkpoint`` would pick it and restart the step count from 0).
    """
    import re

    if not os.path.isdir(output):
        return None
    found = []
    for name in os.listdir(output):
        m = re.fullmatch(r"checkpoint-(\d+)", name)
        if m and os.path.isdir(os.path.join(output, name)):
            found.append((int(m.group(1)), os.path.join(output, name)))
    for _step, path in sorted(found, reverse=True):
        files = set(os.listdir(path))
        if "trainer_state.json" in files and ("model.safetensors" in files or "model.safetensors.index.json" in files
                                              or "adapter_model.safetensors" in files):
            return path
        logger.warning("skipping incomplete checkpoint %s (no trainer_state.json or weights)", path)
    return None
