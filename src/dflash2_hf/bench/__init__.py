"""Speed and acceptance benchmark of DFlash2 speculative decoding against its baselines (DESIGN.md section 8).

Python use::

    import dflash2_hf
    from dflash2_hf.bench import BenchSettings, load_bench_prompts, load_drafter, run_benchmark
    from dflash2_hf.targets import load_target

    target, tokenizer = load_target("smollm2")
    drafter = load_drafter("fresh", target)              # or a folder / Hub id
    prompts, skipped = load_bench_prompts(["sharegpt", "humaneval"], tokenizer, num_prompts=10)
    results = run_benchmark(target, drafter, prompts, BenchSettings(max_new_tokens=128), out_dir="runs/bench")
    results["aggregates"]   # one dict per (data set, method)

Command line: ``dflash2 bench --help``. How to read the numbers: docs/bench.md.
"""

from __future__ import annotations

import os

import torch

from ..loading import load_drafter_weights
from ..quantization import parameter_count
from .fidelity import annotate_records, calibrate
from .prompts import Prompt, load_bench_prompts
from .recorder import ForwardRecorder, per_position_rates
from .report import ALL, aggregate, environment, markdown, plot, records_to_json, write_outputs
from .runner import METHOD_DESCRIPTIONS, METHODS, BenchSettings, RawRecord, generate_once, run_methods


def load_drafter(spec: str, target, dtype: torch.dtype | None = None, int8: bool = False, **fresh_overrides):
    """The harness's loader, with an explicit ``dtype`` / ``int8`` (what ``dflash2 bench`` resolved from its
    options): :func:`dflash2_hf.loading.load_drafter_weights`. Users: :func:`dflash2_hf.load_drafter` (picks the
    precision, checks the target, prepacks CPU kernels)."""
    return load_drafter_weights(spec, target, dtype=dtype, int8=int8, **fresh_overrides)


def load_adapted_drafter(spec: str, adapter_path: str | os.PathLike, target, dtype: torch.dtype | None = None,
                         strict: bool = True, int8: bool = False):
    """The drafter ``spec`` (see :func:`load_drafter`) with the LoRA adapter at ``adapter_path`` merged into it
    (``merge_and_unload``: no adapter overhead when drafting), in eval mode on the target's device; ``int8``: then
    quantized for drafting (:func:`dflash2_hf.quantization.quantize_drafter`).

    Raises:
        dflash2_hf.lora.AdapterMismatchError: the adapter was trained for another drafter (``strict=False``: only
            a warning when just the base weights differ).
        FileNotFoundError, dflash2_hf.CheckpointError: no adapter there, or a truncated / corrupt one.
    """
    return load_drafter_weights(spec, target, dtype=dtype, int8=int8, adapter=adapter_path, strict=strict)


def run_benchmark(target, drafter, prompts: dict[str, list[Prompt]], settings: BenchSettings | None = None,
                  out_dir: str | os.PathLike | None = None, meta: dict | None = None, plots: bool = True,
                  adapted_drafter=None, reference_target=None, previous_drafter=None) -> dict:
    """Runs the benchmark and (with ``out_dir``) writes ``results.json``, ``results.md`` and the PNG plots.

    Args:
        target: the target model (batch size 1 generation).
        drafter: a :class:`~dflash2_hf.DFlash2DraftModel` for ``target`` (None allowed when no drafter method is
            selected).
        prompts: ``{data set name: [Prompt, ...]}`` (:func:`load_bench_prompts`, or build :class:`Prompt` yourself).
        settings: :class:`BenchSettings` (default: all methods, greedy, 128 new tokens).
        out_dir: where to write the files (nothing is written when None).
        meta: free description stored in ``results["meta"]`` (target / drafter names, dtype, ...).
        adapted_drafter: the drafter of the ``dflash2_adapter`` method (the same drafter with a LoRA adapter
            merged, see :func:`load_adapted_drafter`); needed only when that method is selected.
        previous_drafter: the drafter of the ``dflash2_previous`` method (another drafter for the same target, e.g.
            the previous release, :func:`load_drafter`); needed only when that method is selected.
        reference_target: greedy only, optional: the same target in float32 (``target`` itself in bf16/fp16); its
            plain greedy outputs are compared with ``target``'s, untimed, as ``results["calibration"]``
            (:func:`dflash2_hf.bench.fidelity.calibrate`).

    Returns:
        The ``results.json`` content: ``settings``, ``meta``, ``environment`` (versions, machine), ``prompts``
        (ids and lengths per data set), ``run`` (timestamps, warm-up times), ``records`` (one per prompt x method:
        new tokens, seconds, tokens/s, identity, forward accounting, generation_stats, output ids) and
        ``aggregates`` (one per data set x method, plus data set ``"all"``), and with ``reference_target``
        ``calibration``. Greedy records not identical to plain's carry a ``divergence`` (first differing token,
        plain's margin there, near-tie or bug; see docs/bench.md), counted per row as ``near_ties`` /
        ``divergence_bugs``; ``fidelity_ok`` is False when any divergence is a bug.
    """
    settings = settings or BenchSettings()
    meta = dict(meta or {})
    if drafter is not None:
        meta.setdefault("block_size", drafter.config.block_size)
        meta.setdefault("drafter_parameters", parameter_count(drafter))  # int8 copies: their packed weights too
        meta.setdefault("drafter_config", {k: getattr(drafter.config, k, None) for k in (
            "num_hidden_layers", "hidden_size", "block_size", "target_layer_ids", "use_local_conv",
            "use_candidate_selector", "selector_top_k", "selector_rank", "mask_token_id")})
    meta.setdefault("dtype", str(next(target.parameters()).dtype).replace("torch.", ""))
    env = environment(target)
    records, run_info = run_methods(target, drafter, prompts, settings, adapted_drafter=adapted_drafter,
                                    previous_drafter=previous_drafter)
    env["machine"]["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    calibration = None
    if settings.greedy:  # untimed, after the timed loop: re-runs plain where an output diverged
        annotate_records(target, records, prompts, settings.generate_kwargs(), settings.near_tie_ulps)
        if reference_target is not None:
            calibration = calibrate(reference_target, target, records, prompts, settings.max_new_tokens,
                                    settings.generate_kwargs(), settings.near_tie_ulps)
    block_size = drafter.config.block_size if drafter is not None else None
    results = {
        "format": "dflash2-bench/1",
        "settings": settings.to_dict(),
        "meta": meta,
        "environment": env,
        "prompts": {name: [{"id": p.prompt_id, "tokens": p.num_tokens, "chat_template": p.chat} for p in plist]
                    for name, plist in prompts.items()},
        "run": run_info,
        "aggregates": aggregate(records, settings.methods, block_size, settings.prompt_lookup_num_tokens,
                                settings.greedy),
        "records": records_to_json(records),
    }
    if calibration is not None:
        results["calibration"] = calibration
    if out_dir is not None:
        results["files"] = write_outputs(results, out_dir, plots=plots)
    return results


__all__ = [
    "ALL", "BenchSettings", "ForwardRecorder", "METHODS", "METHOD_DESCRIPTIONS", "Prompt", "RawRecord",
    "aggregate", "environment", "generate_once", "load_adapted_drafter", "load_bench_prompts", "load_drafter", "markdown",
    "per_position_rates", "plot", "records_to_json", "run_benchmark", "run_methods", "write_outputs",
]
