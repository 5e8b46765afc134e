"""The published DFlash / DFlash2 drafter config format (DESIGN.md section 6), to and from DFlash2Config's flat fields.

A published drafter config is a Qwen3 config (``model_type: "qwen3"``) with a nested ``dflash_config`` dict,
``num_target_layers`` and ``architectures: ["DFlashDraftModel"]`` (v1: no convolution, no selector) or
``["DFlash2DraftModel"]``. The reference code loads it through ``transformers``' ``Qwen3Config``, so this module does
too: whatever ``Qwen3Config`` makes of the top level is what the drafter runs with, in particular

* rope: ``rope_parameters``, or the ``rope_theta`` / ``rope_scaling`` keys of configs saved by transformers 4.x,
  standardised by ``transformers`` itself (``Qwen3Config``'s default ``rope_theta`` 10000 when there is none; a
  ``rope_scaling`` that names no rope type is refused by DFlash2Config, not read as the default rope);
* attention layout: ``layer_types`` (only ``"full_attention"`` / ``"sliding_attention"``; derived from
  ``use_sliding_window`` / ``max_window_layers`` when absent), ``sliding_window`` (None unless
  ``use_sliding_window``), plus ``is_causal`` (top level) or ``dflash_config.causal``;
* sizes a config leaves out take ``Qwen3Config``'s defaults (e.g. ``rms_norm_eps`` 1e-6, ``head_dim`` 128).

Drafting fields are read from ``dflash_config`` first, then the top level (as the reference does); defaults:
``block_size`` 16, ``output_multiplier`` 1, ``input_embedding_scale`` 1, no soft-capping, ``target_layer_ids`` by
:func:`published_target_layer_ids`. ``mask_token_id`` has no default. ``is_causal`` / ``dflash_config.causal``
must be JSON booleans (or null), and ``architectures`` a list. A key we do not implement (in ``dflash_config`` or at
the top level) is a ``ValueError`` naming it, unless it holds the value that changes nothing.
"""

from __future__ import annotations

from typing import Any

from transformers import Qwen3Config

from .masking import FULL_ATTENTION, SLIDING_ATTENTION, check_layer_types

# `dflash_config` keys that map 1:1 onto DFlash2Config fields (also read from the top level).
DFLASH_KEYS = (
    "block_size",
    "mask_token_id",
    "target_layer_ids",
    "conv_kernel_size",
    "conv_group_size",
    "selector_rank",
    "selector_top_k",
    "output_multiplier",
    "final_logit_softcapping",
    "input_embedding_scale",
)
ARCHITECTURES = {"DFlashDraftModel": 1, "DFlash2DraftModel": 2}
LEGACY_ROPE_KEYS = ("rope_theta", "rope_scaling")
# Keys other readers (vLLM, SGLang) know, accepted only at the value that leaves drafting unchanged.
NEUTRAL_DFLASH_VALUES = {"use_aux_hidden_state": True, "attention_sink_bias": False, "use_swa": False}
NEUTRAL_TOP_LEVEL_VALUES = {"is_neox_style": True, "add_swa_attention_sink_bias": False, "partial_rotary_factor": 1.0,
                            "mlp_bias": False, "pretraining_tp": 1}
# Bookkeeping keys with no effect on drafting.
METADATA_KEYS = {"architectures", "model_type", "transformers_version", "auto_map", "_name_or_path", "name_or_path",
                 "_commit_hash", "torch_dtype", "output_attentions"}
# Our own switches: the published format encodes them by architecture and by which dflash_config keys exist.
_OWN_SWITCHES = {"use_local_conv", "use_candidate_selector"}
_QWEN3_FIELDS = set(Qwen3Config.__annotations__)  # Qwen3's own fields (not the PreTrainedConfig base ones)


def published_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference's ``target_layer_ids`` for a published config that has none.

    ``[L // 2]`` for one drafter layer, else ``round(1 + i * (L - 4) / (n - 1))`` for ``i = 0 .. n-1`` (Python
    rounding, duplicates kept), for ``n = num_draft_layers`` drafter layers on an ``L``-layer target.
    """
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def _refuse_unknown(keys: dict[str, Any], known: set[str], neutral: dict[str, Any], where: str) -> None:
    bad = sorted(k for k, v in keys.items() if k not in known and not (k in neutral and v == neutral[k]))
    if bad:
        detail = ", ".join(f"{k}={keys[k]!r}" for k in bad)
        raise ValueError(
            f"The published DFlash config sets {where} field(s) dflash2_hf does not implement: {detail}. The drafter "
            "would draft differently from the code that wrote them; remove them only if they change nothing."
        )


def _resolved_causal(top: dict[str, Any], dflash: dict[str, Any]) -> bool | None:
    given = {name: value for name, value in (("is_causal", top.get("is_causal")),
                                             ("dflash_config.causal", dflash.get("causal"))) if value is not None}
    for name, value in given.items():
        if not isinstance(value, bool):
            raise ValueError(f"The published DFlash config sets {name}={value!r}: it must be true, false or null (a "
                             "JSON boolean, not a string or number); write it without quotes.")
    if len(set(given.values())) > 1:
        raise ValueError(
            f"The published DFlash config sets is_causal={top['is_causal']!r} but dflash_config.causal="
            f"{dflash['causal']!r}: they contradict each other; keep one."
        )
    return next(iter(given.values()), None)


def translate_published(config_dict: dict[str, Any], fields: set[str]) -> dict[str, Any]:
    """A published-format config dict as DFlash2Config's flat fields (see the module docstring).

    Args:
        config_dict: the parsed ``config.json`` (top level with ``dflash_config``).
        fields: DFlash2Config's field names.

    Returns:
        a flat dict for ``DFlash2Config.from_dict``.

    Raises:
        ValueError: an unknown architecture (or ``architectures`` not a list), no ``num_target_layers`` or
            ``mask_token_id``, a field or layer type we do not implement, a causality setting that is not a boolean,
            or contradicting ones (each message names the field).
    """
    top = dict(config_dict)
    dflash = top.pop("dflash_config")
    if not isinstance(dflash, dict):
        raise ValueError(f"dflash_config must be a dict, got {type(dflash).__name__}.")
    architectures = top.get("architectures") or ["DFlash2DraftModel"]
    if not isinstance(architectures, list):
        raise ValueError(f"The published DFlash config sets architectures={architectures!r}: it must be a list, e.g. "
                         f"[{architectures!r}].")
    version = ARCHITECTURES.get(architectures[0])
    if version is None:
        raise ValueError(f"Unknown drafter architecture {architectures[0]!r}; expected one of {sorted(ARCHITECTURES)}.")
    if "num_target_layers" not in top:
        raise ValueError("Published DFlash config lacks `num_target_layers`; add the target's layer count.")
    # `mask_token` (a token string, SGLang) only names the token `mask_token_id` gives
    _refuse_unknown(dflash, set(DFLASH_KEYS) | {"causal", "mask_token"}, NEUTRAL_DFLASH_VALUES, "dflash_config")
    known_top = (fields - _OWN_SWITCHES) | _QWEN3_FIELDS | set(LEGACY_ROPE_KEYS) | {"is_causal"} | METADATA_KEYS
    _refuse_unknown(top, known_top, NEUTRAL_TOP_LEVEL_VALUES, "top-level")

    # the top level exactly as the reference's Qwen3Config resolves it (rope standardisation, attention layout)
    qwen = Qwen3Config(**{k: v for k, v in top.items() if k in _QWEN3_FIELDS or k in LEGACY_ROPE_KEYS})
    # (model_type "qwen3" describes the format, not the translated config: ours is "dflash2")
    out = {k: v for k, v in top.items() if k in fields and k not in _QWEN3_FIELDS and k != "model_type"}
    if out.get("dtype") is None and top.get("torch_dtype") is not None:  # the 4.x name, as transformers maps it
        out["dtype"] = top["torch_dtype"]
    out.update({k: getattr(qwen, k) for k in _QWEN3_FIELDS & fields})
    check_layer_types(qwen.layer_types)  # before collapsing an all-full list to None
    sliding = [t == SLIDING_ATTENTION for t in qwen.layer_types]
    out["layer_types"] = list(qwen.layer_types) if any(sliding) else None
    out["sliding_window"] = qwen.sliding_window if any(sliding) else None
    out["is_causal"] = _resolved_causal(top, dflash)

    def value(key):  # dflash_config first, then the top level (the reference's lookup order)
        return dflash[key] if key in dflash else top.get(key)

    for key in DFLASH_KEYS:
        if value(key) is not None:
            out[key] = value(key)
        else:
            out.pop(key, None)
    if "mask_token_id" not in out:
        named = (f" (it names the token {dflash['mask_token']!r}: look its id up in the tokenizer)"
                 if "mask_token" in dflash else "")
        raise ValueError(f"Published DFlash config lacks `mask_token_id` (in dflash_config or at the top level)"
                         f"{named}.")
    if "target_layer_ids" not in out and isinstance(top["num_target_layers"], int):  # else DFlash2Config names it
        out["target_layer_ids"] = published_target_layer_ids(top["num_target_layers"], qwen.num_hidden_layers)
    out["use_local_conv"] = version == 2 and "conv_kernel_size" in out
    out["use_candidate_selector"] = version == 2 and "selector_rank" in out
    out["architectures"] = ["DFlash2DraftModel"]
    return out


def to_published(flat: dict[str, Any], use_local_conv: bool, use_candidate_selector: bool) -> dict[str, Any]:
    """DFlash2Config's flat dict in the published layout (Qwen3 fields + ``dflash_config``).

    v1 (``DFlashDraftModel``) when both the convolution and the selector are off, else v2. The attention layout is
    written explicitly (``layer_types`` for every layer, ``use_sliding_window``, ``sliding_window``, ``is_causal``
    when set), so ``Qwen3Config`` derives nothing. The rope is written both as ``rope_parameters`` and as the
    legacy top-level ``rope_theta`` / ``rope_scaling`` (None for the default rope) that transformers 4.x readers
    use; ``Qwen3Config`` reads the same rope back from either.
    """
    dflash = {k: flat[k] for k in DFLASH_KEYS}
    if not use_local_conv:
        dflash.pop("conv_kernel_size"), dflash.pop("conv_group_size")
    if not use_candidate_selector:
        dflash.pop("selector_rank"), dflash.pop("selector_top_k")
    # local path and classification-head labels mean nothing in a published drafter config
    skip = set(DFLASH_KEYS) | _OWN_SWITCHES | {"architectures", "model_type", "_name_or_path", "id2label", "label2id"}
    out = {k: v for k, v in flat.items() if k not in skip}
    out["layer_types"] = flat["layer_types"] or [FULL_ATTENTION] * flat["num_hidden_layers"]
    out["use_sliding_window"] = flat["sliding_window"] is not None
    rope = dict(flat["rope_parameters"])
    out["rope_theta"] = rope.pop("rope_theta")
    out["rope_scaling"] = None if rope["rope_type"] == "default" else rope
    if flat["is_causal"] is None:
        out.pop("is_causal")
    out.update(
        model_type="qwen3",
        architectures=["DFlash2DraftModel" if (use_local_conv or use_candidate_selector) else "DFlashDraftModel"],
        dflash_config=dflash,
    )
    return out


__all__ = ["ARCHITECTURES", "DFLASH_KEYS", "published_target_layer_ids", "to_published", "translate_published"]
