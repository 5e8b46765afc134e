"""Which drafter a LoRA adapter belongs to: the fingerprint file written next to an adapter
(``dflash2_adapter.json``: the base drafter's shape and target-binding fields, their hash, and a digest of its
weights) and the checks that compare it with a drafter (:func:`check_adapter_fits`, used by
:func:`dflash2_hf.lora.load_adapter` and ``dflash2 train --lora-init``)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from peft import PeftModel

from .errors import CheckpointError, DrafterTargetMismatchError
from .integrity import weights_digest

FINGERPRINT_FILE = "dflash2_adapter.json"
_FINGERPRINT_FIELDS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "vocab_size", "target_hidden_size", "num_target_layers", "target_layer_ids", "block_size",
    "use_local_conv", "use_candidate_selector", "selector_rank",
)


class AdapterMismatchError(DrafterTargetMismatchError):
    """The LoRA adapter was trained for a different drafter."""


def base_weights_digest(drafter) -> str:
    """sha256 (16 hex digits) of the base drafter's weights, LoRA layers excluded (see :func:`weights_digest`)."""
    return weights_digest(drafter.state_dict())


def _fingerprint_fields(drafter) -> dict:
    return {k: getattr(drafter.config, k) for k in _FINGERPRINT_FIELDS}


def check_adapter_fits(adapter_path: str | os.PathLike, config, fingerprint: dict | None = None) -> None:
    """Refuses an adapter whose ``dflash2_adapter.json`` names another drafter than one of ``config`` (a
    :class:`~dflash2_hf.DFlash2Config`; no weights needed, so ``dflash2 train --init D --lora-init A`` checks it
    before any work). An adapter without that file passes.

    Raises:
        AdapterMismatchError: the differing fields, adapter vs drafter.
    """
    fingerprint = fingerprint if fingerprint is not None else _stored_fingerprint(adapter_path)
    if fingerprint is None:
        return
    diff = _differing_fields(fingerprint["fields"], {k: getattr(config, k) for k in _FINGERPRINT_FIELDS})
    if diff:
        listing = ", ".join(f"{k}: adapter {a!r} vs drafter {b!r}" for k, (a, b) in diff.items())
        raise AdapterMismatchError(
            f"The LoRA adapter in {str(adapter_path)!r} was trained for another drafter ({listing}). Load the drafter "
            "it was trained on (see adapter_config.json: base_model_name_or_path) or train a new adapter.")


def _differing_fields(expected: dict, actual: dict) -> dict:
    """``{field: (expected value, actual value)}`` for every fingerprint field of ``actual`` that differs."""
    return {k: (expected.get(k), v) for k, v in actual.items() if expected.get(k) != v}


def drafter_fingerprint(drafter) -> dict:
    """Shape/binding fields of the base drafter an adapter depends on, their hash, and the weights' digest."""
    fields = _fingerprint_fields(drafter)
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
    return {"fields": fields, "sha256_16": digest, "weights_sha256_16": base_weights_digest(drafter)}


def write_fingerprint(model: PeftModel, save_directory: str | os.PathLike) -> None:
    """Writes ``dflash2_adapter.json`` (the base drafter's fingerprint) next to a saved adapter."""
    fingerprint = drafter_fingerprint(model.get_base_model())
    Path(save_directory, FINGERPRINT_FILE).write_text(json.dumps(fingerprint, indent=2, sort_keys=True))


def _stored_fingerprint(adapter_path: str | os.PathLike) -> dict | None:
    """The adapter's ``dflash2_adapter.json``: from a local folder, or fetched from a Hub repo (cache-aware)."""
    path = Path(adapter_path)
    if path.exists():
        stored = path / FINGERPRINT_FILE
        if not stored.is_file():
            return None
    else:
        try:
            from huggingface_hub import hf_hub_download

            stored = Path(hf_hub_download(str(adapter_path), FINGERPRINT_FILE))
        except Exception:  # no such file in the repo, offline without a cached copy, not a repo id at all
            return None
    try:
        fingerprint = json.loads(stored.read_text())
    except json.JSONDecodeError as err:
        problem = str(err)
    else:
        problem = None if isinstance(fingerprint, dict) and isinstance(fingerprint.get("fields"), dict) else \
            'no "fields" object'
    if problem:
        raise CheckpointError(
            f"{FINGERPRINT_FILE} of the adapter {str(adapter_path)!r} is corrupt ({problem}): copy the adapter folder "
            "again from where it came from, or re-save the adapter with dflash2_hf.lora.save_adapter")
    return fingerprint
