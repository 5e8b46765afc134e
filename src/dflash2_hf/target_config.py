"""Reads a target's sizes from its config, whatever names its architecture uses (for ``from_target``/``check_target``:
:func:`drafter_fields_for_target`, :func:`target_mismatches`).

Causal LMs name the same quantity differently: GPT-2 ``n_embd``/``n_inner``/``n_positions``, OPT ``ffn_dim``, Falcon
``ffn_hidden_size`` (or nothing: ``4 * hidden``), Bloom no position limit at all (ALiBi), MPT ``d_model``/
``max_seq_len``, the decoder of an encoder-decoder family ``decoder_layers``/``decoder_ffn_dim``. Each size is looked
up under its known names (decoder-specific names first) in ``config.get_text_config()``; a size with a sensible
default falls back to it, one without raises :class:`TargetConfigError` naming the field and the override that fixes
it.
"""

from __future__ import annotations

from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from .errors import DrafterArgumentTypeError, DrafterConfigError, TargetConfigError, UnsupportedGenerationError

# dtype spellings ``from_target(..., dtype=...)`` accepts besides a torch.dtype.
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
               "float16": "float16", "fp16": "float16", "half": "float16"}
# Keyword arguments DFlash2Config takes that are not dataclass fields (legacy rope spellings).
_LEGACY_CONFIG_KEYS = ("rope_theta", "rope_scaling")

# DFlash2Config field -> the target config names that hold it, most specific first.
NAMES = {
    "target_hidden_size": ("hidden_size", "n_embd", "d_model", "model_dim", "embed_dim", "dim"),
    "num_target_layers": ("decoder_layers", "num_hidden_layers", "n_layer", "n_layers", "num_layers"),
    "num_attention_heads": ("decoder_attention_heads", "num_attention_heads", "n_head", "n_heads", "num_heads"),
    "num_key_value_heads": ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num"),
    "head_dim": ("head_dim",),
    "intermediate_size": ("decoder_ffn_dim", "intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size", "d_ff"),
    "max_position_embeddings": ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx"),
    "hidden_act": ("hidden_act", "hidden_activation", "activation_function"),
    "rms_norm_eps": ("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps", "norm_eps"),
}
# No position limit (ALiBi targets such as Bloom, recurrent ones): DFlash2Config's own default.
DEFAULT_MAX_POSITIONS = 8192
# Rope keys that change which head dimensions rotate: the drafter rotates its whole head, whatever the target does.
_TARGET_ONLY_ROPE_KEYS = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")


def lookup(config, field: str):
    """The first of ``NAMES[field]`` that ``config`` sets (not None), else None.

    A name whose lookup raises (per-layer configs that refuse one global value) or that holds a per-layer list
    counts as unset.
    """
    for name in NAMES[field]:
        try:
            value = getattr(config, name, None)
        except Exception:  # noqa: BLE001 - e.g. AmbiguousGlobalPerLayerAttributeError
            value = None
        if value is not None and not isinstance(value, (bool, list, tuple)):
            return value
    return None


def _required(config, field: str, overrides) -> int | None:
    value = lookup(config, field)
    if value is None and field not in overrides:
        raise TargetConfigError(
            f"The target's config ({type(config).__name__}) sets none of {', '.join(NAMES[field])}, so the drafter's "
            f"{field} is unknown: pass it, e.g. DFlash2DraftModel.from_target(target, {field}=...)."
        )
    return value


def text_config(target_or_config):
    """The text part of a model's (or config's) config: ``get_text_config()`` where it exists."""
    config = getattr(target_or_config, "config", target_or_config)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def target_hidden_size(config, fallback: int) -> int:
    """Width ``H_t`` of the target's hidden states; ``fallback`` (its embedding width) if the config names none."""
    value = lookup(config, "target_hidden_size")
    return int(fallback if value is None else value)


def drafter_sizes(config, hidden_size: int, overrides: dict | None = None) -> dict:
    """DFlash2Config fields copied from a target's text ``config`` for a drafter of width ``hidden_size``.

    Args:
        config: the target's text config (:func:`text_config`).
        hidden_size: the drafter width ``H`` (the target's embedding width).
        overrides: DFlash2Config fields the caller sets; they win (and are not required from ``config``), and the
            defaults derived from them follow them (head dim and key/value heads from an overridden head count).

    Returns:
        ``target_hidden_size``, ``num_target_layers``, ``num_attention_heads``, ``num_key_value_heads``,
        ``head_dim``, ``intermediate_size``, ``max_position_embeddings``, ``hidden_act``, ``rms_norm_eps``,
        ``rope_parameters``, then ``overrides``. Defaults where the config names nothing: MLP width ``4 * H``
        (GPT-2, Bloom and Falcon's own default), no position limit -> :data:`DEFAULT_MAX_POSITIONS`, key/value heads
        = heads, head dim ``H / heads``, activation ``silu``, norm epsilon ``1e-6``.

    Raises:
        TargetConfigError: no attention-head or layer count, or ``H`` not divisible by the head count without a
            ``head_dim`` (each error names the ``from_target`` override that fixes it).
    """
    overrides = dict(overrides or {})
    heads = overrides.get("num_attention_heads") or _required(config, "num_attention_heads", overrides)
    kv_heads = overrides.get("num_key_value_heads") or lookup(config, "num_key_value_heads")
    if getattr(config, "multi_query", False) is True and kv_heads is None:
        kv_heads = 1
    if not isinstance(kv_heads, int) or kv_heads < 1 or heads % kv_heads:
        kv_heads = heads
    head_dim = overrides.get("head_dim")
    if head_dim is None and "num_attention_heads" not in overrides:
        head_dim = lookup(config, "head_dim")
    if not isinstance(head_dim, int):
        if hidden_size % heads:
            raise TargetConfigError(
                f"The drafter width {hidden_size} is not divisible by {heads} attention heads and the target's config "
                "names no head_dim: pass DFlash2DraftModel.from_target(target, head_dim=...) or num_attention_heads=..."
            )
        head_dim = hidden_size // heads
    act, eps = lookup(config, "hidden_act"), lookup(config, "rms_norm_eps")
    fields = dict(
        target_hidden_size=target_hidden_size(config, fallback=hidden_size),
        num_target_layers=_required(config, "num_target_layers", overrides),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=lookup(config, "intermediate_size") or _mlp_width(config, hidden_size),
        # 0 / None / a negative "no limit" marker (some configs write -1) -> our default
        max_position_embeddings=max(lookup(config, "max_position_embeddings") or 0, 0) or DEFAULT_MAX_POSITIONS,
        hidden_act=act if isinstance(act, str) and act in ACT2FN else "silu",
        rms_norm_eps=float(eps) if isinstance(eps, (int, float)) else 1e-6,
        rope_parameters=rope_parameters(config),
    )
    return {**fields, **overrides}


def _mlp_width(config, hidden_size: int) -> int:
    ratio = getattr(config, "expansion_ratio", None)  # MPT
    return int(ratio * hidden_size) if isinstance(ratio, (int, float)) and ratio > 0 else 4 * hidden_size


def rope_parameters(config) -> dict:
    """The target's rope settings as the drafter applies them.

    Per-layer-type rope (Gemma3's ``{"full_attention": ..., "sliding_attention": ...}``): the full-attention
    (or ``main``, else the first) entry, since the drafter attends to its whole context.

    Targets without rotary positions (absolute embeddings, ALiBi) and rope types ``transformers`` cannot build
    give the default rope at the target's ``rope_theta`` (10000 if none); keys that rotate only part of a head or
    split it into sections are dropped (the drafter rotates its whole head).
    """
    rope = getattr(config, "rope_parameters", None)
    nested = {k: v for k, v in rope.items() if isinstance(v, dict)} if isinstance(rope, dict) else {}
    if nested:  # per layer type
        rope = nested.get("full_attention") or nested.get("main") or next(iter(nested.values()))
    rope = {k: v for k, v in rope.items() if k not in _TARGET_ONLY_ROPE_KEYS} if isinstance(rope, dict) else {}
    theta = rope.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0
    if rope.get("rope_type", "default") not in ("default", *ROPE_INIT_FUNCTIONS):
        rope = {}
    return {**rope, "rope_type": rope.get("rope_type", "default"), "rope_theta": float(theta)}


__all__ = [
    "DEFAULT_MAX_POSITIONS",
    "NAMES",
    "TargetConfigError",
    "drafter_sizes",
    "lookup",
    "rope_parameters",
    "target_hidden_size",
    "text_config",
]


def check_from_target_arguments(target, dtype, overrides: dict):
    """Checks what ``DFlash2DraftModel.from_target`` was given, before anything is built; returns the torch dtype
    (``None``: the target's) for ``dtype`` given as a ``torch.dtype`` or a name (``"bfloat16"``, ``"bf16"``, ...).

    Raises:
        DrafterArgumentTypeError: ``target`` is not a loaded model (a Hub id, a path, a config), or ``dtype`` is
            neither a torch.dtype nor a string.
        DrafterConfigError: an override that is not a DFlash2Config field (with the closest field name), or an
            unknown dtype name.
        TargetConfigError: a base model without an LM head (``LlamaModel`` instead of ``LlamaForCausalLM``).
        UnsupportedGenerationError: a stateful (recurrent) target, which assisted decoding cannot serve.
    """
    import difflib

    import torch
    from transformers import PretrainedConfig, PreTrainedModel

    from .configuration_dflash2 import DFlash2Config

    if isinstance(target, (str, bytes)) or hasattr(target, "__fspath__"):
        raise DrafterArgumentTypeError(
            f"from_target needs the loaded target model, got the string {str(target)!r}: load it first, e.g. "
            "target = AutoModelForCausalLM.from_pretrained(name), then DFlash2DraftModel.from_target(target)."
        )
    if isinstance(target, PretrainedConfig):
        raise DrafterArgumentTypeError(
            f"from_target needs the loaded target model, got a {type(target).__name__}: the drafter reads the "
            "target's embedding and LM-head weights too; pass AutoModelForCausalLM.from_config(config) or a loaded model."
        )
    if not isinstance(target, PreTrainedModel):
        raise DrafterArgumentTypeError(
            f"from_target needs a transformers causal LM (a PreTrainedModel), got {type(target).__name__}."
        )
    if getattr(target, "_is_stateful", False):
        raise UnsupportedGenerationError(
            f"{type(target).__name__} is a stateful (recurrent) model: stateful targets (Mamba, RWKV, "
            "recurrent and hybrid ones) cannot be served by assisted decoding (transformers refuses assisted "
            "generation for them: their state cannot be rolled back past rejected draft tokens). Use an "
            "attention-based target."
        )
    if target.get_output_embeddings() is None:
        raise TargetConfigError(
            f"{type(target).__name__} has no LM head (a base model): the drafter's proposals are scored by the "
            "target's LM head. Load the causal-LM class instead (AutoModelForCausalLM.from_pretrained(...))."
        )
    known = set(DFlash2Config.__dataclass_fields__) | set(_LEGACY_CONFIG_KEYS)
    for name in overrides:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise DrafterConfigError(
                f"from_target: unknown override {name!r}{hint}; overrides must be DFlash2Config fields."
            )
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if not isinstance(dtype, str):
        raise DrafterArgumentTypeError(f"from_target: dtype must be a torch.dtype or a name such as 'bfloat16', "
                                       f"got {type(dtype).__name__}.")
    name = DTYPE_NAMES.get(dtype.removeprefix("torch.").lower())
    if name is None:
        raise DrafterConfigError(f"from_target: unknown dtype {dtype!r}; use one of {sorted(DTYPE_NAMES)} or a "
                                 "torch.dtype (None: the target's).")
    return getattr(torch, name)


def drafter_fields_for_target(target, overrides: dict) -> dict:
    """DFlash2Config fields of a fresh drafter sized for ``target`` (``DFlash2DraftModel.from_target``).

    The drafter's width is the target's embedding width; the ``mask_token_id`` is pad, else unk (unless it is an
    EOS id), else the last id; the embedding scale and logit soft-capping are the target's. ``overrides`` win.

    Raises:
        TargetConfigError: the LM head reads another width than the embeddings give, or (from :func:`drafter_sizes`)
            the config names no head or layer count.
    """
    tc = text_config(target)
    hidden = target.get_input_embeddings().weight.shape[1]  # the block embeddings' width = the drafter's
    head = target.get_output_embeddings().weight
    if head.shape[1] != hidden:
        raise TargetConfigError(
            f"The target's LM head reads width {head.shape[1]} but its embeddings have width {hidden} (a projection "
            "between them): a DFlash2 drafter feeds both the same hidden state, so it cannot serve this target."
        )
    vocab = head.shape[0]
    eos = getattr(tc, "eos_token_id", None)
    eos = eos if isinstance(eos, list) else [eos]
    mask_token_id = next(
        (
            i
            for i in (getattr(tc, "pad_token_id", None), getattr(tc, "unk_token_id", None))
            if isinstance(i, int) and 0 <= i < vocab and i not in eos
        ),
        vocab - 1,
    )
    fields = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=5,
        mask_token_id=mask_token_id,
        input_embedding_scale=float(getattr(target.get_input_embeddings(), "embed_scale", 1.0)),
        final_logit_softcapping=getattr(tc, "final_logit_softcapping", None),
        selector_rank=min(256, max(32, hidden // 8)),
        eos_token_id=getattr(tc, "eos_token_id", None),
        pad_token_id=getattr(tc, "pad_token_id", None),
        bos_token_id=getattr(tc, "bos_token_id", None),
    )
    fields = drafter_sizes(tc, hidden, {**fields, **overrides})
    if "target_layer_ids" not in overrides:
        fields["target_layer_ids"] = None  # recomputed from num_target_layers
    return fields


def target_mismatches(config, target) -> list[str]:
    """What makes ``target`` another target than the drafter ``config`` was built for (hidden size, vocabulary,
    layer count; empty when it fits), one readable line each (``DFlash2DraftModel.check_target``)."""
    tc = text_config(target)
    problems = []
    hidden = target_hidden_size(tc, fallback=target.get_input_embeddings().weight.shape[1])
    if hidden != config.target_hidden_size:
        problems.append(f"hidden size {hidden} != drafter's target_hidden_size {config.target_hidden_size}")
    vocab = target.get_output_embeddings().weight.shape[0]
    if vocab != config.vocab_size:
        problems.append(f"vocabulary {vocab} != drafter's vocab_size {config.vocab_size}")
    layers = lookup(tc, "num_target_layers")  # unnamed in the config: from_target took the count as an override
    layers = config.num_target_layers if layers is None else layers
    if layers != config.num_target_layers or max(config.target_layer_ids) >= layers:
        problems.append(
            f"{layers} layers, drafter expects num_target_layers={config.num_target_layers} "
            f"with target_layer_ids={list(config.target_layer_ids)}"
        )
    return problems
