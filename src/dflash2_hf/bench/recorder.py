"""Non-invasive accounting of target and drafter forward passes (PyTorch forward hooks).

Every method, ``plain`` included, runs with the same hooks attached so their (tiny) cost hits all alike. For each
target forward the pre-hook records the number of input tokens and the KV-cache length at call time; from these
we recover, without touching the decoding code, how many tokens each verification produced:

* forward 0 is the prefill (the whole prompt, cache empty) and yields the first new token;
* forward ``i >= 1`` verifies ``[anchor, d_1 .. d_P]`` (``P = input length - 1`` drafts) starting at cache length
  ``L_i``; the tokens it emitted are ``L_{i+1} - L_i`` (the cache is rolled back to the accepted tokens, the bonus
  token being the next anchor), and for the last forward ``prompt_len + new_tokens - L_last - 1``;
* accepted drafts = emitted - 1; ``tau = (new_tokens - 1) / (forwards - 1)`` (the prefill token and the prefill
  forward left out, the same definition as :attr:`GenerationStats.tau`).

Drafts that could not have been kept because ``max_new_tokens`` was near are not counted as proposed (the built-in
loops always draft a full block and cut later). A stop (EOS) inside a block truncates that cycle's count.
"""

from __future__ import annotations

import time

import torch


def _sync(device) -> None:
    if device is not None and getattr(device, "type", "cpu") == "cuda":
        torch.cuda.synchronize(device)


def _cache_length(kwargs: dict) -> int | None:
    for key in ("cache", "past_key_values"):
        cache = kwargs.get(key)
        if cache is not None and hasattr(cache, "get_seq_length"):
            try:
                return int(cache.get_seq_length())
            except Exception:  # an exotic cache: acceptance from forwards is then unavailable
                return None
    return None


def _input_length(args: tuple, kwargs: dict) -> int | None:
    for value in (kwargs.get("input_ids"), args[0] if args else None, kwargs.get("inputs_embeds")):
        if isinstance(value, torch.Tensor):
            return int(value.shape[1])
    return None


class ForwardRecorder:
    """Records the forwards of ``target`` (input length, cache length, seconds) and the seconds of the drafters.

    ``drafter``: one drafter module or several (e.g. the main one and a previous release), None = none; their
    forwards are counted together (one method runs one drafter at a time).
    Use as a context manager around the whole benchmark; call :meth:`reset` before each ``generate()``.
    """

    def __init__(self, target: torch.nn.Module, drafter=None):
        self.target = target
        drafters = drafter if isinstance(drafter, (list, tuple)) else [drafter]
        self.drafters = list({id(d): d for d in drafters if d is not None}.values())
        self.device = next(target.parameters()).device
        self.handles = []
        self.reset()

    def reset(self) -> None:
        self.calls: list[dict] = []  # target forwards: {"input_len", "cache_len", "seconds"}
        self.drafter_calls = 0
        self.drafter_seconds = 0.0
        self._t0 = None
        self._d0 = None

    # hooks -------------------------------------------------------------------------------------------------------
    def _target_pre(self, module, args, kwargs):
        _sync(self.device)
        self.calls.append({"input_len": _input_length(args, kwargs), "cache_len": _cache_length(kwargs),
                           "seconds": 0.0})
        self._t0 = time.perf_counter()

    def _target_post(self, module, args, kwargs, output):
        _sync(self.device)
        if self._t0 is not None and self.calls:
            self.calls[-1]["seconds"] = time.perf_counter() - self._t0
        self._t0 = None

    def _drafter_pre(self, module, args, kwargs):
        _sync(self.device)
        self._d0 = time.perf_counter()

    def _drafter_post(self, module, args, kwargs, output):
        _sync(self.device)
        if self._d0 is not None:
            self.drafter_calls += 1
            self.drafter_seconds += time.perf_counter() - self._d0
        self._d0 = None

    def __enter__(self) -> "ForwardRecorder":
        self.handles.append(self.target.register_forward_pre_hook(self._target_pre, with_kwargs=True))
        self.handles.append(self.target.register_forward_hook(self._target_post, with_kwargs=True))
        for drafter in self.drafters:
            self.handles.append(drafter.register_forward_pre_hook(self._drafter_pre, with_kwargs=True))
            self.handles.append(drafter.register_forward_hook(self._drafter_post, with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    # analysis ----------------------------------------------------------------------------------------------------
    def summary(self, prompt_len: int, new_tokens: int, max_new_tokens: int) -> dict:
        """Per-call accounting of the last ``generate()`` (see the module docstring).

        Returns a dict: ``target_forwards``, ``cycles`` (forwards after the prefill), ``tau_from_forwards`` (None
        without cycles), ``drafts`` / ``accepted`` (per cycle lists, None where the cache length was not
        readable), ``prefill_seconds``, ``verify_seconds`` (target forwards after the prefill), ``drafter_calls``,
        ``drafter_seconds``.
        """
        calls = self.calls
        n = len(calls)
        cycles = max(0, n - 1)
        out = {
            "target_forwards": n,
            "cycles": cycles,
            "tau_from_forwards": (new_tokens - 1) / cycles if cycles else None,
            "prefill_seconds": calls[0]["seconds"] if calls else 0.0,
            "verify_seconds": sum(c["seconds"] for c in calls[1:]),
            "drafter_calls": self.drafter_calls,
            "drafter_seconds": self.drafter_seconds,
            "drafts": None,
            "accepted": None,
        }
        lengths = [c["cache_len"] for c in calls]
        if cycles and all(x is not None for x in lengths) and all(c["input_len"] for c in calls):
            end = prompt_len + new_tokens - 1  # cache length a further forward would have started at
            drafts, accepted = [], []
            for i in range(1, n):
                start = lengths[i]
                emitted = (lengths[i + 1] if i + 1 < n else end) - start
                usable = max(0, prompt_len + max_new_tokens - start - 2)  # drafts that fit before max_new_tokens
                drafts.append(min(calls[i]["input_len"] - 1, usable))
                accepted.append(max(0, emitted - 1))
            out["drafts"], out["accepted"] = drafts, accepted
        return out


def per_position_rates(drafts: list[int], accepted: list[int], max_position: int | None = None) -> list:
    """Acceptance rate of draft position ``i`` (list index ``i - 1``) among cycles that proposed at least ``i``
    drafts; None where none did. Same definition as :meth:`GenerationStats.per_position_acceptance`."""
    if max_position is None:
        max_position = max(drafts, default=0)
    rates = []
    for i in range(1, max_position + 1):
        proposed = [a for a, d in zip(accepted, drafts) if d >= i]
        rates.append(sum(a >= i for a in proposed) / len(proposed) if proposed else None)
    return rates


__all__ = ["ForwardRecorder", "per_position_rates"]
