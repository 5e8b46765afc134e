"""Which keys each drafter layer sees: causal and sliding-window layers (DESIGN.md section 6).

A drafter layer ``i`` has a type ``config.layer_types[i]`` (``"full_attention"`` when the list is absent) and:

* causal iff ``config.is_causal`` says so, or, when ``is_causal`` is None, iff it is a ``"sliding_attention"`` layer;
* a window ``config.sliding_window`` if it is a sliding layer, none otherwise (a sliding layer without a window is
  causal over everything).

Over the whole key sequence (cached context, new context, block) at ABSOLUTE positions, a key at ``k`` is visible
from a query at ``q`` iff ``(not causal or k <= q) and (no window or q - k < window) and (causal or no window or
k - q < window)``. A full bidirectional layer needs no mask at all (the fast path, and every drafter without
``layer_types`` / ``is_causal``). Inference and training both go through :class:`AttentionMasks`, so the training
block mask (or a padding mask) is combined with the same rule.

The drafter's KV cache (:func:`drafter_cache`) keeps only the last ``window - 1`` context positions of a windowed
layer (``transformers``' ``DynamicSlidingWindowLayer`` with past recording, so that dropping a block's keys after a
cycle restores the context keys it pushed past the window edge).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)


@dataclass(frozen=True)
class LayerAttention:
    """Visibility rule of one drafter layer.

    Attributes:
        causal: keys after the query are hidden.
        window: keys at distance ``>= window`` are hidden (both sides unless causal); None = no window.
    """

    causal: bool = False
    window: int | None = None

    @property
    def unmasked(self) -> bool:
        """True for full bidirectional attention (every key visible)."""
        return not self.causal and self.window is None


def layer_attention(config) -> list[LayerAttention]:
    """The rule of every drafter layer of ``config`` (a :class:`~dflash2_hf.DFlash2Config`), in layer order."""
    types = config.layer_types or [FULL_ATTENTION] * config.num_hidden_layers
    rules = []
    for layer_type in types:
        sliding = layer_type == SLIDING_ATTENTION
        causal = sliding if config.is_causal is None else bool(config.is_causal)
        rules.append(LayerAttention(causal=causal, window=config.sliding_window if sliding else None))
    return rules


def check_layer_types(layer_types) -> None:
    """Refuses any layer type other than :data:`LAYER_TYPES` (e.g. ``"chunked_attention"``), naming it.

    Raises:
        ValueError: an unsupported type (the drafter would otherwise attend as some other layer does).
    """
    bad = sorted({str(t) for t in layer_types if t not in LAYER_TYPES})
    if bad:
        raise ValueError(f"layer_types {bad} are not supported by the drafter; use {list(LAYER_TYPES)}.")


def parse_layer_types(text: str, num_layers: int) -> list[str]:
    """``"sliding,full"``-style text (``full`` / ``sliding`` or the full type names, once for every layer or once per
    layer) as a ``layer_types`` list of ``num_layers`` entries.

    Raises:
        ValueError: an unknown type, or a count that is neither 1 nor ``num_layers``.
    """
    short = {"full": FULL_ATTENTION, "sliding": SLIDING_ATTENTION}
    types = [short.get(t.strip(), t.strip()) for t in text.split(",")]
    types = types * num_layers if len(types) == 1 else types
    if len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
        raise ValueError(f"layer types {text!r}: give full or sliding, once or once per layer ({num_layers} layers).")
    return types


def visibility(query_positions: torch.Tensor, key_positions: torch.Tensor, rule: LayerAttention) -> torch.Tensor:
    """Boolean visibility (True = attend) of keys from queries under ``rule``.

    Args:
        query_positions: ``(b, Q)`` int64 absolute positions of the queries.
        key_positions: ``(b, K)`` int64 absolute positions of the keys.

    Returns:
        ``(b, 1, Q, K)`` bool.
    """
    q = query_positions[:, None, :, None]
    k = key_positions[:, None, None, :]
    visible = torch.ones(q.shape[0], 1, q.shape[2], k.shape[3], dtype=torch.bool, device=q.device)
    if rule.causal:
        visible &= k <= q
    if rule.window is not None:
        visible &= q - k < rule.window
        if not rule.causal:
            visible &= k - q < rule.window
    return visible


class AttentionMasks:
    """The attention masks of one drafter forward, built on demand per layer and shared between layers with the same
    rule and key count.

    Keys are ``[cached keys ; new keys]``: the new ones (new context then block) sit at ``position_ids``, the cached
    ones at the positions right before the first new one (every decoding loop feeds the context in order: ours,
    ``transformers``' built-in DFlash path, the reference one). A windowed cache layer returns only its last keys, so
    the key count differs between layers.

    Args:
        rules: :func:`layer_attention` of the drafter.
        position_ids: ``(b, N)`` int64 positions of the new keys (``N`` = new context + block; the last ``Q`` are the
            queries).
        query_length: ``Q``.
        attention_mask: optional bool ``(b, 1, Q or 1, K_all)`` (True = attend) over all keys of a full layer
            (training's block mask, a padding mask); combined with every layer's rule (a layer holding fewer keys
            reads its last columns).
    """

    def __init__(self, rules: list[LayerAttention], position_ids: torch.Tensor, query_length: int,
                 attention_mask: torch.Tensor | None = None):
        self.rules = rules
        self.position_ids = position_ids
        self.query_positions = position_ids[:, -query_length:]
        self.attention_mask = attention_mask
        self._built: dict[tuple[LayerAttention, int], torch.Tensor | None] = {}

    def key_positions(self, key_length: int) -> torch.Tensor:
        """``(b, key_length)`` absolute positions of a layer's keys (cached ones first, then the new ones)."""
        new = self.position_ids
        cached = key_length - new.shape[1]
        if cached < 0:
            raise ValueError(f"{key_length} keys for {new.shape[1]} new positions: position_ids do not match the "
                             "inputs.")
        if cached == 0:
            return new
        before = new[:, :1] - cached + torch.arange(cached, device=new.device)
        return torch.cat([before, new], dim=1)

    def for_layer(self, layer_idx: int, key_length: int) -> torch.Tensor | None:
        """The mask of layer ``layer_idx`` over its ``key_length`` keys: bool ``(b, 1, Q, key_length)`` or None.

        Raises:
            ValueError: ``attention_mask`` covers fewer keys than the layer holds.
        """
        rule = self.rules[layer_idx]
        key = (rule, key_length)
        if key not in self._built:
            base = self.attention_mask
            if base is not None:
                if base.shape[-1] < key_length:
                    raise ValueError(
                        f"attention_mask covers {base.shape[-1]} keys but layer {layer_idx} attends over {key_length} "
                        "(cached + new context + block): pass a mask over every key."
                    )
                base = base[..., -key_length:]
            if rule.unmasked:
                mask = base
            else:
                mask = visibility(self.query_positions, self.key_positions(key_length), rule)
                mask = mask if base is None else mask & base
            self._built[key] = mask
        return self._built[key]


class DrafterCache(DynamicCache):
    """The drafter's KV cache: a ``DynamicSlidingWindowLayer`` (past recording on, so crops can roll back across the
    window edge) for each layer with a window, a ``DynamicLayer`` for the others.

    Args:
        config: the drafter's :class:`~dflash2_hf.DFlash2Config`.
    """

    def __init__(self, config):
        layers = []
        for rule in layer_attention(config):
            if rule.window is None:
                layers.append(DynamicLayer())
            else:
                layer = DynamicSlidingWindowLayer(sliding_window=rule.window)
                layer.activate_past_recording()
                layers.append(layer)
        Cache.__init__(self, layers=layers)


def drafter_cache(config) -> DynamicCache:
    """A fresh :class:`DrafterCache` for a drafter of ``config``; a plain ``DynamicCache`` if no layer has a window."""
    if all(rule.window is None for rule in layer_attention(config)):
        return DynamicCache()
    return DrafterCache(config)


__all__ = ["AttentionMasks", "DrafterCache", "LAYER_TYPES", "LayerAttention", "check_layer_types", "drafter_cache",
           "layer_attention", "parse_layer_types", "visibility"]
