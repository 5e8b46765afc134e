"""The benchmark loop: every method on the same prompts, interleaved per prompt, with a rotating method order.

``plain`` always runs on stock PyTorch kernels (:func:`dflash2_hf.cpu_kernels.stock_kernels`); every other method
runs on the kernels the target has (prepacked ones after :func:`dflash2_hf.optimize_for_cpu`), ``plain_optimized``
only on an optimized target. For prompt ``j`` the methods run in the order ``methods[j % m:] + methods[:j % m]``
so slow drift of the machine (other jobs, thermal state) hits every method alike. Before the timed loop every method generates once, untimed, on
the first prompt (warm-up: first-call allocations, lazy initialisation). Each timed figure is the wall-clock of the
``target.generate()`` call itself (``time.perf_counter``, CUDA synchronised at both ends).
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field

import torch
from dflash2_cli.arguments import BENCH_METHODS, OWN_DRAFTER_METHODS  # noqa: F401 (re-exported)

from ..cpu_kernels import is_optimized, stock_kernels
from .fidelity import NEAR_TIE_ULPS
from .recorder import ForwardRecorder

# the methods, and OWN_DRAFTER_METHODS (those that run another drafter than the main one), are named once in
# dflash2_cli.arguments, torch-free, for `dflash2 bench --help`
METHODS = BENCH_METHODS
PLAIN_METHODS = ("plain", "plain_optimized")  # no speculation
STATS_METHODS = ("dflash2_top1", "dflash2", "dflash2_no_lookup", "dflash2_dynamic", "dflash2_cost", "dflash2_adapter",
                 "dflash2_previous")  # the DFlash2 loop: fill generation_stats
DRAFTER_METHODS = ("builtin_dflash",) + STATS_METHODS

METHOD_DESCRIPTIONS = {
    "plain": "target.generate() without speculation, on stock PyTorch kernels (what users run today)",
    "plain_optimized": "target.generate() without speculation, on the kernels of dflash2_hf.optimize_for_cpu (the "
                       "kernels every other method runs on when the target was optimized)",
    "prompt_lookup": "target.generate(prompt_lookup_num_tokens=N) (n-gram lookup in the prompt, transformers)",
    "builtin_dflash": "target.generate(assistant_model=drafter, speculation_type='dflash') (transformers' DFlash loop,"
                      " no selector)",
    "dflash2_top1": "target.generate(assistant_model=drafter) with drafter.use_selector=False (DFlash2 loop, top-1 "
                    "path)",
    "dflash2": "target.generate(assistant_model=drafter) (DFlash2 loop with the candidate selector, copying from the "
               "context where the drafter agrees)",
    "dflash2_no_lookup": "target.generate(assistant_model=drafter) with drafter.use_prompt_lookup=False (DFlash2 loop "
                         "with the candidate selector, never copying from the context)",
    "dflash2_dynamic": "target.generate(assistant_model=drafter) with drafter.generation_config."
                       "assistant_confidence_threshold set (DFlash2 loop with the candidate selector, each path cut "
                       "after its first draft whose selector probability is below the threshold)",
    "dflash2_cost": "target.generate(assistant_model=drafter) with drafter.generation_config."
                    "num_assistant_tokens_schedule='cost' (DFlash2 loop with the candidate selector, drafts per cycle "
                    "chosen from the measured verification cost curve and the calibrated selector probabilities, "
                    "0 = a plain step; the curve is measured in the untimed warm-up)",
    "dflash2_adapter": "target.generate(assistant_model=adapted) with the same drafter plus a LoRA adapter, merged "
                       "(DFlash2 loop with the candidate selector)",
    "dflash2_previous": "target.generate(assistant_model=previous) with another drafter for the same target, e.g. "
                        "the previous release (DFlash2 loop with the candidate selector, full blocks)",
}


@dataclass
class BenchSettings:
    """What to run.

    Attributes:
        max_new_tokens: cap per generation.
        temperature: 0 = greedy (``do_sample=False``); > 0 samples with this temperature.
        top_p, top_k: sampling filters (``top_k=0`` = off); ignored when greedy.
        methods: subset of :data:`METHODS` (``plain`` is always added: it is the speedup and identity reference).
        seed: sampling seed; before each call ``torch.manual_seed(seed + prompt index)`` (same seed for every
            method on a prompt).
        prompt_lookup_num_tokens: ``N`` of the prompt-lookup baseline.
        confidence_threshold: ``assistant_confidence_threshold`` of the ``dflash2_dynamic`` method (a probability).
        warmup: one untimed generation per method first.
        warmup_tokens: ``max_new_tokens`` of the warm-up generations.
        progress: tqdm progress bar.
        near_tie_ulps: greedy, bf16/fp16 targets: a divergence from plain greedy is a near-tie when plain's margin
            there is at most this many ulps of its largest score (:mod:`.fidelity`; docs/bench.md).
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    methods: tuple = METHODS
    seed: int = 0
    prompt_lookup_num_tokens: int = 10
    confidence_threshold: float = 0.7
    warmup: bool = True
    warmup_tokens: int = 16
    progress: bool = True
    near_tie_ulps: float = NEAR_TIE_ULPS

    def __post_init__(self):
        methods = tuple(dict.fromkeys(self.methods))
        unknown = [m for m in methods if m not in METHODS]
        if unknown:
            raise ValueError(f"unknown method(s) {unknown}; choose from {list(METHODS)}")
        if "plain" not in methods:
            methods = ("plain",) + methods
        self.methods = methods
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if "dflash2_dynamic" in methods and not 0 < self.confidence_threshold < 1:
            raise ValueError(f"confidence_threshold (bench --confidence-threshold) of method dflash2_dynamic must be "
                             f"a probability in (0, 1); got {self.confidence_threshold}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generate_kwargs(self) -> dict:
        if self.greedy:
            return dict(do_sample=False)
        return dict(do_sample=True, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k or None)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["methods"] = list(self.methods)
        d["greedy"] = self.greedy
        return d


def _sync(device) -> None:
    if getattr(device, "type", "cpu") == "cuda":
        torch.cuda.synchronize(device)


_MISSING = object()


@contextmanager
def _method_settings(drafter, method: str, settings: BenchSettings):
    """Gives the drafter the settings ``method`` runs with, restored afterwards: the selector off for
    ``dflash2_top1``; full blocks for every DFlash2 method but ``dflash2_dynamic``, which gets the bench's
    confidence threshold, and ``dflash2_cost``, the cost-curve schedule (a caller's own draft-length knobs never leak
    into a measured method)."""
    changes = []
    if method in STATS_METHODS:
        if method == "dflash2_top1":
            changes.append((drafter, "use_selector", False))
        changes.append((drafter, "use_prompt_lookup", method != "dflash2_no_lookup"))
        config = getattr(drafter, "generation_config", None)
        if config is not None:
            changes += [(config, "num_assistant_tokens", None),
                        (config, "assistant_confidence_threshold",
                         settings.confidence_threshold if method == "dflash2_dynamic" else None),
                        (config, "num_assistant_tokens_schedule", "cost" if method == "dflash2_cost" else None)]
    previous = [(obj, name, getattr(obj, name, _MISSING)) for obj, name, _ in changes]
    for obj, name, value in changes:
        setattr(obj, name, value)
    try:
        yield
    finally:
        for obj, name, value in previous:
            if value is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, value)


def generate_once(target, drafter, method: str, input_ids: torch.Tensor, settings: BenchSettings,
                  max_new_tokens: int | None = None) -> tuple[torch.Tensor, float, dict | None]:
    """One timed ``generate()`` call of ``method``.

    Returns:
        ``(new token ids (1-D), wall seconds of the generate() call, generation_stats dict or None)``.
    """
    kwargs = dict(max_new_tokens=max_new_tokens or settings.max_new_tokens,
                  attention_mask=torch.ones_like(input_ids), **settings.generate_kwargs())
    if method == "prompt_lookup":
        kwargs["prompt_lookup_num_tokens"] = settings.prompt_lookup_num_tokens
    elif method == "builtin_dflash":
        kwargs.update(assistant_model=drafter, speculation_type="dflash")
    elif method in STATS_METHODS:
        kwargs["assistant_model"] = drafter
    elif method not in PLAIN_METHODS:
        raise ValueError(method)
    if method == "plain_optimized" and not is_optimized(target):
        raise ValueError("method plain_optimized needs a target run through dflash2_hf.optimize_for_cpu "
                         "(dflash2 bench --cpu-kernels optimized)")
    if method in DRAFTER_METHODS:
        drafter.generation_stats = None
    device = input_ids.device
    kernels = stock_kernels(target) if method == "plain" else nullcontext()
    with _method_settings(drafter, method, settings), kernels:
        _sync(device)
        start = time.perf_counter()
        out = target.generate(input_ids, **kwargs)
        _sync(device)
        seconds = time.perf_counter() - start
    stats = None
    if method in STATS_METHODS:
        if drafter.generation_stats is None:
            raise RuntimeError(f"{method}: generate() did not run the DFlash2 loop (no generation_stats); "
                               "is dflash2_hf imported and the drafter a DFlash2DraftModel?")
        stats = drafter.generation_stats.to_dict()
    sequences = out.sequences if hasattr(out, "sequences") else out
    return sequences[0, input_ids.shape[1]:].detach().cpu(), seconds, stats


@dataclass
class RawRecord:
    """One timed call (one prompt x one method); the per-prompt raw numbers of ``results.json``."""

    dataset: str
    prompt_id: str
    prompt_index: int
    method: str
    order: int  # position of the method in this prompt's rotated order
    prompt_tokens: int
    new_tokens: int
    seconds: float
    tokens_per_second: float
    identical_to_plain: bool | None
    forwards: dict = field(default_factory=dict)
    generation_stats: dict | None = None
    output_ids: list = field(default_factory=list)
    divergence: dict | None = None  # greedy, not identical to plain: where and why (fidelity.Divergence.to_dict())


def run_methods(target, drafter, prompts: dict, settings: BenchSettings,
                adapted_drafter=None, previous_drafter=None) -> tuple[list[RawRecord], dict]:
    """Runs every method on every prompt (interleaved, rotated order); returns the raw records and run info.

    ``prompts``: ``{dataset name: [Prompt, ...]}`` (see :mod:`.prompts`). ``adapted_drafter``: the drafter of the
    ``dflash2_adapter`` method (``drafter`` + a LoRA adapter, merged: :func:`dflash2_hf.lora.load_adapter` then
    ``merge_and_unload()``), so base and adapted drafters are compared side by side on the same prompts.
    ``previous_drafter``: the drafter of the ``dflash2_previous`` method (another drafter for the same target, e.g.
    the previous release), compared the same way.

    Raises:
        ValueError: a drafter method without its drafter, or no prompts.
    """
    methods = settings.methods
    own = {"dflash2_adapter": (adapted_drafter, "adapted_drafter (dflash2 bench --adapter PATH)"),
           "dflash2_previous": (previous_drafter, "previous_drafter (dflash2 bench --previous-drafter PATH)")}
    if any(m in DRAFTER_METHODS and m not in own for m in methods) and drafter is None:
        raise ValueError(f"methods {[m for m in methods if m in DRAFTER_METHODS]} need a drafter")
    for method, (model, what) in own.items():
        if method in methods and model is None:
            raise ValueError(f"method {method} needs {what}")
    for d in (drafter, adapted_drafter, previous_drafter):
        if d is not None:
            d.check_target(target)

    def drafter_for(method: str):
        return own[method][0] if method in own else drafter

    device = next(target.parameters()).device
    flat = [(name, p) for name, plist in prompts.items() for p in plist]
    if not flat:
        raise ValueError("no prompts")
    progress = None
    total = len(flat) * len(methods) + (len(methods) if settings.warmup else 0)
    if settings.progress:
        from tqdm.auto import tqdm

        progress = tqdm(total=total, desc="bench", unit="gen", dynamic_ncols=True)
    records: list[RawRecord] = []
    info = {"started_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "warmup_seconds": {}}
    try:
        with ForwardRecorder(target, [drafter, adapted_drafter, previous_drafter]) as recorder:
            if settings.warmup:
                ids = torch.tensor([flat[0][1].input_ids], device=device)
                for method in methods:
                    if progress is not None:
                        progress.set_postfix_str(f"warm-up {method}")
                    torch.manual_seed(settings.seed)
                    _, seconds, _ = generate_once(target, drafter_for(method), method, ids, settings,
                                                  min(settings.warmup_tokens, settings.max_new_tokens))
                    info["warmup_seconds"][method] = seconds
                    if progress is not None:
                        progress.update(1)
            for index, (dataset, prompt) in enumerate(flat):
                ids = torch.tensor([prompt.input_ids], device=device)
                shift = index % len(methods)
                order = methods[shift:] + methods[:shift]
                outputs = {}
                prompt_records = []
                for position, method in enumerate(order):
                    if progress is not None:
                        progress.set_postfix_str(f"{dataset}#{prompt.prompt_id} {method}")
                    torch.manual_seed(settings.seed + index)
                    recorder.reset()
                    new_ids, seconds, stats = generate_once(target, drafter_for(method), method, ids, settings)
                    n_new = int(new_ids.numel())
                    forwards = recorder.summary(prompt.num_tokens, n_new, settings.max_new_tokens)
                    outputs[method] = new_ids.tolist()
                    prompt_records.append(RawRecord(
                        dataset=dataset, prompt_id=prompt.prompt_id, prompt_index=index, method=method,
                        order=position, prompt_tokens=prompt.num_tokens, new_tokens=n_new, seconds=seconds,
                        tokens_per_second=n_new / seconds if seconds > 0 else float("nan"),
                        identical_to_plain=None, forwards=forwards, generation_stats=stats,
                        output_ids=outputs[method]))
                    if progress is not None:
                        progress.update(1)
                for rec in prompt_records:
                    if settings.greedy:
                        rec.identical_to_plain = outputs[rec.method] == outputs["plain"]
                    records.append(rec)
    finally:
        if progress is not None:
            progress.close()
    info["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    return records, info


__all__ = ["BenchSettings", "METHODS", "PLAIN_METHODS", "DRAFTER_METHODS", "STATS_METHODS", "OWN_DRAFTER_METHODS", "METHOD_DESCRIPTIONS",
           "RawRecord", "generate_once", "run_methods"]
