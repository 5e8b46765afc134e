"""Optional warm starts: a fresh drafter from its target's own weights, or a trained drafter grown deeper.

The drafter's decoder layers have the target's shapes when the widths match (``from_target`` copies hidden size,
heads, head dim and MLP width), so target decoder layers can seed them: attention projections, MLP and the two
RMSNorms are copied; the drafter-only parts (``q_norm``/``k_norm`` stay at 1, convolutions at the identity, ``fc``,
``hidden_norm`` and the selector) keep their fresh initialisation. ``final_norm`` copies the target's final RMSNorm
weight into the drafter's ``norm`` (the LM head was trained on that scale).
"""

from __future__ import annotations

import copy
import math
import numbers

import torch
from torch import nn

from ..masking import layer_attention
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


def grown_layer_indices(num_layers: int, grow: int) -> list[int]:
    """Indices, in a stack of ``num_layers`` layers grown by :func:`grow_layers`, of its ``grow`` new layers.

    The new layers are spread evenly: new layer ``i`` follows original layer ``ceil((i + 1) * L / (grow + 1)) - 1``
    (``L = num_layers - grow``; 5 + 2 layers: after original layers 1 and 3, at indices 2 and 5).

    Raises:
        ValueError: ``grow`` < 1 or not fewer than ``num_layers``.
    """
    if not 1 <= grow < num_layers:
        raise ValueError(f"cannot find {grow} new layers in a stack of {num_layers}")
    original = num_layers - grow
    follows = [math.ceil((i + 1) * original / (grow + 1)) for i in range(grow)]  # original layers before each
    return [f + i for i, f in enumerate(sorted(follows))]


@torch.no_grad()
def grow_layers(drafter: nn.Module, grow: int) -> list[int]:
    """Inserts ``grow`` new decoder layers into a trained drafter (in place); returns their indices.

    Each new layer is a copy of the layer before it with its attention output projection and MLP down projection
    set to zero, so the residual stream, and every output of the drafter, is exactly what it was (block expansion,
    Wu et al. 2024, "LLaMA Pro", arXiv 2401.02415); training then gives the new layers their own function. The
    config's ``num_hidden_layers`` (and ``layer_types``, if set) follow; layer indices are renumbered.

    Raises:
        ValueError: ``grow`` not an integer >= 1.
    """
    if isinstance(grow, bool) or not isinstance(grow, numbers.Integral) or grow < 1:
        raise ValueError(f"grow_layers: the number of new layers must be an integer >= 1, got {grow!r}")
    old = list(drafter.layers)
    new_indices = set(grown_layer_indices(len(old) + grow, grow))
    config = drafter.config
    stack, types = [], []
    for layer, kind in zip(old, config.layer_types or [None] * len(old)):
        stack.append(layer)
        types.append(kind)
        while len(stack) in new_indices:  # the next index is a new layer: a copy of this one, silenced
            copy_ = copy.deepcopy(stack[-1])
            for projection in (copy_.self_attn.o_proj, copy_.mlp.down_proj):
                projection.weight.zero_()
                if projection.bias is not None:
                    projection.bias.zero_()
            stack.append(copy_)
            types.append(kind)
    for index, layer in enumerate(stack):
        layer.self_attn.layer_idx = index
    drafter.layers = nn.ModuleList(stack)
    config.num_hidden_layers = len(stack)
    if config.layer_types:
        config.layer_types = types
    drafter.layer_rules = layer_attention(config)
    return sorted(new_indices)


def freeze_all_but(drafter: nn.Module, layer_indices: list[int]) -> None:
    """Freezes every drafter parameter except those of the decoder layers ``layer_indices`` and the candidate
    selector (``--train-only new-layers``: the new layers of :func:`grow_layers`; the selector reads the final
    hidden state they change)."""
    drafter.requires_grad_(False)
    for i in layer_indices:
        drafter.layers[i].requires_grad_(True)
    if getattr(drafter, "candidate_selector", None) is not None:
        drafter.candidate_selector.requires_grad_(True)


__all__ = ["freeze_all_but", "grow_layers", "grown_layer_indices", "initialize_from_target", "target_layer_choice"]
