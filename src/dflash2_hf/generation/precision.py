"""Which dtype to draft and verify in: bf16 only where the hardware computes it natively.

One probe (:func:`bf16_support`) decides both the drafter's dtype (:func:`drafting_dtype`) and the target's
(:func:`target_dtype`). Drafting precision never changes the output (the target verifies every draft), only its cost;
the target's precision does: in bf16 a forward over several tokens rounds differently from one token at a time, so
greedy outputs may part at near-ties (``dflash2_hf.bench.fidelity`` classifies each such divergence). bf16 halves the weight
traffic, which pays on GPUs with bf16 support and on CPUs with bf16 instructions (AVX512-BF16, AMX); on CPUs without
them torch converts every bf16 matmul to fp32 and back, which costs more than fp32 itself. Measured with
``examples/cost_curve.py`` on an AVX2-only AMD EPYC (2 cores, torch 2.13): one drafter proposal of a full block of 8
takes 24.0 ms in fp32 and 58.1 ms in bf16 on one thread (26.2 / 33.9 ms on two).
"""

from __future__ import annotations

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)


_CPU_PROBES = (("_is_amx_tile_supported", "AMX"), ("_is_avx512_bf16_supported", "AVX512-BF16"))


def _gpu_name(index: int) -> str:
    try:
        return torch.cuda.get_device_name(index)
    except Exception:  # a driver that answers the capability but not the name
        return f"GPU {index}"


def bf16_support(device: torch.device | str) -> tuple[bool, str]:
    """Whether ``device`` computes bfloat16 matmuls natively, and why, e.g. ``(False, "no native bf16 on this CPU")`` (no
    AVX512-BF16, no AMX) or ``(True, "native bf16 on NVIDIA H200, compute capability 9.0")``.

    CUDA: compute capability 8.0 or newer (Ampere on) of that very GPU; ROCm: True. (Not
    ``torch.cuda.is_bf16_supported()``: it also says yes where bf16 is only emulated, and checks the current GPU.)
    CPU: AMX tiles or AVX512-BF16, as torch reports them (``torch.cpu._is_amx_tile_supported`` /
    ``_is_avx512_bf16_supported``; False where this torch lacks both probes). Other device types: True (their own
    kernels decide; bf16 is the usual serving dtype there). Never raises for a valid device string.
    """
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return False, "torch sees no CUDA GPU"
        index = device.index if device.index is not None else torch.cuda.current_device()
        if torch.version.hip:
            return True, f"native bf16 on {_gpu_name(index)}, ROCm"
        major, minor = torch.cuda.get_device_capability(index)
        if (major, minor) >= (8, 0):
            return True, f"native bf16 on {_gpu_name(index)}, compute capability {major}.{minor}"
        return False, f"no native bf16 on {_gpu_name(index)}, compute capability {major}.{minor} < 8.0"
    if device.type == "cpu":
        probes = [(getattr(torch.cpu, name, None), label) for name, label in _CPU_PROBES]
        for probe, label in probes:
            if probe is not None and probe():
                return True, f"{label} on this CPU"
        if all(probe is None for probe, _ in probes):
            return False, f"torch {torch.__version__} cannot tell whether this CPU has bf16 instructions"
        return False, "no native bf16 on this CPU"
    return True, f"bf16 assumed native on {device.type}"


def has_native_bf16(device: torch.device | str) -> bool:
    """Whether ``device`` computes bfloat16 matmuls natively (:func:`bf16_support` without the reason)."""
    return bf16_support(device)[0]


def drafting_dtype(device: torch.device | str) -> torch.dtype:
    """The cheaper FLOAT drafter dtype on ``device``: ``torch.bfloat16`` where :func:`has_native_bf16`, else
    ``torch.float32`` (for ``from_pretrained(..., dtype=...)``). On x86 CPUs an int8 drafting copy is cheaper still:
    :func:`drafting_precision`."""
    return torch.bfloat16 if has_native_bf16(device) else torch.float32


def drafting_precision(device: torch.device | str) -> tuple[str, str]:
    """The cheapest drafting precision on ``device`` and why: ``("int8" | "bf16" | "fp32", reason)``.

    Drafting reads the drafter's weights once per block and does little arithmetic with them, so what it costs is
    their bytes. On x86 CPUs with PyTorch's dynamic int8 kernels (:func:`dflash2_hf.quantization.int8_support`) that
    is int8 (a quarter of fp32's bytes, half of bf16's), bf16 instructions or not: measured on one thread of an AMD
    EPYC with AVX512-BF16, the shipped drafter drafts a cycle in 9.7 ms in int8 against 15.9 ms in bf16 at tau 2.50
    vs 2.52 on held-out prompts (``dflash2 bench --drafter-dtype int8 --previous-drafter-dtype bf16``, docs/bench.md
    "Drafting precision"); on an AVX2-only EPYC 18-19 ms against 33 ms in fp32. Elsewhere (GPUs, other CPUs):
    :func:`drafting_dtype`. Drafting precision never changes the output: the target verifies every draft. Turn a
    float32 drafter into the int8 copy with :func:`dflash2_hf.quantization.quantize_drafter`. Never raises for a valid
    device string.
    """
    from ..quantization import int8_support

    int8, int8_reason = int8_support(device)
    if int8:
        return "int8", int8_reason
    native, reason = bf16_support(device)
    return ("bf16" if native else "fp32"), f"{reason}; {int8_reason}"


PRECISION_ALIASES = {"bfloat16": "bf16", "float32": "fp32"}


def resolve_drafting_precision(precision: str, device: torch.device | str) -> tuple[str, str]:
    """What a requested drafting precision means on ``device``: ``("int8" | "bf16" | "fp32", label for reports)``.

    The one rule behind :func:`dflash2_hf.load_drafter`'s ``precision=`` and the CLI's ``--drafter-dtype``.
    ``precision``: ``"auto"`` (:func:`drafting_precision`, labelled with its reason, e.g. ``"int8 (auto: x86 int8 on
    this CPU)"``), ``"int8"``, ``"bf16"`` / ``"bfloat16"`` (kept where emulated, labelled ``"bf16 (explicit; no native
    bf16 on this CPU: emulated, slower than fp32)"``) or ``"fp32"`` / ``"float32"``.

    Raises:
        ValueError: an unknown ``precision``, or ``"int8"`` where this device has no int8 kernels (the reason and the
            choices that work).
    """
    from ..quantization import int8_support

    choice = PRECISION_ALIASES.get(precision, precision)
    if choice == "auto":
        resolved, reason = drafting_precision(device)
        return resolved, f"{resolved} (auto: {reason})"
    if choice == "int8":
        supported, reason = int8_support(device)
        if not supported:
            raise ValueError(f"{reason}; use fp32 or bf16")
        return "int8", "int8"
    if choice == "bf16":
        native, reason = bf16_support(device)
        return "bf16", "bf16" if native else f"bf16 (explicit; {reason}: emulated, slower than fp32)"
    if choice == "fp32":
        return "fp32", "fp32"
    raise ValueError(f"unknown drafting precision {precision!r}; choose from auto, int8, bf16, fp32")


def target_dtype(device: torch.device | str) -> torch.dtype:
    """The faster target dtype on ``device``: ``torch.bfloat16`` where :func:`has_native_bf16`, else
    ``torch.float32`` (the same rule as :func:`drafting_dtype`; ``--dtype auto`` of the CLI).

    Unlike the drafter's, the target's dtype matters for the output: greedy decoding with a drafter is token-for-token
    identical to plain greedy decoding in float32; in bfloat16 it is identical up to near-ties (see docs/bench.md,
    "Fidelity in bf16"). On CPUs without bf16 instructions torch emulates bf16, slower than float32: there the answer
    is float32. ``device``: a ``torch.device`` or its string (``"cpu"``, ``"cuda:1"``).
    """
    return torch.bfloat16 if has_native_bf16(device) else torch.float32


def auto_dtype_label(device: torch.device | str) -> str:
    """What ``--dtype auto`` resolves to on ``device`` and why, for reports: e.g.
    ``"fp32 (auto: no native bf16 on this CPU)"`` or ``"bf16 (auto: AMX on this CPU)"``."""
    native, reason = bf16_support(device)
    return f"{'bf16' if native else 'fp32'} (auto: {reason})"


def warn_if_emulated_bf16(drafter) -> None:
    """Logs once when a bf16 drafter runs on a CPU without bf16 instructions (slower than fp32 there; output unchanged)."""
    if drafter.dtype == torch.bfloat16 and drafter.device.type == "cpu" and not has_native_bf16(drafter.device):
        logger.warning_once(
            "The drafter is bfloat16 but this CPU has no bf16 instructions (AVX512-BF16/AMX): drafting costs more than "
            "in float32 here (2.4x on one thread of an AVX2 CPU; the output is the same either way). Load it with "
            "dflash2_hf.load_drafter(name, target) (it picks the cheapest precision), or DFlash2DraftModel."
            "from_pretrained(..., dtype=torch.float32), or call draft.float(); on the dflash2 "
            "command line pass --drafter-dtype auto or fp32."
        )


__all__ = ["PRECISION_ALIASES", "auto_dtype_label", "bf16_support", "drafting_dtype", "drafting_precision", "has_native_bf16",
           "resolve_drafting_precision", "target_dtype", "warn_if_emulated_bf16"]
