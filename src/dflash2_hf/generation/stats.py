"""Acceptance statistics of one speculative ``generate()`` call (DESIGN.md sections 1 and 8)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field


@dataclass
class GenerationStats:
    """What one ``target.generate(..., assistant_model=draft)`` call did; read it from ``draft.generation_stats``.

    Attributes:
        block_size: the drafter's ``B`` (``B - 1`` drafts per cycle at most).
        acceptance_lengths: per verification cycle, tokens emitted = accepted drafts + 1 bonus token (after any
            stop inside the block); the prefill step is not a cycle.
        accepted_drafts: per cycle, drafts the target accepted among the emitted tokens (a stop inside the block
            ends the count there: nothing past a stop is verified, as plain decoding would not look at it).
        draft_lengths: per cycle, drafts proposed (``B - 1`` except near ``max_length``, or fewer when
            ``num_assistant_tokens`` / ``assistant_confidence_threshold`` limit them; a copy from the context may
            propose more, up to 15).
        copied: per cycle, whether it verified a copy from the context instead of the drafter's path.
        new_tokens: tokens generated in total (prefill's first token included).
        draft_seconds: drafter forward passes + LM head on the draft positions (wall clock, seconds).
        select_seconds: top-k + candidate selector + path walk.
        verify_seconds: target forward passes of verification cycles.
        prefill_seconds: the target's prompt forward pass.
        total_seconds: the whole decoding loop.
        drafter_passes: drafter forward passes (one per cycle that drafted; the cost schedule's plain steps, copies
            made without drafting and a last cycle with no room before ``max_length`` make none, and a cycle whose
            pass the cost schedule then verified none of, ``draft_lengths`` 0, made one).
        copies_without_drafting: cycles that verified a copy made with no drafter pass (the last 2-3 tokens recurred).
        selector_passes: greedy drafter passes whose path the candidate selector walked.
        selector_changed_passes: those of them whose selector path differs from the drafter's top-1 path at some
            proposed position (before a copy from the context replaces it, or a draft-length rule cuts it).
        cost_curve: with the ``"cost"`` draft-length schedule, the verification cost curve it chose lengths from
            (``{"label", "verify_ms": {"n": ms}, "relative": {"n": T_verify(n) / T_decode}}``), else None.
    """

    block_size: int
    acceptance_lengths: list[int] = field(default_factory=list)
    accepted_drafts: list[int] = field(default_factory=list)
    draft_lengths: list[int] = field(default_factory=list)
    copied: list[bool] = field(default_factory=list)
    new_tokens: int = 0
    draft_seconds: float = 0.0
    select_seconds: float = 0.0
    verify_seconds: float = 0.0
    prefill_seconds: float = 0.0
    total_seconds: float = 0.0
    drafter_passes: int = 0
    copies_without_drafting: int = 0
    selector_passes: int = 0
    selector_changed_passes: int = 0
    cost_curve: dict | None = None

    @property
    def num_cycles(self) -> int:
        """Verification cycles (target forwards after the prefill)."""
        return len(self.acceptance_lengths)

    @property
    def copied_cycles(self) -> int:
        """Cycles that verified a continuation copied from the context (``drafter.use_prompt_lookup``) instead of
        the drafter's own path."""
        return sum(self.copied)

    @property
    def tau(self) -> float:
        """Acceptance length: mean tokens per verification cycle (1.0 = plain decoding; at most ``block_size`` from
        the drafter, more in cycles that verify a longer copy from the context)."""
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths) if self.acceptance_lengths else 0.0

    @property
    def mean_draft_length(self) -> float:
        """Drafts verified per cycle on average (the target's extra positions per forward).

        Over the cycles that had room for a draft: the last cycle before ``max_length`` may have none.
        """
        drafted = [d for d in self.draft_lengths if d > 0]
        return sum(drafted) / len(drafted) if drafted else 0.0

    def per_position_acceptance(self) -> list[float | None]:
        """Rate at which draft position ``i`` (1-based, list index ``i - 1``) was accepted.

        Among cycles that proposed at least ``i`` drafts; ``None`` where no cycle did.
        """
        rates = []
        for i in range(1, self.block_size):
            proposed = [a for a, d in zip(self.accepted_drafts, self.draft_lengths) if d >= i]
            rates.append(sum(a >= i for a in proposed) / len(proposed) if proposed else None)
        return rates

    @property
    def other_seconds(self) -> float:
        """Loop time outside drafting, selection, verification and prefill (logits processing, stopping, caches)."""
        return max(
            0.0,
            self.total_seconds - self.draft_seconds - self.select_seconds - self.verify_seconds - self.prefill_seconds,
        )

    def to_dict(self) -> dict:
        """JSON-ready dict with the derived figures (tau, per-position acceptance, other_seconds) included."""
        out = asdict(self)
        out.update(
            tau=self.tau,
            num_cycles=self.num_cycles,
            copied_cycles=self.copied_cycles,
            mean_draft_length=self.mean_draft_length,
            per_position_acceptance=self.per_position_acceptance(),
            other_seconds=self.other_seconds,
        )
        return out

    @staticmethod
    def merge(stats: list["GenerationStats"]) -> "GenerationStats":
        """Pools several calls' statistics (tau of the pool = mean over all their cycles)."""
        if not stats:
            raise ValueError("No statistics to merge.")
        total = GenerationStats(block_size=stats[0].block_size)
        for s in stats:
            total.acceptance_lengths += s.acceptance_lengths
            total.accepted_drafts += s.accepted_drafts
            total.draft_lengths += s.draft_lengths
            total.copied += s.copied
            for name in ("new_tokens", "drafter_passes", "copies_without_drafting", "selector_passes",
                         "selector_changed_passes", "draft_seconds", "select_seconds", "verify_seconds",
                         "prefill_seconds", "total_seconds"):
                setattr(total, name, getattr(total, name) + getattr(s, name))
            total.cost_curve = total.cost_curve or s.cost_curve
        return total


@contextmanager
def timed(stats: GenerationStats, attribute: str, device=None):
    """Adds the wall-clock seconds of the ``with`` body to ``stats.<attribute>``.

    On CUDA the device is synchronised at both ends so the time is the work's, not the launch's.
    """
    sync = device is not None and getattr(device, "type", "cpu") == "cuda"
    if sync:
        import torch

        torch.cuda.synchronize(device)
    start = time.perf_counter()
    try:
        yield
    finally:
        if sync:
            torch.cuda.synchronize(device)
        setattr(stats, attribute, getattr(stats, attribute) + time.perf_counter() - start)
