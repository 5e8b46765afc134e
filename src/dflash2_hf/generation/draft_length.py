"""Draft length from the measured verification cost curve and the drafter's calibrated confidence.

A cycle that verifies ``k`` drafts costs ``T_draft + T_verify(k + 1)`` and yields ``1 + (accepted drafts)`` tokens.
With ``p_i`` the probability that draft ``i`` is accepted given drafts ``1 .. i-1`` were, a cycle is expected to yield
``1 + sum_{i<=k} prod_{j<=i} p_j`` tokens, and :class:`DraftLengthPolicy` verifies the ``k`` that maximises expected
tokens per second. Where verification is nearly flat in ``n`` (bf16 on AMX, GPUs) that is the whole block; where it
grows (fp32 CPUs) it is short, confident drafts. How ``T_verify(n)`` grows is the hardware's own business (one AVX2
CPU measured here verifies 4 tokens faster than 3: MKL's small-matrix path), so it is measured, not modelled:
:func:`measure_cost_curve` times target forwards over ``n = 1 .. block_size`` new tokens on a KV cache, once per
target / dtype / device / thread count, kept per drafter and target.

``p_i`` comes from the selector's probability of each path step (:func:`.candidate_generator.path_confidence`),
recalibrated online (:class:`AcceptanceCalibration`): raw selector probabilities are over-confident (an ad-hoc run
with the shipped SmolLM2 drafter on 12 prompts: steps with probability 0.5-0.6 were accepted 39% of the time).

Lossless: the choice depends on the drafter's own scores and on earlier cycles only, never on the target's output of
the cycle being verified, so greedy output stays identical and rejection sampling stays exact.

Enable it with ``draft.generation_config.num_assistant_tokens_schedule = "cost"`` (the ``transformers`` knob;
``dflash2 demo`` / ``bench`` method ``dflash2_cost``).
"""

from __future__ import annotations

import inspect
import statistics
import time
import weakref
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.utils import logging

logger = logging.get_logger(__name__)

COST_SCHEDULE = "cost"


@dataclass
class CostCurve:
    """Measured verification cost of ``n`` new tokens on a KV cache.

    Attributes:
        verify_seconds: ``{n: seconds}`` for ``n = 1 .. max_tokens`` (median of ``repeats`` interleaved timings);
            ``n = 1`` is one plain decoding step.
        measure_seconds: wall time the measurement took.
        label: what was measured (target class, dtype, device, torch threads).
    """

    verify_seconds: dict[int, float]
    measure_seconds: float = 0.0
    label: str = ""

    def relative(self) -> dict[int, float]:
        """``{n: T_verify(n) / T_verify(1)}``: the cost in plain decoding steps."""
        return {n: s / self.verify_seconds[1] for n, s in self.verify_seconds.items()}

    def to_dict(self) -> dict:
        """JSON-ready (string keys ``"1"``, ``"2"``, ... as JSON stores them): label, ``verify_ms`` and ``relative``."""
        return {"label": self.label,
                "verify_ms": {str(n): round(1000 * t, 3) for n, t in self.verify_seconds.items()},
                "relative": {str(n): round(r, 3) for n, r in self.relative().items()}}

    @staticmethod
    def format_relative(curve: dict) -> str:
        """``"1: 1.00, 2: 1.62, ..."`` from a :meth:`to_dict` (``generation_stats.cost_curve``, a bench row)."""
        return ", ".join(f"{n}: {r:.2f}" for n, r in curve["relative"].items())

    def describe(self) -> str:
        """One line for reports, e.g. ``"T_verify(n)/T_decode: n=1 1.00, n=2 1.62, ..."``."""
        return "T_verify(n)/T_decode: " + ", ".join(f"n={n} {r:.2f}" for n, r in self.relative().items())


def measure_cost_curve(target, max_tokens: int, hidden_layers: list[int] | None = None, prompt_tokens: int = 64,
                       repeats: int = 3) -> CostCurve:
    """Times target forwards over ``n = 1 .. max_tokens`` new tokens on the KV cache of a ``prompt_tokens`` prompt of
    random ids, as the loop verifies (``output_hidden_states`` = the drafter's layers), interleaved so drift hits every
    ``n`` alike; ``repeats`` medians (after one warm-up round). Costs about ``(repeats + 1) * sum_n T_verify(n)``:
    ~4 s for SmolLM2-135M in fp32 on one CPU thread of the AVX2 EPYC.

    Raises:
        ValueError: ``max_tokens < 1``.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    start = time.perf_counter()
    param = next(target.parameters())
    vocab = target.get_input_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, prompt_tokens + max_tokens), generator=generator).to(param.device)
    # transformers 5.24 renamed the forward's cache argument past_key_values -> cache
    cache_arg = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
    extra = {"output_hidden_states": hidden_layers} if hidden_layers else {}
    if "logits_to_keep" in inspect.signature(target.forward).parameters:
        extra["logits_to_keep"] = 0  # replaced per call
    sync = torch.cuda.synchronize if param.device.type == "cuda" else (lambda: None)
    with torch.no_grad():
        cache = DynamicCache(config=target.config)
        if hasattr(cache, "activate_past_recording"):  # sliding-window layers must be able to roll back
            cache.activate_past_recording()
        target(ids[:, :prompt_tokens], use_cache=True, **{cache_arg: cache})

        def verify(n: int) -> float:
            sync()
            t0 = time.perf_counter()
            if "logits_to_keep" in extra:
                extra["logits_to_keep"] = n
            target(ids[:, prompt_tokens:prompt_tokens + n], use_cache=True,
                   position_ids=torch.arange(prompt_tokens, prompt_tokens + n, device=param.device)[None],
                   **{cache_arg: cache}, **extra)
            sync()
            cache.crop(-n)
            return time.perf_counter() - t0

        times: dict[int, list[float]] = {n: [] for n in range(1, max_tokens + 1)}
        for round_ in range(repeats + 1):
            for n in times:
                elapsed = verify(n)
                if round_:  # round 0 warms every shape up
                    times[n].append(elapsed)
    from ..cpu_kernels import is_optimized

    kernels = ", prepacked CPU linears" if is_optimized(target) else ""
    label = f"{type(target).__name__} {param.dtype} on {param.device}, {torch.get_num_threads()} thread{'s' if torch.get_num_threads() != 1 else ''}{kernels}"
    return CostCurve({n: statistics.median(v) for n, v in times.items()}, time.perf_counter() - start, label)


@dataclass
class AcceptanceCalibration:
    """Online map from a path step's selector probability to the rate at which such steps are accepted.

    Ten equal-width bins over ``[0, 1]``; each starts with ``prior_weight`` pseudo-observations at its centre (so an
    unused bin trusts the selector) and learns from every verified step: a step is observed when all drafts before it
    were accepted. Kept per drafter and target across ``generate()`` calls (:func:`cost_schedule_state`).
    """

    num_bins: int = 10
    prior_weight: float = 2.0
    hits: list[float] = field(default_factory=list)
    counts: list[float] = field(default_factory=list)

    def __post_init__(self):
        if not self.counts:
            self.counts = [self.prior_weight] * self.num_bins
            self.hits = [self.prior_weight * (b + 0.5) / self.num_bins for b in range(self.num_bins)]

    def _bins(self, confidence: torch.Tensor) -> list[int]:
        return (confidence.float() * self.num_bins).long().clamp(0, self.num_bins - 1).tolist()

    def __call__(self, confidence: torch.Tensor) -> torch.Tensor:
        """``(P,)`` selector probabilities -> ``(P,)`` float32 calibrated acceptance probabilities."""
        return torch.tensor([self.hits[b] / self.counts[b] for b in self._bins(confidence)])

    def update(self, confidence: torch.Tensor, accepted: int) -> None:
        """Records one verified path: ``confidence`` ``(k,)`` of the verified drafts, ``accepted`` of them taken."""
        for i, b in enumerate(self._bins(confidence)[: accepted + 1]):
            self.counts[b] += 1
            self.hits[b] += float(i < accepted)

    def table(self) -> list[dict]:
        """Per bin: range, observations (pseudo-counts excluded) and the current calibrated rate."""
        return [{"bin": f"{b / self.num_bins:.1f}-{(b + 1) / self.num_bins:.1f}",
                 "observed": round(self.counts[b] - self.prior_weight), "rate": round(self.hits[b] / self.counts[b], 3)}
                for b in range(self.num_bins)]


class DraftLengthPolicy:
    """Chooses how many drafts of a proposed path to verify (see the module docstring).

    Args:
        curve: the target's :class:`CostCurve` (sizes ``1 .. block_size``).
        calibration: the drafter's :class:`AcceptanceCalibration` (updated in place).
    """

    max_backoff = 32  # plain steps at most between two drafting probes

    def __init__(self, curve: CostCurve, calibration: AcceptanceCalibration):
        self.curve = curve
        self.calibration = calibration
        self._verify = torch.tensor([curve.verify_seconds[n] for n in sorted(curve.verify_seconds)])
        self._rates = {True: None, False: 1.0 / curve.verify_seconds[1]}  # tokens/s of drafting / plain cycles (EMA)
        self._backoff = 1
        self._skip = 0

    def should_draft(self) -> bool:
        """Whether to draft this cycle. Drafting is paid before its confidence is known, so while recent drafting
        cycles yielded fewer tokens per second than plain steps the loop takes plain steps (the drafter's context is
        still fed), probing again after 1, 2, 4, ... up to :attr:`max_backoff` of them."""
        if self._skip:
            self._skip -= 1
            return False
        return True

    def record_cycle(self, tokens: int, seconds: float, drafted: bool) -> None:
        """One finished cycle: ``tokens`` emitted in ``seconds`` (wall clock), with or without a draft."""
        rate = tokens / max(seconds, 1e-9)
        previous = self._rates[drafted]
        self._rates[drafted] = rate if previous is None else 0.7 * previous + 0.3 * rate
        if not drafted:
            return
        if self._rates[True] < self._rates[False]:
            self._skip = self._backoff
            self._backoff = min(2 * self._backoff, self.max_backoff)
        else:
            self._backoff = 1

    def expected_tokens(self, confidence: torch.Tensor) -> torch.Tensor:
        """``(P,)``: expected tokens of a cycle verifying ``k = 1 .. P`` drafts (bonus token included)."""
        return 1 + torch.cumprod(self.calibration(confidence), 0).cumsum(0)

    def choose(self, confidence: torch.Tensor, draft_seconds: float) -> int:
        """Drafts to verify (``0 .. P``) for a path with step probabilities ``confidence`` ``(P,)``, given this
        cycle's drafting cost ``draft_seconds``; ``P`` is capped by the measured sizes. 0 = verify the anchor alone (a
        plain decoding step: where verifying one more token costs more than a doubtful draft is worth)."""
        num = min(confidence.shape[0], self._verify.shape[0] - 1)
        tokens = torch.cat([torch.ones(1), self.expected_tokens(confidence[:num])])
        rate = tokens / (draft_seconds + self._verify[: num + 1])
        return int(rate.argmax())

    def update(self, confidence: torch.Tensor, accepted: int) -> None:
        self.calibration.update(confidence, accepted)


# drafter -> target -> {"curves": {(dtype, device, threads, optimized kernels): CostCurve}, "calibration": AcceptanceCalibration}; weak
# both ways, outside the modules (a deepcopy of a drafter must not copy its targets)
_STATE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def cost_schedule_state(drafter, target) -> dict:
    """What the cost schedule keeps for ``drafter`` with ``target`` (``{"curves": {(dtype, device, threads, kernels):
    CostCurve}, "calibration": AcceptanceCalibration}``), created empty on first use; forgotten with either model."""
    per_target = _STATE.setdefault(drafter, weakref.WeakKeyDictionary())
    return per_target.setdefault(target, {"curves": {}, "calibration": AcceptanceCalibration()})


def curve_key(target) -> tuple:
    """What a measured cost curve holds for: the target's ``(dtype, device, torch threads, prepacked CPU linears)``."""
    from ..cpu_kernels import is_optimized

    param = next(target.parameters())
    return str(param.dtype), str(param.device), torch.get_num_threads(), is_optimized(target)


def policy_for(drafter, target, hidden_layers: list[int]) -> DraftLengthPolicy:
    """The drafter's policy for ``target`` on this device/dtype/thread count: the cost curve is measured on first use
    (logged, with its time) and kept, as is the acceptance calibration, per drafter and target
    (:func:`cost_schedule_state`)."""
    state = cost_schedule_state(drafter, target)
    key = curve_key(target)
    if key not in state["curves"]:
        curve = measure_cost_curve(target, drafter.config.block_size, hidden_layers)
        state["curves"][key] = curve
        logger.info(f"Measured the verification cost curve ({curve.label}) in {curve.measure_seconds:.1f} s: "
                    f"{curve.describe()}")
    return DraftLengthPolicy(state["curves"][key], state["calibration"])


__all__ = ["COST_SCHEDULE", "AcceptanceCalibration", "CostCurve", "DraftLengthPolicy", "cost_schedule_state",
           "curve_key", "measure_cost_curve", "policy_for"]
