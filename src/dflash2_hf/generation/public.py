"""The patch-free way to run the DFlash2 loop: ``transformers``' public ``generate(..., custom_generate=callable)``.

::

    from dflash2_hf import dflash2_generate
    out = target.generate(input_ids, custom_generate=dflash2_generate, drafter=draft, max_new_tokens=128)

``generate()`` prepares the inputs, logits processors, stopping criteria and cache as usual, then calls the callable as
its decoding loop. It forwards the callable only the keyword arguments of its own that ``GenerationMixin._sample``
lacks (DESIGN.md section 5): ``assistant_model=`` and ``streamer=`` never reach it, so the drafter comes in as
``drafter=`` and a streamer as ``token_streamer=``. The output, ``draft.generation_stats`` and every check are those of
``generate(..., assistant_model=draft)`` (:mod:`.routing`, which needs a private method of ``transformers``).
"""

from __future__ import annotations

from ..errors import UnsupportedGenerationError
from .decoding import dflash2_assisted_decoding


def dflash2_generate(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
                     drafter=None, token_streamer=None, **model_kwargs):
    """DFlash2 speculative decoding as a ``custom_generate`` callable of ``model.generate()``.

    Args:
        model: the target (``generate()`` passes itself).
        drafter: the :class:`~dflash2_hf.DFlash2DraftModel` (or a PEFT model around one); required.
        token_streamer: a ``transformers`` streamer (``TextStreamer``): ``generate()`` keeps its own ``streamer=``
            from custom loops.

    Returns:
        what ``generate(..., assistant_model=drafter)`` returns (a tensor, or a ``GenerateDecoderOnlyOutput`` with
        ``return_dict_in_generate=True``); ``drafter.generation_stats`` holds the call's statistics.

    Raises:
        UnsupportedGenerationError: no ``drafter=`` (e.g. it was passed as ``assistant_model=``, which transformers
            does not forward to a custom loop), beam search, or any setting the DFlash2 loop refuses.
    """
    from .routing import is_dflash2_drafter

    if drafter is None or not is_dflash2_drafter(drafter):
        got = "nothing" if drafter is None else type(drafter).__name__
        raise UnsupportedGenerationError(
            f"custom_generate=dflash2_generate needs drafter=<DFlash2DraftModel> (got {got}): generate() does not "
            "forward assistant_model= to a custom_generate callable. Call target.generate(ids, "
            "custom_generate=dflash2_generate, drafter=draft, ...)."
        )
    if (generation_config.num_beams or 1) > 1:
        raise UnsupportedGenerationError(
            f"num_beams={generation_config.num_beams}: beam search cannot use a DFlash2 drafter (speculative "
            "decoding verifies one sequence). Use num_beams=1."
        )
    model_kwargs.pop("synced_gpus", None)
    if token_streamer is not None:  # what generate() does with its own streamer before the loop: the prompt first
        token_streamer.put(input_ids.cpu())
    return dflash2_assisted_decoding(model, input_ids, logits_processor, stopping_criteria, generation_config,
                                     streamer=token_streamer, assistant_model=drafter, **model_kwargs)


__all__ = ["dflash2_generate"]
