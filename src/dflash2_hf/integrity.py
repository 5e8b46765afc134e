"""Weight digests that let a drafter folder or a LoRA adapter notice weights that are not the ones it was saved with.

A truncated or malformed safetensors file fails to parse, but a file whose tensor bytes were overwritten (a bad
disk, a partial copy over an old file) still loads finite numbers. ``save_pretrained`` therefore records
:func:`weights_digest` of the saved weights in ``config.weights_sha256`` and ``from_pretrained`` compares it after
loading; a LoRA adapter records its base drafter's digest the same way (``dflash2_adapter.json``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)

_CHECKABLE_DTYPES = (torch.float32, torch.bfloat16)


def weights_digest(state_dict: Mapping[str, torch.Tensor]) -> str:
    """sha256 (16 hex digits) of a drafter's weights, LoRA layers excluded.

    Tensors are hashed in name order after a cast to bfloat16, so the same weights give the same digest whether they
    are held in float32 or bfloat16 (a bf16 checkpoint upcast to fp32 round-trips exactly); names wrapped by ``peft``
    (``...base_layer.weight``, ``...original_module.weight``) hash like the plain ones, and the adapter's own trained
    copies (``modules_to_save``) are excluded with the LoRA layers. Integer buffers (``draft_vocab_ids``) are hashed as stored.
    """
    h = hashlib.sha256()
    for name in sorted(state_dict):
        if "lora_" in name or ".modules_to_save." in name:
            continue
        tensor = state_dict[name].detach()
        h.update(name.replace(".base_layer", "").replace(".original_module", "").encode())
        if tensor.is_floating_point():
            tensor = tensor.to(torch.bfloat16).view(torch.int16)
        h.update(tensor.cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def digest_mismatch(model: torch.nn.Module, expected: str | None, what: str = "weights") -> str | None:
    """The digest of ``model``'s weights when it differs from ``expected``; None when it matches or cannot be checked.

    Not checked (logged at info level) when nothing was recorded, or when the weights were quantized, offloaded
    (``meta``) or loaded in a dtype other than float32/bfloat16 (float16 rounds differently from the bf16 cast of
    :func:`weights_digest`, so sound weights would look foreign).
    """
    if not expected:
        return None
    state = model.state_dict()
    checkable = getattr(model, "hf_quantizer", None) is None and not getattr(model, "is_quantized", False) and all(
        t.device.type != "meta" and (not t.is_floating_point() or t.dtype in _CHECKABLE_DTYPES) for t in state.values()
    )
    if not checkable:
        logger.info(f"Digest of the {what} not checked: they are quantized, offloaded or in float16.")
        return None
    actual = weights_digest(state)
    return actual if actual != expected else None
