"""The DFlash2 speculative decoding loop behind ``target.generate(..., assistant_model=draft)``.

One cycle (DESIGN.md section 1): draft a block with the drafter, verify it with ONE target forward, accept the longest
matching prefix (greedy) or rejection-sample against the selector's ``q`` (sampling; Leviathan et al. 2023, arXiv
2211.17192, Chen et al. 2023, arXiv 2302.01318), append the bonus token, roll the target cache back, and hand the
accepted tokens' hidden states to the drafter as its next context.

It mirrors ``transformers``' ``_assisted_decoding`` (same model-kwargs bookkeeping, same logits processors, same
cache cropping) with three differences that the stock loop cannot offer:

* stopping criteria (EOS, ``max_length``, ``stop_strings``, user criteria) are checked after EVERY emitted token, so
  a stop inside an accepted block emits nothing past it — exactly what plain ``generate()`` emits;
* the sampling proposal ``q`` is the selector's distribution over its top-k, not a dense drafter softmax;
* per-cycle acceptance and a time split are recorded in :class:`~dflash2_hf.generation.GenerationStats`.
"""

from __future__ import annotations

import copy
import numbers
import time

import torch
from transformers import GenerationConfig
from transformers.generation.candidate_generator import (
    _prepare_attention_mask,
    _prepare_position_ids,
    _prepare_token_type_ids,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.utils import logging

from ..errors import UnsupportedGenerationError
from .candidate_generator import DFlash2CandidateGenerator, DraftProposal
from .precision import warn_if_emulated_bf16
from .stats import GenerationStats, timed

logger = logging.get_logger(__name__)

# transformers 5.24 renamed the generation cache kwarg/output field `past_key_values` -> `cache`.
_CACHE_KEYS = ("cache", "past_key_values")


def _cache_key(model_kwargs: dict) -> str:
    for key in _CACHE_KEYS:
        if model_kwargs.get(key) is not None:
            return key
    raise UnsupportedGenerationError("Speculative decoding needs a KV cache: do not pass use_cache=False.")


def _validate(target, input_ids, generation_config, synced_gpus, model_kwargs) -> None:
    if input_ids.shape[0] != 1:
        raise UnsupportedGenerationError(
            f"DFlash2 speculative decoding runs batch size 1 (like transformers' assisted decoding); got a batch of "
            f"{input_ids.shape[0]}. Call generate() once per prompt."
        )
    if synced_gpus:
        raise UnsupportedGenerationError("synced_gpus is not supported with a DFlash2 drafter.")
    if target.config.is_encoder_decoder:
        raise UnsupportedGenerationError("DFlash2 drafters serve decoder-only targets.")
    if generation_config.return_dict_in_generate and (
        generation_config.output_attentions or generation_config.output_hidden_states
    ):
        raise UnsupportedGenerationError(
            "output_attentions / output_hidden_states are not returned on the DFlash2 path; "
            "drop them or generate without assistant_model."
        )
    if not generation_config.use_cache:
        raise UnsupportedGenerationError("Speculative decoding needs use_cache=True.")


def _draft_length_settings(drafter) -> tuple[int, float | None]:
    """``(max drafts per cycle, confidence threshold or None)`` from the drafter's ``generation_config``.

    Raises:
        ValueError: ``num_assistant_tokens`` not a positive integer, or ``assistant_confidence_threshold`` not a
            number in ``[0, 1)``.
    """
    block_drafts = drafter.config.block_size - 1
    config = getattr(drafter, "generation_config", None)
    cap = getattr(config, "num_assistant_tokens", None)
    threshold = getattr(config, "assistant_confidence_threshold", None)
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, numbers.Integral) or cap < 1):
        raise ValueError(
            f"draft.generation_config.num_assistant_tokens must be a positive integer (drafts per cycle; values above "
            f"block_size - 1 = {block_drafts} are capped there); got {cap!r}. None = full blocks."
        )
    if threshold is not None and (
        isinstance(threshold, bool) or not isinstance(threshold, numbers.Real) or not 0 <= threshold < 1
    ):
        raise ValueError(
            f"draft.generation_config.assistant_confidence_threshold must be a probability in [0, 1); got "
            f"{threshold!r}. None (or 0) = no cut, full blocks."
        )
    return min(block_drafts, int(cap)) if cap is not None else block_drafts, threshold or None


def _warn_ignored_generate_knobs(generation_config) -> None:
    """``generate(..., num_assistant_tokens=...)`` etc. do not reach the drafter: say where they belong."""
    defaults = getattr(GenerationConfig, "_get_default_generation_params", dict)()
    changed = [key for key in ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
               if key in defaults and getattr(generation_config, key, None) not in (None, defaults[key])]
    if changed:
        logger.warning_once(
            f"{', '.join(changed)} (passed to generate() or set on the target's generation config) are ignored with "
            "a DFlash2 drafter: set draft.generation_config.num_assistant_tokens / assistant_confidence_threshold "
            "instead (fixed values; the 'heuristic' schedule is not used)."
        )


def _warn_cpu_drafter(drafter, input_ids) -> None:
    """A CPU drafter next to an accelerator target works (tensors are moved) but drafts slowly: say how to fix it."""
    if drafter.device.type == "cpu" and input_ids.device.type != "cpu":
        logger.warning_once(
            f"The drafter is on the CPU while the target runs on {input_ids.device}: drafting runs on the CPU (slow). "
            "Move it with draft.to(target.device)."
        )


def _first_stop(stopping_criteria, sequence: torch.LongTensor, start: int, scores) -> int | None:
    """Index (0-based, among tokens from ``start`` on) of the first token after which a criterion fires."""
    for end in range(start + 1, sequence.shape[1] + 1):
        if bool(stopping_criteria(sequence[:, :end], scores).any()):
            return end - start - 1
    return None


def _verify_greedy(logits, candidate_input_ids, cur_len, num_drafts, logits_processor):
    """Longest prefix of drafts equal to the target's (processed) argmax, plus the bonus token.

    Processors run only up to the first mismatch (each needs the prefix it conditions on).
    Returns ``(valid_tokens (1, n+1), n, processed_logits list)``.
    """
    if len(logits_processor) == 0:
        choice = logits.argmax(-1)  # (1, P+1)
        drafts = candidate_input_ids[:, cur_len:]
        n = int((~(drafts == choice[:, :num_drafts])).cumsum(-1).lt(1).sum())
        return choice[:, : n + 1], n, [logits[:, i] for i in range(n + 1)]
    processed = []
    for i in range(num_drafts + 1):
        scores = logits_processor(candidate_input_ids[:, : cur_len + i], logits[:, i])
        processed.append(scores)
        token = scores.argmax(-1, keepdim=True)
        if i == num_drafts or token.item() != candidate_input_ids[0, cur_len + i].item():
            drafts = candidate_input_ids[:, cur_len : cur_len + i]
            return torch.cat([drafts, token], dim=1), i, processed
    raise AssertionError("unreachable")


def _verify_sampled(logits, candidate_input_ids, cur_len, proposal: DraftProposal | None, logits_processor):
    """Rejection sampling of the drafts against the target (lossless; arXiv 2211.17192 Algorithm 1).

    Accept ``d_i`` with probability ``min(1, p(d_i) / q(d_i))``; on the first rejection sample from
    ``norm(max(0, p - q))``; if every draft passes, sample the bonus from the last ``p``. ``q`` is the selector's
    proposal over its top-k (zero elsewhere).
    """
    num_drafts = 0 if proposal is None else proposal.tokens.shape[1]
    q_tokens = None if proposal is None else proposal.q_of_tokens().tolist()
    processed = []
    for i in range(num_drafts + 1):
        scores = logits_processor(candidate_input_ids[:, : cur_len + i], logits[:, i])
        processed.append(scores)
        p = torch.softmax(scores[0].float(), dim=-1)
        if i == num_drafts:
            token = torch.multinomial(p, 1)
            break
        draft = int(candidate_input_ids[0, cur_len + i])
        if torch.rand(()).item() * q_tokens[i] <= p[draft].item():  # u <= p/q without dividing by a tiny q
            continue
        q_dense = torch.zeros_like(p).scatter_(0, proposal.candidate_ids[i].to(p.device), proposal.q[i].to(p))
        residual = (p - q_dense).clamp_(min=0)
        total = residual.sum()
        token = torch.multinomial(residual / total if total > 0 else p, 1)
        break
    drafts = candidate_input_ids[:, cur_len : cur_len + i]
    return torch.cat([drafts, token[None].to(drafts)], dim=1), i, processed


@torch.no_grad()
def dflash2_assisted_decoding(
    target,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus: bool = False,
    streamer=None,
    inputs_tensor=None,
    assistant_model=None,
    assistant_tokenizer=None,
    tokenizer=None,
    **model_kwargs,
):
    """Speculative decoding with a DFlash2 drafter; same arguments and return value as ``_assisted_decoding``.

    Called by ``target.generate(..., assistant_model=draft)`` once ``dflash2_hf`` is imported (see
    :mod:`.routing`); not meant to be called directly.

    Returns:
        ``(1, prompt + new)`` long tensor, or a ``GenerateDecoderOnlyOutput`` (sequences, scores, logits, cache)
        with ``return_dict_in_generate=True``. ``assistant_model.generation_stats`` holds the call's statistics.

    Raises:
        UnsupportedGenerationError: batch size > 1, ``synced_gpus``, encoder-decoder targets, requests for
            attentions/hidden states, ``use_cache=False``.
        DrafterTargetMismatchError: the drafter was built for another target.
        ValueError: invalid draft-length knobs on ``drafter.generation_config``.
    """
    _validate(target, input_ids, generation_config, synced_gpus, model_kwargs)
    drafter = assistant_model.get_base_model() if hasattr(assistant_model, "get_base_model") else assistant_model
    drafter.check_target(target)
    max_drafts, confidence_threshold = _draft_length_settings(drafter)
    _warn_ignored_generate_knobs(generation_config)
    warn_if_emulated_bf16(drafter)
    _warn_cpu_drafter(drafter, input_ids)
    cache_key = _cache_key(model_kwargs)
    target_cache = model_kwargs[cache_key]
    if target_cache.get_seq_length() > 0:
        raise UnsupportedGenerationError(
            "A pre-filled target cache is not supported with a DFlash2 drafter (the drafter needs the prompt's "
            "hidden states): pass the whole prompt without a cache."
        )
    if hasattr(target_cache, "activate_past_recording"):
        target_cache.activate_past_recording()  # sliding-window layers must be able to roll back

    do_sample = bool(generation_config.do_sample)
    stats = GenerationStats(block_size=drafter.config.block_size)
    drafter.generation_stats = stats
    generator = DFlash2CandidateGenerator(
        drafter,
        target,
        do_sample=do_sample,
        temperature=float(generation_config.temperature or 1.0) if do_sample else 1.0,
        use_selector=drafter.use_selector,
        stats=stats,
        confidence_threshold=confidence_threshold,
    )
    return_dict = generation_config.return_dict_in_generate
    scores = () if (return_dict and generation_config.output_scores) else None
    raw_logits = () if (return_dict and generation_config.output_logits) else None
    max_length = generation_config.max_length
    prompt_len = input_ids.shape[1]
    is_first_iteration = True
    loop_start = time.perf_counter()

    while True:
        cur_len = input_ids.shape[1]
        proposal = None
        # 1. Draft, never past max_length: accepted drafts + the bonus token must fit.
        num_drafts = 0 if is_first_iteration else min(max_drafts, max_length - cur_len - 1)
        if num_drafts > 0:
            proposal = generator.propose(input_ids, num_drafts)
            num_drafts = proposal.tokens.shape[1]  # the confidence threshold may have cut the path
            candidate_input_ids = torch.cat([input_ids, proposal.tokens.to(input_ids.device)], dim=1)
        else:
            candidate_input_ids = input_ids
            num_drafts = 0

        # 2. Verify: one target forward over [anchor, drafts] (the whole prompt on the first iteration).
        candidate_kwargs = copy.copy(model_kwargs)
        candidate_kwargs = _prepare_attention_mask(candidate_kwargs, candidate_input_ids.shape[1], False)
        candidate_kwargs = _prepare_token_type_ids(candidate_kwargs, candidate_input_ids.shape[1])
        if candidate_kwargs.get("position_ids") is not None and num_drafts > 0:
            new_length = num_drafts + candidate_kwargs["position_ids"].shape[-1]
            candidate_kwargs = _prepare_position_ids(candidate_kwargs, new_length, False)
        model_inputs = target.prepare_inputs_for_generation(
            candidate_input_ids,
            next_sequence_length=None if is_first_iteration else num_drafts + 1,
            is_first_iteration=is_first_iteration,
            **candidate_kwargs,
        )
        if "logits_to_keep" in model_inputs:
            model_inputs["logits_to_keep"] = num_drafts + 1
        model_inputs.update(generator.model_kwargs_overrides)
        with timed(stats, "prefill_seconds" if is_first_iteration else "verify_seconds", input_ids.device):
            outputs = target(**model_inputs)
        new_logits = outputs.logits[:, -num_drafts - 1 :].to(dtype=torch.float32, device=input_ids.device)

        # 3. Accept.
        if do_sample:
            valid_tokens, n_accepted, processed = _verify_sampled(
                new_logits, candidate_input_ids, cur_len, proposal, logits_processor
            )
        else:
            valid_tokens, n_accepted, processed = _verify_greedy(
                new_logits, candidate_input_ids, cur_len, num_drafts, logits_processor
            )

        # 4. Stop exactly where plain decoding would: check every emitted token, not just the block's end.
        sequence = torch.cat([input_ids, valid_tokens], dim=1)
        stop = _first_stop(stopping_criteria, sequence, cur_len, scores)
        if stop is not None:
            valid_tokens = valid_tokens[:, : stop + 1]
            sequence = sequence[:, : cur_len + stop + 1]
        n_matches = valid_tokens.shape[1] - 1
        input_ids = sequence
        if streamer is not None:
            streamer.put(valid_tokens.cpu())
        if not is_first_iteration:
            stats.acceptance_lengths.append(n_matches + 1)
            stats.accepted_drafts.append(n_accepted)
            stats.draft_lengths.append(num_drafts)
        if scores is not None:
            scores += tuple(processed[: n_matches + 1])
        if raw_logits is not None:
            raw_logits += tuple(new_logits[:, i] for i in range(n_matches + 1))

        # 5. Roll the target cache back to the accepted tokens; queue their hidden states as drafter context.
        output_cache = getattr(outputs, cache_key, None)
        if output_cache is None:
            output_cache = target_cache
        output_cache.crop(-(num_drafts - n_matches))
        model_kwargs = target._update_model_kwargs_for_generation(
            outputs, model_kwargs, is_encoder_decoder=False, num_new_tokens=n_matches + 1
        )
        if stop is not None:
            break
        processed_tokens = cur_len if is_first_iteration else n_matches + 1
        generator.add_context(outputs.hidden_states, processed_tokens)
        is_first_iteration = False

    if streamer is not None:
        streamer.end()
    stats.new_tokens = input_ids.shape[1] - prompt_len
    stats.total_seconds = time.perf_counter() - loop_start
    if return_dict:
        return GenerateDecoderOnlyOutput(
            sequences=input_ids, scores=scores, logits=raw_logits, **{cache_key: model_kwargs.get(cache_key)}
        )
    return input_ids
