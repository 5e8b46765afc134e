"""Optional warm starts of a fresh drafter from its target's own weights.

The drafter's decoder layers have the target's shapes when the widths match (``from_target`` copies hidden size,
heads, head dim and MLP width), so target decoder layers can seed them: attention projections, MLP and the two
RMSNorms are copied; the drafter-only parts (``q_norm``/``k_norm`` stay at 1, convolutions at the identity, ``fc``,
``hidden_norm`` and the selector) keep their fresh initialisation. ``final_norm`` copies the target's final RMSNorm
weight into the drafter's ``norm`` (the LM head was trained on that scale).
"""

from __future__ import annotations

import torch
from torch import nn

from .target_features import decoder_layers

_LAYER_PARAMS = (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "input_layernorm.weight", "post_attention_layernorm.weight",
)


def target_layer_choice(num_target_layers: int, num_drafter_layers: int, which: str) -> list[int]:
    """Target layers that seed the drafter layers: ``"first"`` (0..n-1), ``"last"`` (L-n..L-1) or ``"spread"``.

    Raises:
        ValueError: unknown ``which`` or more drafter layers than target layers.
    """
    n, L = num_drafter_layers, num_target_layers
    if n > L:
        raise ValueError(f"cannot seed {n} drafter layers from a {L}-layer target")
    if which == "first":
        return list(range(n))
    if which == "last":
        return list(range(L - n, L))
    if which == "spread":
        return [round(i * (L - 1) / max(n - 1, 1)) for i in range(n)]
    raise ValueError(f"unknown layer choice {which!r}; use first, last or spread")


@torch.no_grad()
def initialize_from_target(drafter: nn.Module, target: nn.Module, layers: str | None = None,
                           final_norm: bool = False) -> list[int]:
    """Copies target weights into a fresh drafter (in place); returns the target layers used (may be empty).

    Args:
        drafter: a :class:`~dflash2_hf.DFlash2DraftModel`.
        target: its target.
        layers: ``None`` (no layer copy), ``"first"``, ``"last"`` or ``"spread"`` (see :func:`target_layer_choice`).
        final_norm: copy the target's final norm weight into ``drafter.norm``.

    Raises:
        ValueError: a shape differs (the drafter is not as wide as the target) or the target lacks a parameter.
    """
    used: list[int] = []
    if layers:
        t_layers = decoder_layers(target)
        used = target_layer_choice(len(t_layers), len(drafter.layers), layers)
        for d_layer, ti in zip(drafter.layers, used):
            src = dict(t_layers[ti].named_parameters())
            dst = dict(d_layer.named_parameters())
            for name in _LAYER_PARAMS:
                if name not in src:
                    raise ValueError(f"target layer {ti} has no parameter {name!r}")
                if src[name].shape != dst[name].shape:
                    raise ValueError(f"{name}: target {tuple(src[name].shape)} vs drafter {tuple(dst[name].shape)}")
                dst[name].copy_(src[name])
    if final_norm:
        norm = getattr(target.get_decoder(), "norm", None)
        if norm is None or norm.weight.shape != drafter.norm.weight.shape:
            raise ValueError("the target has no final norm of the drafter's width")
        drafter.norm.weight.copy_(norm.weight)
    return used


__all__ = ["initialize_from_target", "target_layer_choice"]
