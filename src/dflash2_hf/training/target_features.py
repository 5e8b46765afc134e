"""The frozen target's context features: hidden states of the target layers ``target_layer_ids``, concatenated on
the last dim, that the drafter is conditioned on (DESIGN.md section 2). :mod:`.features` caches them for training;
the generation loop takes the same layers from the target's verification forward.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn


class _StopForward(Exception):
    """Raised by the hook of the deepest needed layer: the rest of the target is not run."""


def decoder_layers(target: nn.Module) -> nn.ModuleList:
    """The decoder layer list of a ``transformers`` causal LM (``target.get_decoder().layers``).

    Raises:
        ValueError: the model exposes no ``layers`` list.
    """
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else target
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(f"{type(target).__name__} has no decoder `layers` list; cannot extract layer features.")
    return layers


@torch.inference_mode()
def target_features(
    target: nn.Module,
    input_ids: torch.LongTensor,
    layer_ids: Sequence[int],
    attention_mask: torch.Tensor | None = None,
    with_next: bool = False,
    topk: int = 0,
):
    """Concatenated hidden states of ``layer_ids`` for ``input_ids`` (and the target's greedy next tokens).

    Equivalent to ``torch.cat([out.hidden_states[i + 1] for i in layer_ids], -1)`` of a forward with
    ``output_hidden_states=True``; without ``with_next`` the decoder runs only up to the deepest needed layer (no
    later layers, no final norm, no LM head).

    Args:
        target: a ``transformers`` causal LM (or its decoder).
        input_ids: ``(b, T)`` int64.
        layer_ids: 0-based decoder layer indices.
        attention_mask: optional ``(b, T)`` 0/1 padding mask.
        with_next: also run the rest of the target and return its argmax next token at every position.
        topk: with ``with_next``, also return the target's ``topk`` largest next-token logits at every position
            (the distillation targets of ``drafter_loss(distill_weight=...)``).

    Returns:
        ``(b, T, len(layer_ids) * H_t)`` in the target's dtype; with ``with_next`` a tuple of that and ``(b, T)``
        int64 ``argmax logits[t]`` (the target's greedy choice for position ``t + 1``); with ``topk`` also
        ``(b, T, topk)`` float32 logits (descending) and ``(b, T, topk)`` int64 their token ids.

    Raises:
        ValueError: a layer id is outside the target's layers, or ``topk`` without ``with_next``.
    """
    if topk and not with_next:
        raise ValueError("topk logits need the whole target: pass with_next=True")
    layers = decoder_layers(target)
    if not layer_ids or min(layer_ids) < 0 or max(layer_ids) >= len(layers):
        raise ValueError(f"layer_ids {list(layer_ids)} outside the target's {len(layers)} decoder layers")
    captured: dict[int, torch.Tensor] = {}
    last = max(layer_ids)

    def make_hook(i):
        def hook(_module, _inputs, output):
            captured[i] = output[0] if isinstance(output, tuple) else output
            if i == last and not with_next:
                raise _StopForward

        return hook

    handles = [layers[i].register_forward_hook(make_hook(i)) for i in sorted(set(layer_ids))]
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else target
    next_ids = top = None
    try:
        if with_next:
            logits = target(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
            next_ids = logits.argmax(-1)
            if topk:
                top = logits.float().topk(topk, dim=-1)
        else:
            decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    except _StopForward:
        pass
    finally:
        for h in handles:
            h.remove()
    feats = torch.cat([captured[i] for i in layer_ids], dim=-1)
    if top is not None:
        return feats, next_ids, top.values, top.indices
    return (feats, next_ids) if with_next else feats


__all__ = ["decoder_layers", "target_features"]
