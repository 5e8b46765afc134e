"""LoRA adapters for DFlash2 drafters, with ``peft``.

Which modules get LoRA and why (:data:`DEFAULT_TARGET_MODULES`):

* attention ``q_proj``/``k_proj``/``v_proj``/``o_proj`` - how block positions read the target's context features
  and each other; a new domain (code, another fine-tuned target) changes which context matters;
* MLP ``gate_proj``/``up_proj``/``down_proj`` - where the drafter stores its token-level predictions (the bulk of
  what shifts with the domain);
* ``fc`` (context fusion) and the selector's ``hidden_projection`` stay frozen by default: they map the target's
  hidden states, which a domain shift moves far less than what the drafter predicts from them; add them with
  ``target_modules`` if your target itself was fine-tuned. The selector codebooks are plain parameters (``(V, r)``
  tables, not layers), so LoRA cannot wrap them; they stay as trained.

An adapter folder is what ``PeftModel.save_pretrained`` writes plus ``dflash2_adapter.json``, a fingerprint of the
base drafter (shapes and target binding) checked on load, so an adapter trained for another drafter fails with a
clear message instead of a wall of shape errors.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from peft import LoraConfig, PeftModel, get_peft_model

from .errors import DrafterTargetMismatchError

DEFAULT_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FINGERPRINT_FILE = "dflash2_adapter.json"
_FINGERPRINT_FIELDS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "vocab_size", "target_hidden_size", "num_target_layers", "target_layer_ids", "block_size",
    "use_local_conv", "use_candidate_selector", "selector_rank",
)


class AdapterMismatchError(DrafterTargetMismatchError):
    """The LoRA adapter was trained for a different drafter."""


def drafter_fingerprint(drafter) -> dict:
    """Shape/binding fields of the base drafter an adapter depends on, plus their hash."""
    fields = {k: getattr(drafter.config, k) for k in _FINGERPRINT_FIELDS}
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
    return {"fields": fields, "sha256_16": digest}


def lora_config(r: int = 16, alpha: int = 32, dropout: float = 0.0, target_modules: list[str] | None = None) -> LoraConfig:
    """A ``peft.LoraConfig`` for drafters (defaults: r=16, alpha=32, attention + MLP projections)."""
    return LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules or DEFAULT_TARGET_MODULES,
        bias="none",
    )


def add_lora(drafter, config: LoraConfig | None = None) -> PeftModel:
    """Wraps a trained drafter with a fresh LoRA adapter; only the adapter is trainable.

    The returned ``PeftModel`` works directly as ``assistant_model=`` in ``target.generate`` (unmerged), and
    ``merge_and_unload()`` gives back a plain :class:`~dflash2_hf.DFlash2DraftModel`.
    """
    model = get_peft_model(drafter, config or lora_config())
    model.dflash2_fingerprint = drafter_fingerprint(drafter)
    return model


def save_adapter(model: PeftModel, save_directory: str | os.PathLike) -> None:
    """Saves ONLY the adapter (``adapter_model.safetensors`` + ``adapter_config.json``) and the base fingerprint."""
    model.save_pretrained(save_directory)
    fingerprint = drafter_fingerprint(model.get_base_model())
    Path(save_directory, FINGERPRINT_FILE).write_text(json.dumps(fingerprint, indent=2, sort_keys=True))


def load_adapter(drafter, adapter_path: str | os.PathLike, is_trainable: bool = False) -> PeftModel:
    """``PeftModel.from_pretrained`` after checking the adapter was trained for this drafter.

    Raises:
        AdapterMismatchError: the adapter's fingerprint names another drafter (the differing fields are listed).
    """
    path = Path(adapter_path)
    stored = path / FINGERPRINT_FILE
    if stored.is_file():
        expected = json.loads(stored.read_text())["fields"]
        actual = drafter_fingerprint(drafter)["fields"]
        diff = {k: (expected.get(k), actual[k]) for k in actual if expected.get(k) != actual[k]}
        if diff:
            listing = ", ".join(f"{k}: adapter {a!r} vs drafter {b!r}" for k, (a, b) in diff.items())
            raise AdapterMismatchError(
                f"The LoRA adapter in {str(path)!r} was trained for another drafter ({listing}). Load the drafter it "
                "was trained on (see adapter_config.json: base_model_name_or_path) or train a new adapter."
            )
    return PeftModel.from_pretrained(drafter, str(path), is_trainable=is_trainable)


def adapter_size_bytes(path: str | os.PathLike) -> int:
    """Bytes of the adapter weights file(s) in a saved adapter folder."""
    return sum(f.stat().st_size for f in Path(path).glob("adapter_model*"))


def checkpoint_size_bytes(path: str | os.PathLike) -> int:
    """Bytes of the weight files of a saved drafter folder."""
    return sum(f.stat().st_size for f in Path(path).glob("model*.safetensors"))
