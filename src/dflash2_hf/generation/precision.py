"""Which dtype to draft in: bf16 only where the hardware computes it natively.

Drafting precision never changes the output (the target verifies every draft), only its cost. bf16 halves the weight
traffic, which pays on GPUs with bf16 support and on CPUs with bf16 instructions (AVX512-BF16, AMX); on CPUs without
them torch converts every bf16 matmul to fp32 and back, which costs more than fp32 itself. Measured with
``examples/cost_curve.py`` on an AVX2-only AMD EPYC (2 cores, torch 2.13): one drafter proposal of a full block of 8
takes 24.0 ms in fp32 and 58.1 ms in bf16 on one thread (26.2 / 33.9 ms on two).
"""

from __future__ import annotations

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)


def has_native_bf16(device: torch.device | str) -> bool:
    """Whether ``device`` computes bfloat16 matmuls natively.

    CUDA: compute capability 8.0 or newer (Ampere on) of that very GPU; ROCm: True. (Not
    ``torch.cuda.is_bf16_supported()``: it also says yes where bf16 is only emulated, and checks the current GPU.) CPU: AVX512-BF16 or AMX tiles, as torch reports them
    (``torch.cpu._is_avx512_bf16_supported`` / ``_is_amx_tile_supported``; False where this torch lacks those probes).
    Other device types: True (their own kernels decide; bf16 is the usual serving dtype there).
    """
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return False
        index = device.index if device.index is not None else torch.cuda.current_device()
        return bool(torch.version.hip) or torch.cuda.get_device_capability(index) >= (8, 0)
    if device.type == "cpu":
        probes = (getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
        return any(probe() for probe in probes if probe is not None)
    return True


def drafting_dtype(device: torch.device | str) -> torch.dtype:
    """The cheaper drafter dtype on ``device``: ``torch.bfloat16`` where :func:`has_native_bf16`, else ``torch.float32``."""
    return torch.bfloat16 if has_native_bf16(device) else torch.float32


def warn_if_emulated_bf16(drafter) -> None:
    """Logs once when a bf16 drafter runs on a CPU without bf16 instructions (slower than fp32 there; output unchanged)."""
    if drafter.dtype == torch.bfloat16 and drafter.device.type == "cpu" and not has_native_bf16(drafter.device):
        logger.warning_once(
            "The drafter is bfloat16 but this CPU has no bf16 instructions (AVX512-BF16/AMX): drafting costs more than "
            "in float32 here (2.4x on one thread of an AVX2 CPU; the output is the same either way). Load it with "
            "DFlash2DraftModel.from_pretrained(..., dtype=torch.float32) or call draft.float(); on the dflash2 "
            "command line pass --drafter-dtype auto or fp32."
        )


__all__ = ["drafting_dtype", "has_native_bf16", "warn_if_emulated_bf16"]
