"""The DFlash2 candidate generator: drafts one block per cycle and picks a path with the candidate selector.

Implements steps 2 and 3 of a cycle (DESIGN.md sections 1 and 3) in the role of a ``transformers`` ``CandidateGenerator``: the
target's hidden states of ``target_layer_ids`` (requested through ``model_kwargs_overrides``) become the drafter's
context features; one drafter pass over ``[anchor, MASK x (B-1)]`` gives hidden states whose target-LM-head logits
yield the top-k candidates per position; the selector scores predecessor -> successor pairs and walks the best path
(greedy) or samples one and returns the proposal distribution ``q`` (sampling; zero outside the top-k).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from ..masking import drafter_cache
from ..quantization import is_int8, quantized_linear
from .prompt_lookup import ngram_continuation
from .stats import GenerationStats, timed


@dataclass
class DraftProposal:
    """One cycle's draft.

    Attributes:
        tokens: ``(1, P)`` long, the proposed path (``P <= B - 1``).
        candidate_ids: ``(P, k)`` long, top-k candidates per position (sampling only, else None).
        q: ``(P, k)`` float32, proposal probability of each candidate given the sampled predecessor (sampling only).
        confidence: ``(P,)`` float32, :func:`path_confidence` of each proposed draft (when a draft-length rule read
            it, else None).
        copied: the drafts (after the first, where ``drafted``) are copied from the context (:mod:`.prompt_lookup`).
        drafted: the drafter made a pass for this proposal (False: a copy made without one).
    """

    tokens: torch.LongTensor
    candidate_ids: torch.LongTensor | None = None
    q: torch.Tensor | None = None
    confidence: torch.Tensor | None = None
    copied: bool = False
    drafted: bool = True

    def q_of_tokens(self) -> torch.Tensor:
        """``(P,)`` proposal probability of each proposed token."""
        hit = self.candidate_ids == self.tokens[0, :, None]
        return (self.q * hit).sum(-1)


def walk_greedy(scores: torch.Tensor) -> list[int]:
    """Best path through pair scores ``(P, a, k)`` (row 0 of position 0 is the anchor): candidate index per position."""
    best = scores.argmax(-1).tolist()  # (P, a): best successor for every predecessor, one op for all positions
    path = [best[0][0]]
    for t in range(1, len(best)):
        path.append(best[t][path[-1]])
    return path


def walk_sampled(scores: torch.Tensor, temperature: float) -> tuple[list[int], torch.Tensor]:
    """Samples a path from ``softmax(S_t(prev, .) / T)``; returns candidate indices and ``q`` ``(P, k)`` float32."""
    probs = torch.softmax(scores.float() / temperature, dim=-1)  # (P, a, k)
    cdf = probs.cumsum(-1)
    u = torch.rand(probs.shape[0], device=probs.device)
    path, rows = [], []
    prev = 0
    for t in range(probs.shape[0]):
        row = cdf[t, prev]
        idx = int(torch.searchsorted(row, u[t] * row[-1]).clamp(max=row.shape[0] - 1))
        rows.append(probs[t, prev])
        path.append(idx)
        prev = idx
    return path, torch.stack(rows)


def path_confidence(scores: torch.Tensor, path: list[int]) -> torch.Tensor:
    """``(P,)`` float32: the drafter's probability of each path step given its predecessor.

    ``softmax(S_t(prev, .))`` at the chosen candidate over the top-k, at temperature 1 whatever the generation
    temperature (so one threshold means the same in greedy and sampling). ``scores``: ``(P, k, k)`` pair scores
    (selector; without it the top-k logits repeated for every predecessor).
    """
    steps = torch.arange(len(path), device=scores.device)
    chosen = torch.tensor(path, device=scores.device)
    prev = torch.cat([chosen.new_zeros(1), chosen[:-1]])  # row 0 of position 1 is the anchor
    rows = torch.softmax(scores[steps, prev].float(), dim=-1)  # (P, k)
    return rows[steps, chosen]


def confident_prefix(confidence: torch.Tensor, threshold: float | None) -> int:
    """How many drafts to verify: up to and including the first one whose confidence is below ``threshold``.

    Like ``transformers``' ``ConfidenceCriteria`` the first low-confidence draft is still proposed, so a cycle with
    room for a draft always gets one (the confidence itself is :func:`path_confidence`, not a full-vocabulary
    softmax). ``None`` or 0 keeps them all. The cut depends on the drafter alone, so verification (greedy or
    rejection sampling) stays exact.
    """
    if not threshold:
        return confidence.shape[0]
    low = (confidence < threshold).nonzero()
    return int(low[0, 0]) + 1 if low.numel() else confidence.shape[0]


def lm_head_for_drafter(target: PreTrainedModel, drafter) -> torch.nn.Module | torch.Tensor:
    """The target's LM head as the drafter applies it when drafting (see :func:`draft_lm_head`)."""
    return draft_lm_head(target.get_output_embeddings(), drafter)


def draft_lm_head(head: torch.nn.Module, drafter) -> torch.nn.Module | torch.Tensor:
    """``head`` as the drafter applies it: drafting and the training loss both use this.

    The rows of the drafter's draft vocabulary only (if it has one; a ``(V_draft, H)`` tensor), in the drafter's
    dtype (a bf16 drafter on an fp32 target drafts ~3x cheaper on CPUs with bf16 units, still lossless since only
    verification decides), or as a dynamic int8 linear for an int8 drafting copy (:mod:`dflash2_hf.quantization`); a
    head with a bias becomes a small ``nn.Linear`` of those rows and their bias. ``head`` itself when nothing needs
    deriving. Such a derived weight is computed once and cached on the drafter (the head is frozen).
    """
    vocab = getattr(drafter, "draft_vocab_ids", None)
    int8 = is_int8(drafter)
    bias = getattr(head, "bias", None)
    if head.weight.dtype == drafter.dtype and vocab is None and not int8:
        return head
    key = (head.weight.data_ptr(), head.weight._version, drafter.dtype, None if vocab is None else vocab.data_ptr(), int8,
           None if bias is None else (bias.data_ptr(), bias._version))
    cached = getattr(drafter, "_lm_head_cast", None)
    if cached is None or cached[0] != key:
        rows = slice(None) if vocab is None else vocab.to(head.weight.device)
        weight = head.weight.detach()[rows]
        if int8:
            derived = quantized_linear(weight, None if bias is None else bias.detach()[rows])
        elif bias is None:
            derived = weight.to(drafter.dtype)
        else:  # a biased head keeps its bias rows: a small Linear of the draft rows
            derived = torch.nn.Linear(weight.shape[1], weight.shape[0], device=weight.device, dtype=drafter.dtype)
            derived.weight.data, derived.bias.data = weight.to(drafter.dtype), bias.detach()[rows].to(drafter.dtype)
        cached = (key, derived)
        drafter._lm_head_cast = cached
    return cached[1]


class DFlash2CandidateGenerator:
    """Drafts with a :class:`~dflash2_hf.DFlash2DraftModel` for the decoding loop in :mod:`.decoding`.

    Args:
        drafter: the drafter (a PEFT-wrapped drafter passes its base model; LoRA layers live inside it).
        target: the target model whose embeddings and LM head the drafter uses.
        do_sample: sample a path (and return ``q``) instead of walking the best one.
        temperature: selector sampling temperature (the generation temperature).
        use_selector: False = the top-1 path / plain top-k proposal (the selector's measured baseline).
        stats: where drafting and selection times are added.
        confidence_threshold: cut each proposed path after its first draft whose confidence
            (:func:`path_confidence`: the selector's probability of the step over the top-k, or the top-k softmax
            without the selector) is below this value (:func:`confident_prefix`); ``None`` proposes every requested
            draft.
        position_offset: the anchor's drafter position minus its index in ``input_ids``: the prompt positions
            ``input_ids`` lacks (an ``inputs_embeds`` prompt) minus the padding kept out of the context.
        draft_length: a :class:`~.draft_length.DraftLengthPolicy` choosing how many drafts of each path to propose
            from the cost curve and the calibrated confidence (instead of ``confidence_threshold``), or None.
        prompt_lookup_ngram: copy from the context (:mod:`.prompt_lookup`): the longest n-gram
            (``n <= prompt_lookup_ngram``) to match; 0 = never copy.
        copy_min_ngram: :meth:`propose_copy` copies without drafting where an n-gram of at least this many tokens
            recurs (shorter matches are copied only where the drafter agrees).
        copy_max_tokens: the most tokens one copy proposes (a copy may be longer than a drafter block).
        max_length: the call's ``max_length`` (prompt included): a copy never reaches past it (None: a copy is no
            longer than the requested drafts).
    """

    def __init__(
        self,
        drafter,
        target: PreTrainedModel,
        do_sample: bool,
        temperature: float,
        use_selector: bool,
        stats: GenerationStats,
        confidence_threshold: float | None = None,
        position_offset: int = 0,
        draft_length=None,
        prompt_lookup_ngram: int = 0,
        copy_min_ngram: int = 2,
        copy_max_tokens: int = 15,
        max_length: int | None = None,
    ):
        if copy_min_ngram < 1 or copy_max_tokens < 1:
            raise ValueError(f"copy_min_ngram and copy_max_tokens must be >= 1, got {copy_min_ngram}, {copy_max_tokens}")
        self.drafter = drafter
        self.prompt_lookup_ngram = prompt_lookup_ngram
        self.copy_min_ngram = copy_min_ngram
        self.copy_max_tokens = copy_max_tokens
        self.max_length = max_length
        self.draft_length = draft_length
        self.position_offset = position_offset
        self.confidence_threshold = confidence_threshold
        config = drafter.config
        self.block_size = config.block_size
        self.top_k = min(config.selector_top_k, config.draft_vocab_size or config.vocab_size)
        self.embedding_weight = target.get_input_embeddings().weight
        self.lm_head = lm_head_for_drafter(target, drafter)
        self.vocab_ids = getattr(drafter, "draft_vocab_ids", None)  # draft-vocab index -> target id (None: identity)
        self.hidden_layer_indices = [i + 1 for i in config.target_layer_ids]
        self.model_kwargs_overrides = {"output_hidden_states": self.hidden_layer_indices}
        self.selector = drafter.candidate_selector if use_selector else None
        self.do_sample = do_sample
        self.temperature = temperature
        self.stats = stats
        self.device = drafter.device
        self.cache = drafter_cache(config)  # windowed layers keep their last keys and can roll back
        self.context_positions = 0  # positions whose context features are in the drafter cache or pending
        self.pending: list[torch.Tensor] = []
        self.mask_ids = torch.full((1, self.block_size - 1), config.mask_token_id, dtype=torch.long, device=self.device)

    def add_context(
        self, hidden_states: tuple[torch.Tensor, ...], num_tokens: int, keep: torch.Tensor | None = None
    ) -> None:
        """Queues the target hidden states of the first ``num_tokens`` positions of the last target forward.

        ``hidden_states`` is the target output's tuple (index 0 = embeddings); only ``target_layer_ids`` are read.
        ``keep``: optional ``(num_tokens,)`` bool, the positions to queue (the prompt's unpadded ones); the drafter
        numbers the kept positions consecutively, as the target's mask-derived position ids do.
        """
        features = torch.cat([hidden_states[i][:, :num_tokens] for i in self.hidden_layer_indices], dim=-1)
        if keep is not None:
            features = features[:, keep.to(features.device)]
        self.pending.append(features.to(self.device))
        self.context_positions += features.shape[1]

    @torch.no_grad()
    def propose_copy(self, input_ids: torch.LongTensor, room: int) -> DraftProposal | None:
        """Copies from the context without a drafter pass where the sequence's last n-gram of at least
        ``copy_min_ngram`` tokens recurs in it (the longest such n-gram, up to ``prompt_lookup_ngram``): the tokens
        that followed its most recent occurrence (at least 2, at most ``min(copy_max_tokens, room)``), else None.
        Sampling: every copied token is a deterministic proposal (``q = 1``), as in prompt lookup decoding, so
        rejection sampling stays exact."""
        if not self.prompt_lookup_ngram or room < 2 or self.copy_min_ngram > self.prompt_lookup_ngram:
            return None
        with timed(self.stats, "select_seconds", self.device):
            tokens = ngram_continuation(input_ids, self.prompt_lookup_ngram, min(self.copy_max_tokens, room),
                                        min_ngram_size=self.copy_min_ngram)
            if tokens.shape[0] < 2:
                return None
            tokens = tokens.to(self.device)
            if not self.do_sample:
                return DraftProposal(tokens=tokens[None], copied=True, drafted=False)
            return DraftProposal(tokens=tokens[None], candidate_ids=tokens[:, None],
                                 q=torch.ones(tokens.shape[0], 1, device=self.device), copied=True, drafted=False)

    @torch.no_grad()
    def propose(self, input_ids: torch.LongTensor, num_drafts: int) -> DraftProposal:
        """Drafts up to ``num_drafts`` (``1 .. B-1``) tokens after ``input_ids`` (its last token is the anchor).

        Fewer (at least one) when ``confidence_threshold`` cuts the path. A copy from the context
        (:meth:`propose_copy`, or one the drafter agrees with) may be longer, up to ``max_length``.

        Raises:
            RuntimeError: the queued context does not end right before the anchor (a loop bookkeeping bug).
        """
        room = num_drafts if self.max_length is None else max(num_drafts, self.max_length - input_ids.shape[1] - 1)
        copied = self.propose_copy(input_ids, room)
        if copied is not None:
            return copied
        anchor_pos = self.position_offset + input_ids.shape[1] - 1
        if self.context_positions != anchor_pos:
            raise RuntimeError(
                f"Drafter context covers {self.context_positions} positions but the anchor sits at {anchor_pos}."
            )
        self.stats.drafter_passes += 1
        with timed(self.stats, "draft_seconds", self.device):
            context = torch.cat(self.pending, dim=1) if len(self.pending) > 1 else self.pending[0]
            self.pending = []
            block_ids = torch.cat([input_ids[:, -1:].to(self.device), self.mask_ids], dim=1)
            # the target's embedding / LM head may live on another device (device_map="auto", a CPU drafter)
            embeds = self.drafter.embed_block(block_ids.to(self.embedding_weight.device), self.embedding_weight)
            embeds = embeds.to(self.device)
            start = anchor_pos - context.shape[1]
            position_ids = torch.arange(start, anchor_pos + self.block_size, device=self.device)[None]
            hidden = self.drafter(embeds, context, position_ids=position_ids, cache=self.cache).last_hidden_state
            self.cache.crop(-self.block_size)  # keep the context keys/values, drop the block's
            hidden = hidden[:, 1 : 1 + num_drafts]
            logits = self.drafter.compute_logits(hidden, self.lm_head)[0].to(self.device)  # (P, V) or (P, draft vocab)

        with timed(self.stats, "select_seconds", self.device):
            if not self.do_sample and self.selector is None and not self.confidence_threshold and not self.draft_length:
                tokens = self._to_target_ids(logits.argmax(-1))[None]
                return self._copied(input_ids, tokens[0, 0], room) or DraftProposal(tokens=tokens)
            top_logits, candidate_ids = logits.topk(self.top_k, dim=-1)  # (P, k)
            candidate_ids = self._to_target_ids(candidate_ids)
            if self.selector is None:  # the unary term alone: the same row for every predecessor
                scores = top_logits[:, None, :].expand(-1, self.top_k, -1)
            else:
                # predecessors: the anchor for position 1, the k candidates of t-1 for position t
                anchor = input_ids[:, -1].to(self.device).expand(1, self.top_k)
                predecessors = torch.cat([anchor, candidate_ids[:-1]], dim=0)
                scores = self.selector.pair_scores(hidden[0], predecessors, candidate_ids, top_logits)
            if self.do_sample:
                path, q = walk_sampled(scores, self.temperature)
            else:
                path, q = walk_greedy(scores), None
                if self.selector is not None:  # candidate index 0 is the drafter's top-1 at every position
                    self.stats.selector_passes += 1
                    self.stats.selector_changed_passes += any(path)
            first = (candidate_ids[0], None if q is None else q[0])  # the drafter's proposal of position 1
            copied = self._copied(input_ids, candidate_ids[0, path[0]], room, first)
            if copied is not None:
                return copied
            confidence = None
            if self.confidence_threshold or self.draft_length:
                confidence = path_confidence(scores, path)
                if self.draft_length:  # the mean drafting time per proposal so far (this one's included) is T_draft
                    spent = (self.stats.draft_seconds + self.stats.select_seconds) / self.stats.drafter_passes
                    keep = self.draft_length.choose(confidence.cpu(), spent)
                else:
                    keep = confident_prefix(confidence, self.confidence_threshold)
                path, candidate_ids, confidence = path[:keep], candidate_ids[:keep], confidence[:keep]
                q = None if q is None else q[:keep]
            index = torch.tensor(path, device=self.device)
            tokens = candidate_ids.gather(1, index[:, None]).T
            return DraftProposal(tokens=tokens, candidate_ids=candidate_ids if q is not None else None, q=q,
                                 confidence=confidence)

    def _copied(self, input_ids: torch.LongTensor, first_draft: torch.Tensor, room: int,
                first_row: tuple | None = None) -> DraftProposal | None:
        """The n-gram continuation of ``input_ids`` (at most ``min(copy_max_tokens, room)`` tokens) as this cycle's
        proposal, where its first token equals the drafter's ``first_draft`` (else None). Sampling: position 1 keeps
        the drafter's candidates and ``q`` (``first_row``), the copied tokens after it have ``q = 1``."""
        # propose() ran propose_copy first: n-grams of copy_min_ngram tokens and longer did not recur
        longest = self.prompt_lookup_ngram if self.copy_min_ngram > self.prompt_lookup_ngram else self.copy_min_ngram - 1
        if longest < 1 or room < 2:
            return None
        tokens = ngram_continuation(input_ids, longest, min(self.copy_max_tokens, room))
        if tokens.shape[0] < 2 or not self._agrees(tokens, first_draft):
            return None
        tokens = tokens.to(self.device)
        if not self.do_sample:
            return DraftProposal(tokens=tokens[None], copied=True)
        candidates, q_first = first_row
        copies = tokens[1:, None].expand(-1, candidates.shape[0])  # (m - 1, k): one candidate, repeated
        q_copies = torch.zeros(copies.shape, dtype=q_first.dtype, device=q_first.device)
        q_copies[:, 0] = 1.0
        return DraftProposal(tokens=tokens[None], candidate_ids=torch.cat([candidates[None], copies]),
                             q=torch.cat([q_first[None], q_copies]), copied=True)

    @staticmethod
    def _agrees(continuation: torch.LongTensor, first_draft: torch.Tensor) -> bool:
        """Whether to verify ``continuation`` ``(m,)``: its first token is the drafter's first draft."""
        return int(continuation[0]) == int(first_draft)

    def _to_target_ids(self, ids: torch.LongTensor) -> torch.LongTensor:
        return ids if self.vocab_ids is None else self.vocab_ids[ids]
