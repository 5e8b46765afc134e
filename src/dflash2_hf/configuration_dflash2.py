"""Configuration of the DFlash2 drafter.

Source: DFlash block-diffusion drafter (arXiv 2602.06036) and the DFlash2 additions (local convolution, parallel
path selector); the exact specification this package follows is ``DESIGN.md`` sections 2, 3 and 6.

Two on-disk config formats load into :class:`DFlash2Config`:

* ours: ``model_type: "dflash2"``, every field flat (what :meth:`save_pretrained` writes; ``AutoConfig`` loads it);
* the published DFlash / DFlash2 format: a Qwen3 config (``model_type: "qwen3"``) with a nested ``dflash_config``
  dict, ``num_target_layers`` and ``architectures: ["DFlashDraftModel"]`` (v1: no convolution, no selector) or
  ``["DFlash2DraftModel"]``. :meth:`DFlash2Config.from_dict` translates it.
"""

from __future__ import annotations

from typing import Any

import functools

from huggingface_hub.dataclasses import strict
from huggingface_hub.errors import StrictDataclassError
from transformers import PreTrainedConfig
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from .errors import DFlash2Error, DrafterConfigError
from .masking import SLIDING_ATTENTION, check_layer_types
from .published import published_target_layer_ids, to_published, translate_published


# Integer fields (None allowed only for the optional ones): a string or float from a hand-written config.json would
# otherwise fail later with a bare TypeError, or silently index with a float.
_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "max_position_embeddings", "num_target_layers", "block_size", "mask_token_id", "conv_kernel_size",
               "conv_group_size", "selector_top_k", "selector_rank")
_OPTIONAL_INT_FIELDS = ("num_key_value_heads", "head_dim", "target_hidden_size", "draft_vocab_size", "sliding_window")
# Counts and sizes that must be at least 1 (num_hidden_layers=-1 would build a drafter with no layers).
_POSITIVE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "max_position_embeddings", "num_target_layers", "conv_kernel_size", "conv_group_size",
                    "selector_top_k", "selector_rank")
# Keys of a default rope dict; any other (factor, ...) means a scaling whose rope type was left out.
_DEFAULT_ROPE_KEYS = {"rope_type", "type", "rope_theta"}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def default_target_layer_ids(num_target_layers: int, num_layers: int = 5) -> list[int]:
    """Target layers whose hidden states feed the drafter (DESIGN.md section 2): our default for our own configs.

    ``num_layers`` layers spread evenly from layer 1 to layer ``L - 3`` of an ``L``-layer target, rounded, without
    duplicates; 0-based decoder-layer indices (``hidden_states[i + 1]`` in ``transformers`` outputs). Every config
    we write records the resolved list, so this default never decides how a saved drafter is read. A published
    config without ``target_layer_ids`` gets the reference's rule instead
    (:func:`dflash2_hf.published.published_target_layer_ids`).

    Raises:
        ValueError: the target is too shallow (fewer than 4 layers) to spread layers over.
    """
    if num_target_layers < 4:
        raise ValueError(
            f"A target with {num_target_layers} layers is too shallow for the default layer spread (1 .. L-3); "
            "pass target_layer_ids=[...] explicitly."
        )
    first, last = 1, num_target_layers - 3
    if num_layers == 1:
        return [last]
    ids = [int(round(first + i * (last - first) / (num_layers - 1))) for i in range(num_layers)]
    return sorted(set(ids))


@strict
class DFlash2Config(PreTrainedConfig):
    r"""
    Configuration of a :class:`~dflash2_hf.DFlash2DraftModel`.

    The drafter is a small Qwen3-style decoder (pre-norm RMSNorm, attention with per-head ``q_norm``/``k_norm``,
    rotary positions, SwiGLU MLP) that reads the target's hidden states and fills one block per forward pass.

    Args:
        vocab_size (`int`): the TARGET's vocabulary size (the drafter uses the target's embeddings and LM head).
        hidden_size (`int`): drafter width ``H`` (usually the target's hidden size).
        target_hidden_size (`int`, *optional*): target width ``H_t``; defaults to ``hidden_size``.
        num_target_layers (`int`): number of decoder layers of the target the drafter was built for.
        target_layer_ids (`list[int]`, *optional*): 0-based target layers fused into the context features;
            defaults to :func:`default_target_layer_ids`.
        block_size (`int`): ``B``, block length including the anchor (``B - 1`` draft tokens per cycle).
        mask_token_id (`int`): id (inside the target vocabulary) that fills the ``B - 1`` draft slots.
        use_local_conv (`bool`): enable the two-tap grouped dynamic causal convolutions (DFlash2).
        conv_kernel_size (`int`), conv_group_size (`int`): convolution taps and channels per dynamic group.
        use_candidate_selector (`bool`): enable the parallel path selector (DFlash2); off = top-1 path.
        selector_top_k (`int`), selector_rank (`int`): candidates per position ``k`` and codebook rank ``r``.
        output_multiplier (`float`): logits = LM head(h) * output_multiplier.
        final_logit_softcapping (`float`, *optional*): if set, logits = c * tanh(logits / c).
        input_embedding_scale (`float`): multiplies the raw target embedding lookup (e.g. Gemma's sqrt(H_t)).
        draft_vocab_size (`int`, *optional*): size of the draft vocabulary (see
            :meth:`~dflash2_hf.DFlash2DraftModel.set_draft_vocab`); None = the target's whole vocabulary.
        layer_types (`list[str]`, *optional*): per drafter layer, ``"full_attention"`` or ``"sliding_attention"``;
            None = every layer full (DESIGN.md section 6, :mod:`dflash2_hf.masking`).
        sliding_window (`int`, *optional*): window of the sliding layers (None = a sliding layer has no window).
        is_causal (`bool`, *optional*): every layer causal (True) or bidirectional (False); None = sliding layers
            causal, full ones bidirectional. The block is always bidirectional when no layer is sliding and this is
            None (the DFlash default).
        rope_parameters (`dict`, *optional*): ``transformers``' rope dict (``rope_type`` one of ``"default"`` and
            ``ROPE_INIT_FUNCTIONS``: linear, dynamic, yarn, longrope, llama3, ...); the 4.x keys ``rope_theta`` /
            ``rope_scaling`` are accepted too and standardised by ``transformers`` (a ``rope_scaling`` must name
            its ``rope_type``). Default: ``{"rope_type": "default", "rope_theta": 100000.0}``; ``rope_theta``
            defaults to 100000.0 when only ``rope_scaling`` is given.
        Other fields (heads, norms, MLP width) follow ``transformers``' Qwen3 config.

    Raises:
        ValueError: on init, a field value that cannot work (see :meth:`validate_drafter`), or of the wrong type
            (a string where an integer, a boolean or a number belongs).
    """

    model_type = "dflash2"
    default_theta = 100000.0  # transformers' rope standardisation default, when rope_theta is not given

    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 4
    num_attention_heads: int = 9
    num_key_value_heads: int | None = 3
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 8192
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-5
    rope_parameters: dict | None = None
    attention_bias: bool = False
    attention_dropout: float | int = 0.0
    tie_word_embeddings: bool = False
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    # Target binding (validated against the target at generate time).
    target_hidden_size: int | None = None
    num_target_layers: int = 30
    target_layer_ids: list[int] | None = None

    # Block diffusion.
    block_size: int = 16
    mask_token_id: int = 0

    # DFlash2 local convolution.
    use_local_conv: bool = True
    conv_kernel_size: int = 2
    conv_group_size: int = 16

    # DFlash2 parallel path selector.
    use_candidate_selector: bool = True
    selector_top_k: int = 16
    selector_rank: int = 256

    # Draft vocabulary (inference speed): drafts come from these `draft_vocab_size` most useful target tokens only
    # (ids stored as the `draft_vocab_ids` buffer); None = the whole vocabulary. Verification is unaffected.
    draft_vocab_size: int | None = None

    # Attention layout per drafter layer (DESIGN.md section 6): None everywhere = full bidirectional attention.
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    is_causal: bool | None = None

    # Output / input scaling to match targets that scale embeddings or soft-cap logits.
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    input_embedding_scale: float = 1.0

    # sha256 (16 hex) of the weights as last saved, written by `save_pretrained` and checked by `from_pretrained` (a
    # file overwritten with finite garbage still parses); None = not recorded (older or published checkpoints).
    weights_sha256: str | None = None

    def __post_init__(self, **kwargs):
        self._validate_types()  # the defaults below compute with these
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.target_layer_ids is None:
            self.target_layer_ids = default_target_layer_ids(self.num_target_layers)
        if self.rope_parameters is None and not any(k in kwargs for k in ("rope_theta", "rope_scaling")):
            self.rope_parameters = {"rope_type": "default", "rope_theta": self.default_theta}
        super().__post_init__(**kwargs)  # standardises legacy rope_theta / rope_scaling into rope_parameters

    def validate_drafter(self):
        """Checks the drafter's own shapes (called by ``@strict`` on init and save).

        Raises:
            ValueError: a shape, id, type or activation that cannot work, naming the field and the fix.
        """
        self._validate_types()
        if self.hidden_act not in ACT2FN:
            raise ValueError(f"hidden_act={self.hidden_act!r} is not an activation transformers knows; use one of "
                             f"{sorted(ACT2FN)[:12]} ... (Qwen3 drafters use 'silu').")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (anchor + at least one draft slot), got {self.block_size}.")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id={self.mask_token_id} is outside the target vocabulary [0, {self.vocab_size}); "
                "pick an id of the target's embedding table."
            )
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty: the drafter needs at least one target layer.")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise ValueError(
                f"target_layer_ids {bad} are outside the target's layers [0, {self.num_target_layers}); "
                "use 0-based decoder-layer indices of the target."
            )
        if self.use_local_conv and self.hidden_size % self.conv_group_size:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by conv_group_size={self.conv_group_size}."
            )
        if self.use_candidate_selector and not 1 <= self.selector_top_k <= self.vocab_size:
            raise ValueError(f"selector_top_k={self.selector_top_k} must be in [1, vocab_size].")
        if self.final_logit_softcapping is not None and self.final_logit_softcapping < 0:
            raise ValueError(f"final_logit_softcapping={self.final_logit_softcapping} must be positive (0/None = off).")
        self._validate_rope()
        self._validate_attention()

    def _validate_types(self):
        for name in _INT_FIELDS + _OPTIONAL_INT_FIELDS:
            value = getattr(self, name)
            if not (_is_int(value) or (value is None and name in _OPTIONAL_INT_FIELDS)):
                raise ValueError(f"{name}={value!r} must be an integer, got {type(value).__name__}: write it as a "
                                 "JSON number without quotes or decimals.")
        small = [f"{name}={getattr(self, name)}" for name in _POSITIVE_FIELDS if getattr(self, name) < 1]
        if small:
            raise ValueError(f"{', '.join(small)}: must be >= 1 (a count or a size).")
        ids = self.target_layer_ids
        if ids is not None and not (isinstance(ids, (list, tuple)) and all(_is_int(i) for i in ids)):
            raise ValueError(f"target_layer_ids={ids!r} must be a list of integer target-layer indices, e.g. "
                             "[1, 9, 17].")
        if self.is_causal is not None and not isinstance(self.is_causal, bool):
            raise ValueError(f"is_causal={self.is_causal!r} must be true, false or null (a boolean, not a "
                             f"{type(self.is_causal).__name__}).")

    def _validate_rope(self):
        rope = self.rope_parameters or {}
        nested = sorted(k for k, v in rope.items() if isinstance(v, dict))
        if nested:
            raise ValueError(
                f"rope_parameters holds per-layer-type dicts {nested}: the drafter applies one rope to every layer; "
                "give a single rope dict."
            )
        rope_type = rope.get("rope_type")
        if rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(
                f"Unknown rope type {rope_type!r} in rope_parameters (or rope_scaling); transformers builds "
                f"{sorted(['default', *ROPE_INIT_FUNCTIONS])}."
            )
        theta = rope.get("rope_theta")
        if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
            raise ValueError(f"rope_theta={theta!r} (in rope_parameters, or the top-level rope_theta) must be a "
                             "positive number: write it without quotes, e.g. 1000000.0.")
        stray = sorted(set(rope) - _DEFAULT_ROPE_KEYS)
        if rope_type == "default" and stray:
            raise ValueError(
                f"The rope settings {rope} give {stray} but no rope type, so they would be read as the default rope "
                "(which ignores them): add \"rope_type\" (e.g. \"linear\", \"dynamic\", \"yarn\", \"llama3\") to "
                "rope_scaling / rope_parameters, or remove those keys."
            )

    def _validate_attention(self):
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(
                    f"layer_types has {len(self.layer_types)} entries for num_hidden_layers={self.num_hidden_layers}: "
                    "give one per drafter layer."
                )
            check_layer_types(self.layer_types)
        if self.sliding_window is not None:
            if isinstance(self.sliding_window, bool) or self.sliding_window < 1:
                raise ValueError(f"sliding_window must be a positive number of positions, got {self.sliding_window!r}.")
            if SLIDING_ATTENTION not in (self.layer_types or ()):
                raise ValueError(
                    f"sliding_window={self.sliding_window} is set but no layer is a sliding one: set layer_types, "
                    f"e.g. {[SLIDING_ATTENTION] * self.num_hidden_layers}."
                )

    @property
    def num_draft_tokens(self) -> int:
        """Draft tokens proposed per cycle: ``block_size - 1``."""
        return self.block_size - 1

    # ------------------------------------------------------------------ published format
    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs):
        """``PreTrainedConfig.get_config_dict``, with a published-format dict already translated to our fields.

        So ``from_pretrained`` sees our own layout and does not warn that a ``qwen3`` config instantiates a
        ``dflash2`` one (the published format is a supported input, not a mismatch).
        """
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        if "dflash_config" in config_dict:
            config_dict = cls.translate_published(config_dict)
        return config_dict, kwargs

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs):
        """Builds a config from our flat dict or from the published DFlash/DFlash2 (Qwen3 + ``dflash_config``) dict."""
        if "dflash_config" in config_dict:
            config_dict = cls.translate_published(config_dict)
        return super().from_dict(config_dict, **kwargs)

    def to_published_dict(self) -> dict[str, Any]:
        """This config in the published DFlash/DFlash2 layout (Qwen3 fields + ``dflash_config``; DESIGN.md section 6).

        v1 (``DFlashDraftModel``) when both the convolution and the selector are off, else v2.
        """
        return to_published(self.to_dict(), self.use_local_conv, self.use_candidate_selector)

    @staticmethod
    def translate_published(config_dict: dict[str, Any]) -> dict[str, Any]:
        """Translates a published-format config dict into our flat field names (:func:`dflash2_hf.published.
        translate_published`, DESIGN.md section 6).

        Raises:
            DrafterConfigError (a ValueError): an unknown architecture, no ``num_target_layers`` / ``mask_token_id``, a field or layer
                type we do not implement, or an ``is_causal`` / ``dflash_config.causal`` that is not a boolean or
                that contradict each other.
        """
        try:
            return translate_published(config_dict, set(DFlash2Config.__dataclass_fields__))
        except DFlash2Error:
            raise
        except ValueError as err:
            raise DrafterConfigError(f"published DFlash config: {err}") from err


def _our_errors(method):
    """``method`` of DFlash2Config raising :class:`DrafterConfigError` (a ``ValueError``) for an invalid value, instead of
    huggingface_hub's ``StrictDataclassClassValidationError`` wrapping our message (``@strict`` runs the
    ``validate_*`` methods on init and on save)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except DFlash2Error:
            raise
        except (StrictDataclassError, ValueError, TypeError) as err:
            cause = err.__cause__ if isinstance(err, StrictDataclassError) and err.__cause__ is not None else err
            raise DrafterConfigError(f"DFlash2Config: {cause}") from err

    wrapper.__is_defined_by_strict_decorator__ = True  # lets @strict subclasses override validate() as usual
    return wrapper


DFlash2Config.__init__ = _our_errors(DFlash2Config.__init__)
DFlash2Config.validate = _our_errors(DFlash2Config.validate)


__all__ = ["DFlash2Config", "default_target_layer_ids", "published_target_layer_ids"]
