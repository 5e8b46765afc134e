"""Copying from the context: the n-gram continuation that prompt lookup decoding proposes, for the DFlash2 loop.

Prompt lookup (Saxena 2023; ``generate(prompt_lookup_num_tokens=N)`` in ``transformers``) proposes the tokens that
followed the last occurrence of the sequence's final n-gram. It wins where the output copies its input (code that
repeats the prompt's names and lines, edits, extraction) and proposes nothing useful elsewhere. The DFlash2 loop uses
it next to the drafter (:class:`~.candidate_generator.DFlash2CandidateGenerator`): in a cycle where the drafter's
first draft equals the continuation's first token, the drafter agrees that the text is being copied, and the
continuation (often longer and more exact than the drafter's path in such text) is verified instead of the rest of
the drafter's path. Both proposals are made before the target verifies, so greedy output is unchanged; for sampling
the first token keeps the drafter's proposal probability and the copied tokens after it have ``q = 1`` (a
deterministic proposal), which keeps rejection sampling exact.
"""

from __future__ import annotations

import torch


def ngram_continuation(input_ids: torch.LongTensor, max_ngram_size: int, max_tokens: int,
                       min_ngram_size: int = 1) -> torch.LongTensor:
    """The tokens that followed the most recent earlier occurrence of the sequence's last n-gram.

    ``input_ids``: ``(1, L)`` long (prompt and generated tokens). Tries ``n = max_ngram_size`` down to
    ``min_ngram_size``; for the first ``n`` whose last ``n`` tokens occur earlier in the sequence, returns up to
    ``max_tokens`` tokens that followed the most recent such occurrence, as ``(m,)`` long on the input's device
    (``m >= 1``); ``(0,)`` where no n-gram recurs or ``max_tokens < 1``.
    """
    ids = input_ids[0]
    if max_tokens < 1:
        return ids.new_zeros(0)
    for n in range(min(max_ngram_size, ids.shape[0] - 1), max(min_ngram_size, 1) - 1, -1):
        windows = ids.unfold(0, n, 1)[:-1]  # every n-gram that starts before the last one
        hits = (windows == ids[-n:]).all(dim=1).nonzero()
        if hits.numel():
            start = int(hits[-1, 0]) + n
            return ids[start:start + max_tokens]
    return ids.new_zeros(0)


__all__ = ["ngram_continuation"]
