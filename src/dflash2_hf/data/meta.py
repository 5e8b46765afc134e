"""The metadata of a data-preparation run: the target, tokenizer, chat template and generation settings that made
it (its shared part is a dataset folder's provenance: :func:`.hub_dataset.provenance`; format: :mod:`.prepared`)."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

FORMAT_NAME = "dflash2-regenerated-chat"
FORMAT_VERSION = 1

def _package_version() -> str:
    try:
        from importlib.metadata import version

        return version("dflash2-hf")
    except Exception:
        try:
            import tomllib

            pyproject = Path(__file__).resolve().parents[3] / "pyproject.toml"
            return tomllib.loads(pyproject.read_text())["project"]["version"] + " (source tree)"
        except Exception:
            return "unknown"


def _ids_list(x) -> list[int]:
    if x is None:
        return []
    return [int(v) for v in (x if isinstance(x, (list, tuple)) else [x])]


def _stop_ids(target, tokenizer) -> list[int]:
    ids = _ids_list(getattr(target.generation_config, "eos_token_id", None))
    if tokenizer.eos_token_id is not None and int(tokenizer.eos_token_id) not in ids:
        ids.append(int(tokenizer.eos_token_id))
    if not ids:
        raise ValueError("the target has no eos_token_id (generation_config or tokenizer): cannot tell where a "
                         "regenerated turn ends")
    return ids


def _new_meta(target, tokenizer, target_name, source, start, stop, settings) -> dict:
    template = tokenizer.chat_template
    cfg = target.config
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "package_version": _package_version(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "target": {
            "name": target_name,
            "name_or_path": str(getattr(target, "name_or_path", "") or getattr(cfg, "_name_or_path", "")),
            "class": type(target).__name__,
            "model_type": getattr(cfg, "model_type", None),
            "dtype": str(target.dtype).replace("torch.", ""),
            "vocab_size": getattr(cfg, "vocab_size", None) or getattr(cfg.get_text_config(), "vocab_size", None),
            "num_hidden_layers": getattr(cfg.get_text_config(), "num_hidden_layers", None),
            "hidden_size": getattr(cfg.get_text_config(), "hidden_size", None),
        },
        "tokenizer": {"name_or_path": str(getattr(tokenizer, "name_or_path", "")), "class": type(tokenizer).__name__,
                      "vocab_size": len(tokenizer), "eos_token": tokenizer.eos_token,
                      "pad_token_id": settings["pad_token_id"]},
        "chat_template": {"sha256": hashlib.sha256(template.encode("utf-8")).hexdigest(), "text": template},
        "generation": {
            "do_sample": False,
            "max_new_tokens": settings["max_new_tokens"],
            "max_prompt_tokens": settings["max_prompt_tokens"],
            "max_turns": settings["max_turns"],
            "stop_token_ids": settings["stop_token_ids"],
            "batch_size": settings["batch_size"],
            "padding_side": "left",
            "cache_implementation": settings["cache_implementation"],
            "note": settings.get("note") or "",
        },
        "source": source | {"record_range": [start, stop]},
        "runs": [],
        "counts": {},
        "status": "running",
    }
