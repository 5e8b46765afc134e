"""A drafter ready to draft for a given target, in one call: :func:`load_drafter`.

``DFlash2DraftModel.from_pretrained`` gives the weights; drafting fast also needs the cheapest drafting precision for
the target's device (int8 on x86 CPUs), the target's device, eval mode, a check that the drafter was built for this
target, and, on a CPU, the prepacked linear kernels (:func:`dflash2_hf.optimize_for_cpu`). :func:`load_drafter` does
all of it and says what it chose (``draft.dflash2_loading``, also logged at INFO). ``dflash2 generate``, ``demo`` and
``bench`` load their drafters the same way.
"""

from __future__ import annotations

import os

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)

PRECISIONS = ("auto", "int8", "bf16", "fp32")


def load_drafter_weights(spec: str | os.PathLike, target, dtype: torch.dtype | None = None, int8: bool = False,
                         adapter: str | os.PathLike | None = None, strict: bool = True, **fresh_overrides):
    """The drafter ``spec`` on ``target``'s device in eval mode, in ``dtype`` (default: the target's), or
    quantized for drafting with ``int8=True`` (loaded in float32, then
    :func:`dflash2_hf.quantization.quantize_drafter`). ``spec``: a folder, a Hub id, a shipped name, or ``"fresh"``
    (an untrained drafter sized for ``target``, :meth:`DFlash2DraftModel.from_target`, with ``fresh_overrides``).
    ``adapter``: a LoRA adapter merged in before any quantization (:func:`dflash2_hf.load_adapter`, ``strict`` as
    there). No target check and no kernel change: :func:`load_drafter` does both."""
    from .modeling_dflash2 import DFlash2DraftModel
    from .quantization import quantize_drafter

    param = next(target.parameters())
    dtype = torch.float32 if int8 else dtype or param.dtype
    if spec == "fresh":
        drafter = DFlash2DraftModel.from_target(target, dtype=dtype, **fresh_overrides)
    else:  # loaded in `dtype` rather than cast after: a cast would also round the float32 rotary frequencies
        drafter = DFlash2DraftModel.from_pretrained(spec, dtype=dtype)
    drafter = drafter.to(param.device).eval()
    if adapter is not None:  # merged in float: an int8 copy cannot take an adapter
        from .lora import load_adapter

        drafter = load_adapter(drafter, adapter, strict=strict).merge_and_unload().eval()
    return quantize_drafter(drafter) if int8 else drafter


def load_drafter(name_or_path: str | os.PathLike, target, precision: str = "auto", cpu_kernels: str = "optimized",
                 adapter: str | os.PathLike | None = None, **fresh_overrides):
    """Loads a drafter for ``target`` and makes it draft as cheaply as ``target``'s device allows.

    Args:
        name_or_path: a drafter folder, a Hub id (``org/name``), a shipped drafter's name
            (``"dflash2-smollm2-135m-instruct"``), or ``"fresh"`` (untrained, sized for ``target``; ``fresh_overrides``
            set its :class:`~dflash2_hf.DFlash2Config` fields).
        target: the loaded ``transformers`` causal LM the drafter drafts for (its device decides the precision).
        precision: ``"auto"`` (default: :func:`dflash2_hf.drafting_precision`: int8 on x86 CPUs, else bf16 where the
            device computes it natively, else fp32), ``"int8"``, ``"bf16"`` or ``"fp32"``. Never changes the output:
            the target verifies every draft.
        cpu_kernels: ``"optimized"`` (default): on a CPU, the drafter's float linears run on prepacked oneDNN
            kernels (:func:`dflash2_hf.optimize_for_cpu`; the int8 linears are PyTorch's own); ``"stock"`` leaves
            them. The target is not touched: call ``optimize_for_cpu(target)`` yourself.
        adapter: a LoRA adapter of this drafter (a ``dflash2 train --lora`` folder, a Hub id or the shipped
            ``"dflash2-smollm2-135m-instruct-code-lora"``), merged into it before the precision and kernels are
            applied (no adapter cost per drafting step). To keep the adapter as its own layers (train it further),
            use :func:`dflash2_hf.load_adapter` on a float drafter instead.

    Returns:
        the :class:`~dflash2_hf.DFlash2DraftModel` on ``target``'s device, in eval mode; what was chosen is in its
        ``dflash2_loading`` attribute (one line, e.g. ``"int8 (auto: x86 CPU with ...); prepacked oneDNN linears for
        ..."``) and logged at INFO.

    Raises:
        DrafterArgumentTypeError: ``target`` is no loaded causal LM (a name, a config, a drafter), or keyword
            arguments other than a ``"fresh"`` drafter's config fields (e.g. a misspelled ``precision``).
        ValueError: an unknown ``precision`` / ``cpu_kernels``, or ``"int8"`` where this device cannot run it (the
            reason).
        DrafterTargetMismatchError: the drafter was built for another target (sizes differ).
        FileNotFoundError, CheckpointError, HubUnreachableError: from :meth:`DFlash2DraftModel.from_pretrained`
            (and for ``adapter``, from :func:`dflash2_hf.load_adapter`).
        AdapterMismatchError: ``adapter`` was trained for another drafter or on other base weights.
    """
    from .cpu_kernels import KERNELS, cpu_kernels_summary, optimize_for_cpu
    from .generation.precision import PRECISION_ALIASES, resolve_drafting_precision

    _check_arguments(name_or_path, target, fresh_overrides)
    if PRECISION_ALIASES.get(precision, precision) not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not one of {', '.join(PRECISIONS)}")
    if cpu_kernels not in KERNELS:
        raise ValueError(f"cpu_kernels={cpu_kernels!r} is not one of {', '.join(KERNELS)}")
    device = next(target.parameters()).device
    try:
        precision, label = resolve_drafting_precision(precision, device)
    except ValueError as err:  # int8 where the device has no int8 kernels
        raise ValueError(f"precision={precision!r}: {err}") from None
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(precision)
    drafter = load_drafter_weights(name_or_path, target, dtype=dtype, int8=precision == "int8", adapter=adapter,
                                   **fresh_overrides)
    drafter.check_target(target)
    if adapter is not None:
        label = f"{label}; LoRA adapter {os.fspath(adapter)} merged"
    if device.type == "cpu" and cpu_kernels == "optimized":
        optimize_for_cpu(drafter)
    drafter.dflash2_loading = f"{label}; {cpu_kernels_summary(drafter)}"
    logger.info("drafter %s: %s", os.fspath(name_or_path), drafter.dflash2_loading)
    return drafter


def _check_arguments(name_or_path, target, fresh_overrides: dict) -> None:
    """Refuses what :func:`load_drafter` cannot use, before anything loads: a target that is no loaded causal LM,
    a name that is no path or string, and keyword arguments other than a fresh drafter's config fields."""
    import difflib

    from transformers import PreTrainedModel

    from .errors import DrafterArgumentTypeError

    if not isinstance(target, PreTrainedModel) or target.get_output_embeddings() is None:
        kind = type(target).__name__
        hint = (f" (load it first: dflash2_hf.load_target({target!r}) or AutoModelForCausalLM.from_pretrained(...))"
                if isinstance(target, str) else "")
        raise DrafterArgumentTypeError(
            f"load_drafter(name_or_path, target): target must be the loaded transformers causal LM the drafter drafts "
            f"for (a model with an LM head), got {kind}{hint}.")
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise DrafterArgumentTypeError(
            f"load_drafter(name_or_path, target): name_or_path must be a folder, a Hub id, a shipped drafter's name "
            f"or 'fresh', got {type(name_or_path).__name__}.")
    if fresh_overrides and name_or_path != "fresh":
        names = sorted(fresh_overrides)
        close = difflib.get_close_matches(names[0], ["precision", "cpu_kernels", "adapter"], n=1)
        hint = f" Did you mean {close[0]}=?" if close else (
            " The drafting dtype is precision= ('int8', 'bf16', 'fp32'); the device is the target's."
            if {"dtype", "torch_dtype", "device", "device_map"} & set(names) else "")
        raise DrafterArgumentTypeError(
            f"load_drafter: unexpected keyword argument(s) {names} for {os.fspath(name_or_path)!r}: extra keywords "
            f"set the config of a 'fresh' drafter only.{hint}")


__all__ = ["PRECISIONS", "load_drafter", "load_drafter_weights"]
