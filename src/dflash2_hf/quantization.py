"""int8 drafting on x86 CPUs: the drafter's linear layers as dynamic int8 (fbgemm) kernels.

A drafter pass over one block is a handful of thin matmuls (``8 x 576`` activations against ``576 x 1536`` weights
for SmolLM2), bound by reading the weights, not by arithmetic. On a CPU with AMX / AVX512-BF16 a bf16 drafter halves
those bytes, and int8 halves them again (9.7 vs 15.9 ms drafting per cycle on an AVX512-BF16 EPYC, docs/bench.md
"Drafting precision"); on an AVX2-only CPU bf16 is emulated (slower than fp32), and PyTorch's dynamic int8 linear
(``torch.ao.quantization.quantize_dynamic``: int8 weights, activations quantized per call, fbgemm kernels) reads a
quarter of the bytes. Measured on one thread of an AVX2 AMD EPYC (torch 2.13, ``examples/cost_curve.py --num-threads 1
--sizes 1,8``: a proposal of a full block of 8 with the shipped SmolLM2 drafter): 33 ms in fp32, 18-19 ms in int8.

Lossless like every drafting precision: the target verifies each draft, so int8 changes which tokens are proposed
(and the sampling proposal ``q``, which the rejection step uses as it is), never the output. Quantized: every
``nn.Linear`` of the decoder layers (attention and MLP projections, the convolutions' kernel projections); the
draft-vocabulary rows of the target LM head are quantized once when drafting starts
(:func:`dflash2_hf.generation.candidate_generator.draft_lm_head`). Kept in float: the context fusion ``fc``, norms,
rotary tables, the base convolution kernels and the candidate selector (its codebooks are gathered, not multiplied).

Why ``fc`` stays float: a dynamic int8 linear quantizes its input with ONE scale per call, and the target hidden
states ``fc`` fuses carry "massive activations" on the first token (SmolLM2-135M: max ``|h|`` ~25,000 there against
~100-450 on every other token, in the fused layers from the middle of the network on). One scale for both rounds every other token's features to 0-2 int8
steps, so the drafter loses its context: teacher-forced through the serving path (first 96 tokens of 30 ShareGPT dev
answers, every 2nd anchor, the shipped drafter) an int8 ``fc`` drops tau from 1.84 to 1.18 (first drafts agreeing
with fp32's: 19%), while int8 decoder layers and LM head keep 1.83 (97%). ``fc`` runs once per new context token,
not per drafted block, so keeping it float costs little.

An int8 drafter drafts only: it cannot be trained, saved or moved to a GPU (quantize a float copy for drafting;
:func:`dflash2_hf.bench.load_drafter` does). ``torch.ao`` quantized tensors are deprecated in favour of ``torchao``
(pytorch/pytorch#184982) but present and fast in the torch this package pins (2.13); where they are missing,
:func:`int8_support` says so and ``--drafter-dtype auto`` falls back to fp32.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from .errors import UnsupportedGenerationError

_ENGINES = ("x86", "fbgemm")  # the engines with int8 dynamic linear kernels for x86 CPUs


def int8_support(device: torch.device | str) -> tuple[bool, str]:
    """Whether dynamic int8 drafting runs on ``device`` with fast kernels, and why, e.g. ``(True, "fbgemm int8 on
    this CPU")``. True only on x86 CPUs whose torch has ``torch.ao.quantization.quantize_dynamic`` and the x86/fbgemm
    quantized engine. Never raises for a valid device string."""
    device = torch.device(device)
    if device.type != "cpu":
        return False, f"int8 drafting runs on the CPU only (device {device.type})"
    if not hasattr(torch.ao.quantization, "quantize_dynamic"):
        return False, f"torch {torch.__version__} has no torch.ao.quantization.quantize_dynamic"
    engines = [e for e in _ENGINES if e in torch.backends.quantized.supported_engines]
    if not engines:
        return False, f"torch {torch.__version__} has no x86/fbgemm quantized engine on this CPU"
    return True, f"{engines[0]} int8 on this CPU"


def is_int8(drafter) -> bool:
    """Whether :func:`quantize_drafter` turned ``drafter`` into an int8 drafting copy."""
    return bool(getattr(drafter, "int8_drafting", False))


def _quantize(module: nn.Module) -> nn.Module:
    with warnings.catch_warnings():  # torch.ao's deprecation notices, once per layer: said once in the module doc
        warnings.filterwarnings("ignore", category=UserWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        return torch.ao.quantization.quantize_dynamic(module, {nn.Linear}, dtype=torch.qint8, inplace=True)


def quantize_drafter(drafter):
    """Turns ``drafter`` (a float32 CPU :class:`~dflash2_hf.DFlash2DraftModel`, eval mode) into an int8 drafting copy,
    in place, and returns it. A drafter already on prepacked CPU kernels (:func:`dflash2_hf.optimize_for_cpu`) is
    quantized all the same; its remaining float linears stay prepacked.

    Raises:
        UnsupportedGenerationError: the drafter is not float32 on the CPU, still carries unmerged LoRA layers
            (merge them first: ``peft_model.merge_and_unload()``), is already int8, or this torch/CPU has no fast
            int8 kernels (:func:`int8_support`).
    """
    supported, reason = int8_support(drafter.device)
    if not supported:
        raise UnsupportedGenerationError(f"Cannot draft in int8: {reason}. Use --drafter-dtype fp32 (or bf16).")
    if is_int8(drafter):
        raise UnsupportedGenerationError("This drafter is already quantized to int8.")
    if drafter.dtype != torch.float32:
        raise UnsupportedGenerationError(
            f"int8 drafting quantizes a float32 drafter; this one is {drafter.dtype}. Load it with dtype=torch.float32."
        )
    lora = [name for name, _ in drafter.named_modules() if name.endswith("lora_A")]
    if lora or hasattr(drafter, "peft_config"):
        raise UnsupportedGenerationError(
            "This drafter carries LoRA layers (e.g. "
            f"{lora[0] if lora else 'a PEFT wrapper'}): merge the adapter first (peft_model.merge_and_unload(), as "
            "dflash2_hf.bench.load_adapted_drafter does), then quantize."
        )
    drafter.eval()
    from .cpu_kernels import is_optimized, optimize_for_cpu, restore_stock_kernels

    prepacked = is_optimized(drafter)  # quantize_dynamic replaces plain nn.Linear only: unpack first, repack the rest
    if prepacked:
        restore_stock_kernels(drafter)
    _quantize(drafter.layers)  # not drafter.fc: see the module docstring (per-call activation scale vs outlier tokens)
    if prepacked:
        optimize_for_cpu(drafter)
    drafter.int8_drafting = True
    drafter._lm_head_cast = None  # the cached draft LM head is rebuilt in int8 at the next proposal
    return drafter


def quantized_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
    """A dynamic int8 linear holding ``weight`` ``(out, in)`` (and an optional float ``bias`` ``(out,)``): e.g. the
    draft-vocabulary rows of the LM head; ``(..., in)`` float32 inputs give ``(..., out)`` float32 outputs."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    linear.weight.data = weight.detach().float().cpu()
    if bias is not None:
        linear.bias.data = bias.detach().float().cpu()
    return _quantize(nn.Sequential(linear))[0]


def is_quantized_linear(module) -> bool:
    """Whether ``module`` is a dynamic int8 linear (from :func:`quantized_linear` or :func:`quantize_drafter`)."""
    return isinstance(module, torch.ao.nn.quantized.dynamic.Linear)


def parameter_count(model) -> int:
    """Weights of ``model``, int8 drafting copies included (their packed linear weights are no ``nn.Parameter``)."""
    count = sum(p.numel() for p in model.parameters())
    for module in model.modules():
        if is_quantized_linear(module):
            bias = module.bias()
            count += module.weight().numel() + (bias.numel() if bias is not None else 0)
    return count


def check_int8_drafting(drafter) -> None:
    """Raises :class:`UnsupportedGenerationError` if an int8 drafting copy was moved off the CPU or cast from float32
    after :func:`quantize_drafter` (its int8 kernels take float32 CPU inputs only)."""
    if is_int8(drafter) and (drafter.device.type != "cpu" or drafter.dtype != torch.float32):
        raise UnsupportedGenerationError(
            f"This int8 drafting copy is now {drafter.dtype} on {drafter.device}; int8 drafting runs in float32 on the "
            "CPU only. Keep it there (no .to()/.half()/.cuda() after quantize_drafter), or draft with the float drafter "
            "(bf16 on GPUs)."
        )


def refuse_int8(drafter, action: str) -> None:
    """Raises :class:`UnsupportedGenerationError` if ``drafter`` is an int8 drafting copy (``action``: what was asked,
    e.g. "saved")."""
    if is_int8(drafter):
        raise UnsupportedGenerationError(
            f"An int8-quantized drafter drafts only and cannot be {action}: use the float drafter, e.g. "
            "dflash2_hf.load_drafter(name, target, precision=\"fp32\") (or \"bf16\"; load_drafter picks int8 by default "
            "on x86 CPUs); CLI: --drafter-dtype fp32."
        )


__all__ = ["check_int8_drafting", "int8_support", "is_int8", "is_quantized_linear", "parameter_count", "quantize_drafter", "quantized_linear", "refuse_int8"]
