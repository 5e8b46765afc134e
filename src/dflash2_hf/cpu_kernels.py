"""Prepacked oneDNN linears for CPU inference: :func:`optimize_for_cpu`.

Stock ``torch.nn.functional.linear`` on a CPU runs a GEMM that reorders (packs) the weight matrix into the kernel's
blocked layout on every call. For one decoding step that cost is hidden in the memory traffic, but speculative
decoding verifies 2-16 tokens per forward, and there the repacking dominates: on a 2-core AMD EPYC (AVX2) every
linear of SmolLM2-135M costs 47 ms with one row and 83 ms with two. oneDNN can pack a weight once
(``torch.ops.mkldnn._reorder_linear_weight``) and then multiply any number of rows against the packed copy
(``torch.ops.mkldnn._linear_pointwise``): these are the kernels PyTorch's Inductor emits for frozen CPU linears.
:func:`optimize_for_cpu` swaps every ``nn.Linear`` of a model for one that keeps such a packed copy.

What stays the same: parameters, ``state_dict`` and ``save_pretrained`` (the packed copy is a plain attribute, never
a parameter or buffer); the module tree (each linear keeps its name and stays an ``nn.Linear``); training (a forward
that needs gradients uses the stock kernel). What the packed path refuses to compute with: stale weights (a weight
changed in place, replaced, or moved after packing is repacked before its next use), tensors on other devices
(stock kernel), dtypes this CPU's oneDNN has no fast kernel for (stock kernel: bf16 needs AVX512-BF16 or AMX, fp16
AVX512-FP16 or AMX-FP16).

Memory: the packed copy is a second copy of every swapped weight, in the weight's dtype (for SmolLM2-135M in fp32,
including its tied LM head: 0.54 GB more). :func:`restore_stock_kernels` frees it.

Numerics: a packed product rounds differently from the stock one (fp32: ~1e-6 relative), as the stock kernel
itself does between a 1-row and an 8-row product; greedy outputs are compared with stock plain ``generate()`` by
``dflash2 bench`` (every divergence located and classified).
"""

from __future__ import annotations

import functools
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.utils import logging

logger = logging.get_logger(__name__)

KERNELS = ("optimized", "stock")


@dataclass
class CpuKernelReport:
    """What :func:`optimize_for_cpu` did to one model (``model.dflash2_cpu_kernels``).

    ``packed``: names of the linears now on prepacked oneDNN kernels; ``skipped``: linears left on the stock kernel,
    name -> reason; ``extra_bytes``: bytes the packed copies will take once built (each is built on first use, in the
    weight's dtype); ``reason``: why nothing was packed, empty where something was.
    """

    packed: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    extra_bytes: int = 0
    reason: str = ""

    def summary(self) -> str:
        if not self.packed:
            return f"stock CPU kernels ({self.reason or 'no linear could be packed'})"
        return (f"prepacked oneDNN linears for {len(self.packed)} of {len(self.packed) + len(self.skipped)} linears "
                f"(+{self.extra_bytes / 2**20:.0f} MiB)")


@functools.lru_cache(maxsize=None)
def _dtype_supported(dtype: torch.dtype) -> tuple[bool, str]:
    if dtype == torch.float32:
        return True, ""
    if dtype == torch.bfloat16:
        ok = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        return ok, "" if ok else "no native bf16 in this CPU's oneDNN (needs AVX512-BF16 or AMX)"
    if dtype == torch.float16:
        ok = bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        return ok, "" if ok else "no native fp16 in this CPU's oneDNN"
    return False, f"dtype {dtype} has no oneDNN linear"


def kernels_available() -> tuple[bool, str]:
    """Whether this torch build can prepack linears for oneDNN, and why not (never raises)."""
    if not torch.backends.mkldnn.is_available():
        return False, "this torch build has no oneDNN (mkldnn)"
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise") or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False, f"torch {torch.__version__} lacks mkldnn._linear_pointwise"
    return True, ""


class PrepackedLinear(nn.Linear):
    """An ``nn.Linear`` that multiplies against a weight copy prepacked once for oneDNN.

    Made by :func:`optimize_for_cpu` by changing the class of an existing ``nn.Linear`` (no new parameters). Input
    ``(..., in_features)``, output ``(..., out_features)``, as ``nn.Linear``. Falls back to ``F.linear`` for
    non-CPU tensors, inputs of another dtype than the weight, forwards that need gradients, and weight dtypes this
    CPU has no fast oneDNN kernel for. The packed copy is keyed on the weight's storage, version counter, dtype and
    device, so a weight changed in place (``copy_``, ``load_state_dict``), replaced or moved is repacked before use.
    """

    _dflash2_packed: tuple | None = None
    _dflash2_one_row: tuple | None = None  # (torch threads, packed kernel wins for one row): the hot path's lookup

    def __getstate__(self):  # copy.deepcopy / pickle: the packed copy is opaque and rebuilt on first use
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__
        state = dict(state)
        state.pop("_dflash2_packed", None)
        return state

    def _packed_weight(self) -> torch.Tensor:
        weight = self.weight
        key = (weight.data_ptr(), weight._version, weight.dtype, tuple(weight.shape))
        cached = self._dflash2_packed
        if cached is None or cached[0] != key:
            with torch.no_grad():
                packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
            self._dflash2_packed = cached = (key, packed)
        return cached[1]

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        bias = self.bias
        if (input.device.type != "cpu" or weight.device.type != "cpu" or input.dtype != weight.dtype
                or (bias is not None and bias.dtype != weight.dtype)
                or (torch.is_grad_enabled() and (weight.requires_grad or input.requires_grad))
                or not _dtype_supported(weight.dtype)[0] or input.dim() < 2 or input.numel() == 0):
            return super().forward(input)
        if input.numel() == input.shape[-1]:
            threads = torch.get_num_threads()
            if self._dflash2_one_row is None or self._dflash2_one_row[0] != threads:
                self._dflash2_one_row = (threads, _packed_wins_one_row(self, input))
            if not self._dflash2_one_row[1]:
                return super().forward(input)  # one row: the stock GEMV, where it measured faster on this CPU
        return torch.ops.mkldnn._linear_pointwise(input, self._packed_weight(), bias, "none", [], "")


# (dtype, out_features, in_features, threads) -> whether the packed kernel beat the stock one for ONE row
_ONE_ROW_CHOICE: dict[tuple, bool] = {}


def _packed_wins_one_row(module: PrepackedLinear, row: torch.Tensor, repeats: int = 5) -> bool:
    """For one input row the stock kernel is a GEMV that does not repack, and on some CPUs and thread counts it beats
    the packed kernel (AVX2 EPYC, SmolLM2-135M: 1 thread stock 63 ms vs packed 80 ms per decoding step; 2 threads
    packed wins). Timed once per weight shape, dtype and thread count (best of ``repeats`` each, interleaved);
    the answer is kept for the process."""
    weight = module.weight
    key = (weight.dtype, weight.shape[0], weight.shape[1], torch.get_num_threads())
    choice = _ONE_ROW_CHOICE.get(key)
    if choice is None:
        packed = module._packed_weight()
        x = row.detach()
        stock_s, packed_s = [], []
        for i in range(repeats + 1):
            start = time.perf_counter()
            torch.nn.functional.linear(x, weight, module.bias)
            middle = time.perf_counter()
            torch.ops.mkldnn._linear_pointwise(x, packed, module.bias, "none", [], "")
            end = time.perf_counter()
            if i:  # the first of each is a warm-up
                stock_s.append(middle - start)
                packed_s.append(end - middle)
        choice = _ONE_ROW_CHOICE[key] = min(packed_s) < min(stock_s)
    return choice


def optimize_for_cpu(model: nn.Module, kernels: str = "optimized") -> nn.Module:
    """Run ``model``'s linears on prepacked oneDNN kernels on this CPU; in place, returns ``model``, idempotent.

    ``model``: any ``nn.Module``, e.g. a ``transformers`` causal LM (target) or a :class:`DFlash2DraftModel`
    (drafter). Every exact ``nn.Linear`` whose weight is on the CPU in fp32 (or bf16 / fp16 where this CPU's
    oneDNN computes them natively) becomes a :class:`PrepackedLinear`; subclasses of ``nn.Linear`` (quantized or
    adapter layers) and other modules are left alone, and so are LoRA ``base_layer`` linears' wrappers (their inner
    ``nn.Linear`` is swapped). Tied weights (e.g. an LM head sharing the embedding matrix) stay tied: the packed copy
    is an extra tensor, the parameter is shared as before. ``kernels="stock"`` undoes it
    (:func:`restore_stock_kernels`).

    What it did is in ``model.dflash2_cpu_kernels`` (:class:`CpuKernelReport`; ``.summary()`` is one line) and is
    logged at INFO. Memory cost: one packed copy per swapped weight, built on its first forward.

    Raises ``TypeError`` if ``model`` is not an ``nn.Module`` and ``ValueError`` for an unknown ``kernels``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"optimize_for_cpu() takes a torch nn.Module (a target or a drafter), got "
                        f"{type(model).__name__}")
    if kernels not in KERNELS:
        raise ValueError(f"kernels={kernels!r} is not one of {', '.join(KERNELS)}")
    if kernels == "stock":
        return restore_stock_kernels(model)
    report = CpuKernelReport()
    ok, why = kernels_available()
    if not ok:
        report.reason = why
    else:
        for name, module in model.named_modules():
            if type(module) not in (nn.Linear, PrepackedLinear):
                continue
            weight = module.weight
            if weight.device.type != "cpu":
                report.skipped[name] = f"weight on {weight.device}"
                continue
            supported, reason = _dtype_supported(weight.dtype)
            if not supported:
                report.skipped[name] = reason
                continue
            if type(module) is nn.Linear:
                module.__class__ = PrepackedLinear
            report.packed.append(name)
            report.extra_bytes += weight.numel() * weight.element_size()
        if not report.packed:
            reasons = sorted(set(report.skipped.values()))
            report.reason = "; ".join(reasons) if reasons else "no nn.Linear in this model"
    model.dflash2_cpu_kernels = report
    logger.info("%s: %s", type(model).__name__, report.summary())
    return model


def restore_stock_kernels(model: nn.Module) -> nn.Module:
    """Undo :func:`optimize_for_cpu`: every :class:`PrepackedLinear` of ``model`` becomes an ``nn.Linear`` again and
    its packed copy is freed. In place, returns ``model``; a model that was never optimized is returned unchanged."""
    for module in model.modules():
        if type(module) is PrepackedLinear:
            module.__dict__.pop("_dflash2_packed", None)
            module.__class__ = nn.Linear
    model.dflash2_cpu_kernels = CpuKernelReport(reason="stock kernels chosen")
    return model


def cpu_kernels_summary(model: nn.Module) -> str:
    """One line on the kernels ``model`` runs on: what :func:`optimize_for_cpu` reported, or ``"stock CPU kernels"``."""
    report = getattr(model, "dflash2_cpu_kernels", None)
    return report.summary() if report is not None else "stock CPU kernels"


def is_optimized(model: nn.Module) -> bool:
    """Whether any linear of ``model`` runs on the prepacked kernels of :func:`optimize_for_cpu`."""
    return any(type(module) is PrepackedLinear for module in model.modules())


@contextmanager
def stock_kernels(model: nn.Module):
    """Within the block, ``model``'s prepacked linears run on the stock kernel; their packed copies are kept, so
    leaving the block costs nothing (used by ``dflash2 bench`` to time stock ``plain`` next to optimized methods)."""
    swapped = [module for module in model.modules() if type(module) is PrepackedLinear]
    for module in swapped:
        module.__class__ = nn.Linear
    try:
        yield model
    finally:
        for module in swapped:
            module.__class__ = PrepackedLinear
