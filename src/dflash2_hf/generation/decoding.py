"""The DFlash2 speculative decoding loop behind ``target.generate(..., assistant_model=draft)``.

One cycle (DESIGN.md section 1): draft a block with the drafter, verify it with ONE target forward, accept the longest
matching prefix (greedy) or rejection-sample against the selector's ``q`` (sampling; Leviathan et al. 2023, arXiv
2211.17192, Chen et al. 2023, arXiv 2302.01318), append the bonus token, roll the target cache back, and hand the
accepted tokens' hidden states to the drafter as its next context.

It mirrors ``transformers``' ``_assisted_decoding`` (same model-kwargs bookkeeping, same logits processors, same
cache cropping) with these differences from the stock loop:

* every emitted token is shown to the logits processors, stopping criteria (EOS, ``max_length``, ``stop_strings``,
  user criteria, with ``scores`` up to that token), streamer and output records exactly as plain ``generate()``
  shows it (:mod:`.verification`), so a stop inside an accepted block emits, and processes, nothing past it;
* inputs it cannot decode exactly (a quantized cache, a pre-filled cache, ...) are refused with a clear error
  (:mod:`.inputs`); an ``inputs_embeds`` prompt and a padding mask decode exactly;
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

from ..quantization import check_int8_drafting
from .candidate_generator import DFlash2CandidateGenerator
from .draft_length import COST_SCHEDULE, policy_for
from .inputs import PromptLayout, cache_key, check_rollback, validate
from .precision import warn_if_emulated_bf16
from .stats import GenerationStats, timed
from .verification import TokenEmitter, greedy_picker, sampling_picker, verify_block

logger = logging.get_logger(__name__)

PROMPT_LOOKUP_NGRAM = 3  # longest n-gram matched when copying from the context (drafter.use_prompt_lookup)
COPY_MIN_NGRAM = 2  # a recurring n-gram this long is copied without drafting; shorter ones where the drafter agrees
COPY_MAX_TOKENS = 15  # the most tokens one copy proposes (verified as 16 with the anchor)


def _draft_length_settings(drafter) -> tuple[int, float | None, bool]:
    """``(max drafts per cycle, confidence threshold or None, cost schedule)`` from the drafter's ``generation_config``
    (``num_assistant_tokens_schedule="cost"``: the draft length from the cost curve, :mod:`.draft_length`).

    Raises:
        ValueError: ``num_assistant_tokens`` not a positive integer, ``assistant_confidence_threshold`` not a
            number in ``[0, 1)``, a schedule other than None / "constant" / "cost", or "cost" with a threshold.
    """
    block_drafts = drafter.config.block_size - 1
    config = getattr(drafter, "generation_config", None)
    cap = getattr(config, "num_assistant_tokens", None)
    threshold = getattr(config, "assistant_confidence_threshold", None)
    schedule = getattr(config, "num_assistant_tokens_schedule", None)
    if schedule not in (None, "constant", COST_SCHEDULE):
        raise ValueError(
            f"draft.generation_config.num_assistant_tokens_schedule={schedule!r} is not used by the DFlash2 loop: set "
            f"{COST_SCHEDULE!r} (draft length from the measured cost curve and the calibrated confidence) or None / "
            "'constant' (num_assistant_tokens drafts, or full blocks)."
        )
    if schedule == COST_SCHEDULE and threshold:
        raise ValueError(
            f"draft.generation_config: num_assistant_tokens_schedule={COST_SCHEDULE!r} chooses the draft length itself; "
            f"unset assistant_confidence_threshold (now {threshold!r}) or the schedule."
        )
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
    drafts = min(block_drafts, int(cap)) if cap is not None else block_drafts
    return drafts, threshold or None, schedule == COST_SCHEDULE


def _warn_ignored_generate_knobs(generation_config) -> None:
    """``generate(..., num_assistant_tokens=...)`` etc. do not reach the drafter, nor ``prefill_chunk_size`` the prefill:
    say so (and where the drafter's knobs belong)."""
    defaults = getattr(GenerationConfig, "_get_default_generation_params", dict)()
    changed = [key for key in ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
               if key in defaults and getattr(generation_config, key, None) not in (None, defaults[key])]
    if changed:
        logger.warning_once(
            f"{', '.join(changed)} (passed to generate() or set on the target's generation config) are ignored with "
            "a DFlash2 drafter: set them on the drafter instead, draft.generation_config.num_assistant_tokens / "
            "assistant_confidence_threshold / num_assistant_tokens_schedule ('cost': the draft length from the "
            "measured cost curve; transformers' 'heuristic' schedules are not used)."
        )
    if getattr(generation_config, "prefill_chunk_size", None):
        logger.warning_once(
            f"prefill_chunk_size={generation_config.prefill_chunk_size} is not used with a DFlash2 drafter: the prompt "
            "is prefilled in one target forward (same output, the peak memory of an unchunked prefill). Drop it, or "
            "generate without assistant_model to prefill in chunks."
        )


def _warn_cpu_drafter(drafter, input_ids) -> None:
    """A CPU drafter next to an accelerator target works (tensors are moved) but drafts slowly: say how to fix it."""
    if drafter.device.type == "cpu" and input_ids.device.type != "cpu":
        logger.warning_once(
            f"The drafter is on the CPU while the target runs on {input_ids.device}: drafting runs on the CPU (slow). "
            "Move it with draft.to(target.device)."
        )


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
    :mod:`.routing`); not meant to be called directly. Everything a logits processor, stopping criterion, streamer
    or ``return_dict_in_generate`` field sees is what plain decoding shows it, token by token
    (:mod:`.verification`).

    Returns:
        ``(1, prompt + new)`` long tensor (``(1, new)`` for an ``inputs_embeds`` prompt, as plain ``generate()``), or
        a ``GenerateDecoderOnlyOutput`` (sequences, scores, logits, cache) with ``return_dict_in_generate=True``.
        ``assistant_model.generation_stats`` holds the call's statistics.

    Raises:
        UnsupportedGenerationError: batch size > 1, ``synced_gpus``, encoder-decoder targets, requests for
            attentions/hidden states, ``use_cache=False``, a pre-filled cache, a mis-sized attention mask, a cache
            that cannot be rolled back (quantized, ...; see :mod:`.inputs`).
        DrafterTargetMismatchError: the drafter was built for another target.
        ValueError: invalid draft-length knobs on ``drafter.generation_config``.
    """
    validate(target, input_ids, generation_config, synced_gpus, model_kwargs)
    drafter = assistant_model.get_base_model() if hasattr(assistant_model, "get_base_model") else assistant_model
    drafter.check_target(target)
    check_int8_drafting(drafter)
    max_drafts, confidence_threshold, cost_schedule = _draft_length_settings(drafter)
    _warn_ignored_generate_knobs(generation_config)
    warn_if_emulated_bf16(drafter)
    _warn_cpu_drafter(drafter, input_ids)
    key = cache_key(model_kwargs)
    layout = PromptLayout.of(input_ids, model_kwargs)
    if hasattr(model_kwargs[key], "activate_past_recording"):
        model_kwargs[key].activate_past_recording()  # sliding-window layers must be able to roll back

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
        position_offset=layout.offset - layout.hidden_positions,
        prompt_lookup_ngram=PROMPT_LOOKUP_NGRAM if getattr(drafter, "use_prompt_lookup", False) else 0,
        copy_min_ngram=COPY_MIN_NGRAM,
        copy_max_tokens=COPY_MAX_TOKENS,
        max_length=generation_config.max_length if max_drafts >= drafter.config.block_size - 1 else None,
    )
    if cost_schedule:  # measures the cost curve on first use: before the timed loop, outside the stats
        generator.draft_length = policy_for(drafter, target, generator.hidden_layer_indices)
        stats.cost_curve = generator.draft_length.curve.to_dict()
    return_dict = generation_config.return_dict_in_generate
    emitter = TokenEmitter(
        stopping_criteria,
        streamer,
        scores=() if (return_dict and generation_config.output_scores) else None,
        raw_logits=() if (return_dict and generation_config.output_logits) else None,
    )
    max_length = generation_config.max_length
    prompt_len = input_ids.shape[1]
    is_first_iteration = True
    loop_start = time.perf_counter()

    while True:
        cur_len = input_ids.shape[1]
        # 1. Draft, never past max_length: accepted drafts + the bonus token must fit.
        cycle_start = time.perf_counter()
        proposal = None
        num_drafts = 0 if is_first_iteration else min(max_drafts, max_length - cur_len - 1)
        if num_drafts and generator.draft_length is not None and not generator.draft_length.should_draft():
            num_drafts = 0
        candidate_input_ids = input_ids
        drafted = False  # whether the drafter made a pass this cycle
        if num_drafts > 0:  # a copy from the context (up to max_length) or the drafter's path
            proposal = generator.propose(input_ids, num_drafts)
            drafted = proposal.drafted
            candidate_input_ids = torch.cat([input_ids, proposal.tokens.to(input_ids.device)], dim=1)
            if proposal.tokens.shape[1] == 0:  # the cost schedule chose to verify the anchor alone
                proposal = None
        num_drafts = candidate_input_ids.shape[1] - cur_len  # the confidence threshold may have cut the path

        # 2. Verify: one target forward over [anchor, drafts] (the whole prompt on the first iteration). Masks and
        # token types cover the prompt positions input_ids lacks (inputs_embeds) too.
        candidate_kwargs = copy.copy(model_kwargs)
        full_length = layout.offset + candidate_input_ids.shape[1]
        candidate_kwargs = _prepare_attention_mask(candidate_kwargs, full_length, False)
        candidate_kwargs = _prepare_token_type_ids(candidate_kwargs, full_length)
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
        output_cache = getattr(outputs, key, None)
        if output_cache is None:
            output_cache = model_kwargs[key]
        if is_first_iteration:
            check_rollback(output_cache, generation_config)
        new_logits = outputs.logits[:, -num_drafts - 1 :].to(dtype=torch.float32, device=input_ids.device)

        # 3. Accept and emit token by token, stopping exactly where plain decoding would.
        pick = sampling_picker(proposal) if do_sample else greedy_picker(None if proposal is None else proposal.tokens)
        block = verify_block(new_logits, input_ids, logits_processor, emitter, pick)
        input_ids = block.sequence
        n_matches = block.emitted - 1
        copied_only = proposal is not None and not drafted  # no drafter pass: neither a drafting nor a plain cycle
        if generator.draft_length is not None and not is_first_iteration and not block.stopped and not copied_only:
            if proposal is not None and proposal.confidence is not None:  # a stop hides what came after it
                generator.draft_length.update(proposal.confidence, block.accepted)
            generator.draft_length.record_cycle(block.emitted, time.perf_counter() - cycle_start, drafted)
        if not is_first_iteration:
            stats.acceptance_lengths.append(block.emitted)
            stats.accepted_drafts.append(block.accepted)
            stats.draft_lengths.append(num_drafts)
            stats.copied.append(proposal is not None and proposal.copied)
            stats.copies_without_drafting += int(copied_only)

        # 4. Roll the target cache back to the accepted tokens; queue their hidden states as drafter context.
        output_cache.crop(-(num_drafts - n_matches))
        model_kwargs = target._update_model_kwargs_for_generation(
            outputs, model_kwargs, is_encoder_decoder=False, num_new_tokens=n_matches + 1
        )
        if block.stopped:
            break
        if is_first_iteration:
            generator.add_context(outputs.hidden_states, layout.offset + cur_len, keep=layout.visible)
        else:
            generator.add_context(outputs.hidden_states, n_matches + 1)
        is_first_iteration = False

    if streamer is not None:
        streamer.end()
    stats.new_tokens = input_ids.shape[1] - prompt_len
    stats.total_seconds = time.perf_counter() - loop_start
    if return_dict:
        return GenerateDecoderOnlyOutput(
            sequences=input_ids, scores=emitter.scores, logits=emitter.raw_logits, **{key: model_kwargs.get(key)}
        )
    return input_ids
