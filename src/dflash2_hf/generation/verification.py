"""Verifies one drafted block token by token, showing every token to the caller's hooks as plain decoding would.

Plain ``generate()`` handles one token per step: the logits processors see ``input_ids`` up to it, its processed
scores join ``scores`` (and its raw logits ``logits``), the token is chosen and appended, the stopping criteria see
``(input_ids, scores)`` up to and including it, the streamer receives it. :func:`verify_block` replays exactly that
sequence over the positions of one target forward, and stops at the first rejected draft or the first stop: a
processor is never called past a stop and a criterion never sees a token, or a score, that plain decoding would not
have shown it at that point. Greedy: a draft is accepted iff it equals the processed argmax. Sampling: accept ``d_i``
with probability ``min(1, p(d_i) / q(d_i))``, on the first rejection sample from ``norm(max(0, p - q))``, after the
last draft sample the bonus from ``p`` (Leviathan et al. 2023, arXiv 2211.17192, Algorithm 1); ``q`` is the
selector's proposal over its top-k, zero elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .candidate_generator import DraftProposal


class TokenEmitter:
    """Appends verified tokens one at a time and shows each to the stopping criteria, records and streamer.

    Args:
        stopping_criteria: a ``StoppingCriteriaList``; called as ``criteria(input_ids, scores)`` after each token.
        streamer: receives each token as a ``(1,)`` long CPU tensor (what plain decoding puts), or None.
        scores: ``()`` to record processed scores (``output_scores`` with ``return_dict_in_generate``), else None:
            then the criteria get ``scores=None``, as in plain decoding.
        raw_logits: ``()`` to record raw logits (``output_logits``), else None.
    """

    def __init__(self, stopping_criteria, streamer=None, scores: tuple | None = None, raw_logits: tuple | None = None):
        self.stopping_criteria = stopping_criteria
        self.streamer = streamer
        self.scores = scores
        self.raw_logits = raw_logits

    def emit(self, sequence: torch.LongTensor, token: torch.LongTensor, processed: torch.Tensor, raw: torch.Tensor):
        """Appends ``token`` ``(1,)`` to ``sequence`` ``(1, L)``; returns ``(sequence (1, L + 1), stop: bool)``.

        ``processed`` / ``raw``: ``(1, V)`` float32 scores after the logits processors / before them.
        """
        if self.scores is not None:
            self.scores += (processed,)
        if self.raw_logits is not None:
            self.raw_logits += (raw,)
        sequence = torch.cat([sequence, token[:, None].to(sequence)], dim=1)
        stop = bool(self.stopping_criteria(sequence, self.scores).any())
        if self.streamer is not None:
            self.streamer.put(token.cpu())
        return sequence, stop


@dataclass
class VerifiedBlock:
    """What one verification emitted.

    Attributes:
        sequence: ``(1, L + emitted)`` long, the input ids with the emitted tokens appended.
        emitted: tokens emitted (accepted drafts + the bonus / corrected token; fewer when a stop fired first).
        accepted: drafts accepted among the emitted tokens.
        stopped: a stopping criterion fired at the last emitted token.
    """

    sequence: torch.LongTensor
    emitted: int
    accepted: int
    stopped: bool


# pick(position, processed scores (1, V)) -> (token (1,), whether it is the accepted draft of that position)
Picker = Callable[[int, torch.Tensor], tuple[torch.LongTensor, bool]]


def verify_block(logits, input_ids, logits_processor, emitter: TokenEmitter, pick: Picker) -> VerifiedBlock:
    """Emits tokens from ``logits`` ``(1, P + 1, V)`` float32 (the target's logits at ``[anchor, d_1 .. d_P]``).

    Position ``i``: the processors see ``input_ids`` plus the tokens emitted so far, ``pick`` chooses the token, the
    emitter shows it to the criteria; stops after the first token that is not an accepted draft or that stops.
    """
    # own copies, as plain decoding has: processors may write in place, and a record of a view would keep the whole
    # block's logits (rejected positions too) alive
    copy = len(logits_processor) > 0 or emitter.scores is not None or emitter.raw_logits is not None
    sequence = input_ids
    for i in range(logits.shape[1]):
        raw = logits[:, i].clone() if copy else logits[:, i]
        processed = logits_processor(sequence, raw)
        token, accepted = pick(i, processed)
        sequence, stopped = emitter.emit(sequence, token, processed, raw)
        if stopped or not accepted:
            break
    return VerifiedBlock(sequence=sequence, emitted=i + 1, accepted=i + int(accepted), stopped=stopped)


def greedy_picker(drafts: torch.LongTensor | None) -> Picker:
    """Greedy: the processed argmax; it accepts the draft ``drafts[0, i]`` (``(1, P)`` long) iff they are equal."""
    proposed = [] if drafts is None else drafts[0].tolist()

    def pick(i, processed):
        token = processed.argmax(-1)
        return token, i < len(proposed) and int(token) == proposed[i]

    return pick


def sampling_picker(proposal: DraftProposal | None) -> Picker:
    """Rejection sampling against the selector's ``q`` (lossless); the bonus is sampled from ``p``."""
    proposed = [] if proposal is None else proposal.tokens[0].tolist()
    q_tokens = [] if proposal is None else proposal.q_of_tokens().tolist()

    def pick(i, processed):
        p = torch.softmax(processed[0].float(), dim=-1)
        if i == len(proposed):
            return torch.multinomial(p, 1), False
        draft = proposed[i]
        if torch.rand(()).item() * q_tokens[i] <= p[draft].item():  # u <= p/q without dividing by a tiny q
            return torch.tensor([draft], device=p.device), True
        # scatter_add_: a copied draft's row repeats one candidate (q = 1, 0, ..., 0), see .prompt_lookup
        q = torch.zeros_like(p).scatter_add_(0, proposal.candidate_ids[i].to(p.device), proposal.q[i].to(p))
        residual = (p - q).clamp_(min=0)
        total = residual.sum()
        return torch.multinomial(residual / total if total > 0 else p, 1), False

    return pick


__all__ = ["TokenEmitter", "VerifiedBlock", "greedy_picker", "sampling_picker", "verify_block"]
