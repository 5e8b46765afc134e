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


def ngram_continuation(input_ids: torch.LongTensor, max_ngram_size: int, max_tokens: int,
                       min_ngram_size: int = 1) -> torch.LongTensor:
    """The tokens that followed the most recent earlier occurrence of the sequence's last n-gram.

    ``input_ids``: ``(1, L)`` long (prompt and generated tokens). Tries ``n = max_ngram_size`` down to
    ``min_ngram_size``; for the first ``n`` whose last ``n`` tokens occur earlier in the sequence, returns up to
    ``max_tokens`` tokens that followed the most recent such occurrence, as ``(m,)`` long on the input's device
    (``m >= 1``); ``(0,)`` where no n-gram recurs or ``max_tokens < 1``. Where that occurrence is so recent that
    fewer than ``max_tokens`` tokens follow it (the text repeats with a short period ``p``), the copy overlaps
    itself as in LZ77: token ``j >= p`` of the continuation is token ``j - p`` (a loop is predicted to go on).
    """
    ids = input_ids[0]
    if max_tokens < 1:
        return ids.new_zeros(0)
    for n in range(min(max_ngram_size, ids.shape[0] - 1), max(min_ngram_size, 1) - 1, -1):
        windows = ids.unfold(0, n, 1)[:-1]  # every n-gram that starts before the last one
        hits = (windows == ids[-n:]).all(dim=1).nonzero()
        if hits.numel():
            start = int(hits[-1, 0]) + n
            follow = ids[start:start + max_tokens]
            if follow.shape[0] < max_tokens:  # overlapping copy: period len(follow) = L - start
                follow = follow.repeat(-(-max_tokens // follow.shape[0]))[:max_tokens]
            return follow
    return ids.new_zeros(0)


__all__ = ["ngram_continuation"]
