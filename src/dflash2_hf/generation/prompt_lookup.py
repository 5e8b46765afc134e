"""Copying from the context: the n-gram continuation that prompt lookup decoding proposes, for the DFlash2 loop.

Prompt lookup (Saxena 2023; ``generate(prompt_lookup_num_tokens=N)`` in ``transformers``) proposes the tokens that
followed the last occurrence of the sequence's final n-gram. It wins where the output copies its input (code that
repeats the prompt's names and lines, edits, extraction, a model repeating itself) and proposes nothing useful
elsewhere. The DFlash2 loop (:mod:`.decoding`, :class:`~.candidate_generator.DFlash2CandidateGenerator`) uses it in
two ways, both decided before the target verifies, so greedy output is unchanged:

* where the sequence's last 2 or 3 tokens occur earlier in it, the continuation (up to ``COPY_MAX_TOKENS``, more
  than a drafter block) is verified without a drafter pass (:meth:`~.candidate_generator.DFlash2CandidateGenerator.propose_copy`);
  for sampling every copied token is a deterministic proposal (``q = 1``), as in prompt lookup decoding;
* elsewhere the drafter drafts, and where its first draft equals the first token that followed the last token's
  most recent earlier occurrence, the drafter agrees that the text is being copied, and that continuation is
  verified instead of the rest of the drafter's path (sampling: the first token keeps the drafter's proposal
  probability, the copied tokens after it have ``q = 1``).

Both keep rejection sampling exact.
"""

from __future__ import annotations

import torch


def longest_recurring_suffix(input_ids: torch.LongTensor, max_ngram_size: int,
                             min_ngram_size: int = 1) -> tuple[int, int]:
    """The longest n-gram ending the sequence that also occurs earlier in it, and where its most recent such
    occurrence ends.

    ``input_ids``: ``(1, L)`` long. Returns ``(n, start)``: the largest ``n`` in ``[min_ngram_size, max_ngram_size]``
    such that ``input_ids[0, -n:]`` occurs at an earlier position, and ``start``, the index right after the most recent
    earlier occurrence of that n-gram (the first token that followed it); ``(0, 0)`` where none recurs. One scan for
    the last token's earlier positions, then each longer n only filters the previous n's hits.
    """
    ids = input_ids[0]
    length = ids.shape[0]
    max_n = min(max_ngram_size, length - 1)
    if max_n < max(min_ngram_size, 1):
        return 0, 0
    hits = (ids[:-1] == ids[-1]).nonzero().flatten()  # end positions of earlier occurrences of the last 1-gram
    best = (1, int(hits[-1]) + 1) if hits.numel() else (0, 0)
    n = 1
    while hits.numel() and n < max_n:
        hits = hits[hits >= n]
        hits = hits[ids[hits - n] == ids[-1 - n]]
        if not hits.numel():
            break
        n += 1
        best = (n, int(hits[-1]) + 1)
    return best if best[0] >= min_ngram_size else (0, 0)


def continuation(input_ids: torch.LongTensor, start: int, max_tokens: int) -> torch.LongTensor:
    """Up to ``max_tokens`` tokens of ``input_ids`` ``(1, L)`` from index ``start`` (``< L``), as ``(m,)``. Where fewer
    than ``max_tokens`` follow (the text repeats with the short period ``p = L - start``), the copy overlaps itself as
    in LZ77: token ``j >= p`` of the continuation is token ``j - p`` (a loop is predicted to go on)."""
    follow = input_ids[0, start:start + max_tokens]
    if 0 < follow.shape[0] < max_tokens:
        follow = follow.repeat(-(-max_tokens // follow.shape[0]))[:max_tokens]
    return follow


def ngram_continuation(input_ids: torch.LongTensor, max_ngram_size: int, max_tokens: int,
                       min_ngram_size: int = 1) -> torch.LongTensor:
    """The tokens that followed the most recent earlier occurrence of the sequence's last n-gram.

    ``input_ids``: ``(1, L)`` long (prompt and generated tokens). For the largest ``n`` in
    ``[min_ngram_size, max_ngram_size]`` whose last ``n`` tokens occur earlier in the sequence
    (:func:`longest_recurring_suffix`), returns up to ``max_tokens`` tokens that followed the most recent such
    occurrence (:func:`continuation`, overlapping where the match is recent), as ``(m,)`` long on the input's device
    (``m >= 1``); ``(0,)`` where no n-gram recurs or ``max_tokens < 1``.
    """
    if max_tokens < 1:
        return input_ids.new_zeros(0)
    n, start = longest_recurring_suffix(input_ids, max_ngram_size, min_ngram_size)
    return continuation(input_ids, start, max_tokens) if n else input_ids.new_zeros(0)


__all__ = ["continuation", "longest_recurring_suffix", "ngram_continuation"]
