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

_CHECKABLE_DTYPES = (torch.float32, torch.bfloat16)


def weights_digest(state_dict: Mapping[str, torch.Tensor]) -> str:
    """sha256 (16 hex digits) of a drafter's weights, LoRA layers excluded.

    Tensors are hashed in name order after a cast to bfloat16, so the same weights give the same digest whether they
    are held in float32 or bfloat16 (a bf16 checkpoint upcast to fp32 round-trips exactly); names wrapped by ``peft``
    (``...base_layer.weight``) hash like the plain ones. Integer buffers (``draft_vocab_ids``) are hashed as stored.
    """
    h = hashlib.sha256()
    for name in sorted(state_dict):
        if "lora_" in name:
            continue
        tensor = state_dict[name].detach()
        h.update(name.replace(".base_layer", "").encode())
        if tensor.is_floating_point():
            tensor = tensor.to(torch.bfloat16).view(torch.int16)
        h.update(tensor.cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def digest_is_checkable(model: torch.nn.Module) -> bool:
    """Whether :func:`weights_digest` of a loaded model can be compared with the saved one.

    Not when weights were quantized, offloaded (``meta``) or loaded in a dtype other than float32/bfloat16 (float16
    rounds differently, so a sound file would look corrupt).
    """
    if getattr(model, "hf_quantizer", None) is not None or getattr(model, "is_quantized", False):
        return False
    return all(
        t.device.type != "meta" and (not t.is_floating_point() or t.dtype in _CHECKABLE_DTYPES)
        for t in model.state_dict().values()
    )
