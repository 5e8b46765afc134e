"""Routes ``target.generate(..., assistant_model=draft)`` to the DFlash2 loop when ``draft`` is one of our drafters.

``transformers`` offers no public hook to choose the assisted-decoding implementation per assistant, so on import we
wrap ``GenerationMixin._assisted_decoding`` (the method ``generate()`` looks up for assisted generation) once. The
wrapper hands the call to :func:`~dflash2_hf.generation.decoding.dflash2_assisted_decoding` only when the assistant is
a :class:`~dflash2_hf.DFlash2DraftModel` (or a PEFT model around one) and ``speculation_type`` is not ``"dflash"``
(that is transformers' built-in DFlash path, which our drafter also serves); every other call goes to the original
method unchanged. The wrapper relies on private internals, so it refuses transformers versions we did not test,
pointing at the public, patch-free path: ``generate(..., custom_generate=dflash2_generate, drafter=draft)``
(:mod:`.public`).
"""

from __future__ import annotations

import functools
import os

import transformers
from packaging.version import Version
from transformers.generation.utils import GenerationMixin

from ..errors import UnsupportedTransformersVersionError
from .decoding import dflash2_assisted_decoding

TESTED_TRANSFORMERS = (Version("5.23.0"), Version("5.25.0"))  # [low, high)
ALLOW_UNTESTED_ENV = "DFLASH2_ALLOW_UNTESTED_TRANSFORMERS"
# The patch-free call (transformers' public custom_generate), named in every message about the private routing.
PUBLIC_PATH = ("target.generate(ids, custom_generate=dflash2_hf.dflash2_generate, drafter=draft) "
               "(transformers' public custom_generate; docs/generation.md)")


def check_transformers_version(version: str | None = None) -> None:
    """Raises :class:`UnsupportedTransformersVersionError` outside the tested range (override: env var set to 1)."""
    version = version or transformers.__version__
    low, high = TESTED_TRANSFORMERS
    if low <= Version(version) < high or os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        return
    raise UnsupportedTransformersVersionError(
        f"generate(..., assistant_model=draft) reaches the DFlash2 loop through a private transformers method, "
        f"tested with transformers >={low},<{high}; found {version}. Use the public path instead: "
        f"{PUBLIC_PATH}; or install a tested version (pip install 'transformers>={low},<{high}'), or set "
        f"{ALLOW_UNTESTED_ENV}=1 to try this one at your own risk."
    )


def is_dflash2_drafter(model) -> bool:
    """True for a DFlash2DraftModel, also when wrapped by PEFT."""
    from ..modeling_dflash2 import DFlash2DraftModel

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return isinstance(base, DFlash2DraftModel)


def install() -> None:
    """Wraps ``GenerationMixin._assisted_decoding`` once (idempotent).

    On a transformers without the private methods it wraps, nothing is patched and a warning names the public path
    (``import dflash2_hf`` still works; ``generate(..., assistant_model=draft)`` then cannot reach our loop)."""
    missing = [name for name in ("_assisted_decoding", "_validate_generation_mode") if not hasattr(GenerationMixin, name)]
    if missing:
        import warnings

        warnings.warn(
            f"transformers {transformers.__version__} has no GenerationMixin.{', '.join(missing)}: "
            f"generate(..., assistant_model=draft) cannot be routed to the DFlash2 loop. Use {PUBLIC_PATH}.",
            stacklevel=2,
        )
        return
    original = GenerationMixin._assisted_decoding
    if getattr(original, "_dflash2_routed", False):
        return

    @functools.wraps(original)
    def _assisted_decoding(self, *args, **kwargs):
        assistant = kwargs.get("assistant_model")
        generation_config = kwargs.get("generation_config", args[3] if len(args) > 3 else None)
        if (
            assistant is not None
            and is_dflash2_drafter(assistant)
            and getattr(generation_config, "speculation_type", None) != "dflash"
        ):
            check_transformers_version()
            return dflash2_assisted_decoding(self, *args, **kwargs)
        return original(self, *args, **kwargs)

    _assisted_decoding._dflash2_routed = True
    _assisted_decoding._dflash2_original = original
    GenerationMixin._assisted_decoding = _assisted_decoding

    # generate() validates the assistant (vocabulary -> "different tokenizers", beams) before any decoding loop
    # runs: check a DFlash2 drafter against the target first, so a mismatch gets our message and fix.
    original_validate = GenerationMixin._validate_generation_mode

    @functools.wraps(original_validate)
    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
        assistant = generation_mode_kwargs.get("assistant_model")
        if assistant is not None and is_dflash2_drafter(assistant):
            from ..errors import UnsupportedGenerationError

            base = assistant.get_base_model() if hasattr(assistant, "get_base_model") else assistant
            base.check_target(self)
            if (generation_config.num_beams or 1) > 1:
                raise UnsupportedGenerationError(
                    f"num_beams={generation_config.num_beams}: beam search cannot use a DFlash2 drafter (speculative "
                    "decoding verifies one sequence). Use num_beams=1, or generate without assistant_model."
                )
        return original_validate(self, generation_mode, generation_config, generation_mode_kwargs)

    GenerationMixin._validate_generation_mode = _validate_generation_mode
