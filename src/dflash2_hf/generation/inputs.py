"""What the DFlash2 loop accepts from ``generate()``: input checks, the prompt's layout, the cache's roll-back check.

Every input form ``generate()`` accepts either decodes exactly as plain decoding does or is refused here with an
:class:`~dflash2_hf.UnsupportedGenerationError` (a ``ValueError``) that names the setting and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import cache_utils

from ..errors import UnsupportedGenerationError

_QUANTIZED_LAYERS = tuple(getattr(cache_utils, name) for name in ("BaseQuantizedLayer",) if hasattr(cache_utils, name))

# transformers 5.24 renamed the generation cache kwarg/output field `past_key_values` -> `cache`.
CACHE_KEYS = ("cache", "past_key_values")


def cache_key(model_kwargs: dict) -> str:
    """The model-kwargs key holding the target's cache (``cache`` from transformers 5.24 on, else ``past_key_values``).

    Raises:
        UnsupportedGenerationError: there is no cache (``use_cache=False``, or a target without ``Cache`` support).
    """
    for key in CACHE_KEYS:
        if model_kwargs.get(key) is not None:
            return key
    raise UnsupportedGenerationError(
        "Speculative decoding needs the target's KV cache, and generate() prepared none: pass use_cache=True (some "
        "configs, e.g. MPT's, default to use_cache=False), or generate without assistant_model for a target that "
        "does not support transformers Cache objects."
    )


def validate(target, input_ids, generation_config, synced_gpus: bool, model_kwargs: dict) -> None:
    """Refuses what the loop cannot do exactly; see :class:`UnsupportedGenerationError` for each message."""
    if input_ids.shape[0] != 1:
        copies = generation_config.num_return_sequences or 1
        cause = f"num_return_sequences={copies}" if copies > 1 else f"a batch of {input_ids.shape[0]}"
        raise UnsupportedGenerationError(
            f"DFlash2 speculative decoding runs batch size 1 (like transformers' assisted decoding); got {cause}. "
            "Call generate() once per prompt and per returned sequence."
        )
    if synced_gpus:
        raise UnsupportedGenerationError("synced_gpus is not supported with a DFlash2 drafter.")
    if target.config.is_encoder_decoder:
        raise UnsupportedGenerationError("DFlash2 drafters serve decoder-only targets.")
    if generation_config.return_dict_in_generate and (
        generation_config.output_attentions or generation_config.output_hidden_states
    ):
        raise UnsupportedGenerationError(
            "output_attentions / output_hidden_states are not returned on the DFlash2 path; "
            "drop them or generate without assistant_model."
        )
    if not generation_config.use_cache:
        raise UnsupportedGenerationError("Speculative decoding needs use_cache=True: pass generate(..., use_cache=True).")
    cache = model_kwargs.get(cache_key(model_kwargs))
    if cache.get_seq_length() > 0:
        raise UnsupportedGenerationError(
            "A pre-filled target cache is not supported with a DFlash2 drafter (the drafter needs the hidden states of "
            "every prompt position, which a cache does not keep): pass the whole prompt without a cache."
        )


@dataclass(frozen=True)
class PromptLayout:
    """Where the prompt sits relative to the loop's ``input_ids``.

    Attributes:
        offset: prompt positions the target sees but ``input_ids`` lacks (``inputs_embeds`` prompts: ``input_ids``
            then holds the generated tokens only); masks, token types and positions cover ``offset + len(input_ids)``.
        visible: ``(offset + prompt,)`` bool, the prompt positions the attention mask shows (None: all); padding is
            kept out of the drafter's context.
    """

    offset: int
    visible: torch.Tensor | None

    @property
    def hidden_positions(self) -> int:
        """Prompt positions masked out (padding)."""
        return 0 if self.visible is None else int((~self.visible).sum())

    @classmethod
    def of(cls, input_ids: torch.LongTensor, model_kwargs: dict) -> "PromptLayout":
        """The layout of ``generate()``'s prepared ``input_ids`` / ``inputs_embeds`` / ``attention_mask``.

        Raises:
            UnsupportedGenerationError: ``inputs_embeds`` shorter than ``input_ids``, or an attention mask that is
                not 2-D or does not cover the prompt.
        """
        embeds = model_kwargs.get("inputs_embeds")
        offset = 0 if embeds is None else embeds.shape[1] - input_ids.shape[1]
        if offset < 0:
            raise UnsupportedGenerationError(
                f"inputs_embeds covers {embeds.shape[1]} positions but input_ids {input_ids.shape[1]}: pass "
                "inputs_embeds for the whole prompt (input_ids, if given, as its last positions)."
            )
        mask = model_kwargs.get("attention_mask")
        if mask is None:
            return cls(offset, None)
        if mask.dim() != 2 or mask.shape[1] != offset + input_ids.shape[1]:
            raise UnsupportedGenerationError(
                f"The attention mask has shape {tuple(mask.shape)} but the prompt has {offset + input_ids.shape[1]} "
                "positions: pass a 2-D (1, prompt length) padding mask (1 = token, 0 = padding)."
            )
        visible = mask[0].bool()
        return cls(offset, None if bool(visible.all()) else visible)


def _cannot_roll_back(layer) -> bool:
    # transformers 5.23 marks quantized layers croppable (they inherit DynamicLayer's flag) though crop fails on them
    return not getattr(layer, "is_croppable", False) or isinstance(layer, _QUANTIZED_LAYERS)


def check_rollback(cache, generation_config) -> None:
    """Refuses a target cache that ``crop`` cannot put back as it was (checked after the prefill, as transformers does).

    Speculative decoding discards the rejected drafts' keys/values after every verification; a quantized cache, a
    static sliding-window cache longer than its window or a recurrent state cannot forget them, and a roll-back that
    silently kept them would change every later token.

    Raises:
        UnsupportedGenerationError (a ``ValueError``): ``cache.is_croppable`` is False, a layer stores quantized
            states, or the cache has no ``crop``.
    """
    layers = sorted({type(layer).__name__ for layer in getattr(cache, "layers", ()) if _cannot_roll_back(layer)})
    if callable(getattr(cache, "crop", None)) and getattr(cache, "is_croppable", True) and not layers:
        return
    implementation = getattr(generation_config, "cache_implementation", None)
    raise UnsupportedGenerationError(
        f"The target's cache {type(cache).__name__}"
        + (f" (cache_implementation={implementation!r})" if implementation else "")
        + (f" has layers that cannot be rolled back ({', '.join(layers)})" if layers else " cannot be rolled back")
        + ": speculative decoding must drop the rejected drafts' keys/values after every verification. Use the "
        "default dynamic cache (drop cache_implementation / pass cache=DynamicCache()), or generate without "
        "assistant_model for this cache (or for a target with recurrent layers)."
    )

__all__ = ["CACHE_KEYS", "PromptLayout", "cache_key", "check_rollback", "validate"]
