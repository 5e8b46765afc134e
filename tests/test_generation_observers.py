"""What logits processors, stopping criteria, streamers and return_dict_in_generate see equals plain decoding, token by
token, also inside long accepted blocks (the Oracle makes the drafts right, so a cycle emits up to B tokens)."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from conftest import Oracle, make_drafter

PROMPT = 8


def _prompt(seed: int = 3) -> torch.LongTensor:
    return torch.randint(6, 96, (1, PROMPT), generator=torch.Generator().manual_seed(seed))


def _both(target, drafter, monkeypatch, make_hooks, **kw):
    """Runs plain and speculative generate() with fresh hooks each; returns ``[(output, hooks), (output, hooks)]``.

    The speculative run drafts plain decoding's own continuation (Oracle), so its cycles accept whole blocks.
    """
    runs = []
    for assistant in (None, drafter):
        hooks = make_hooks()
        if assistant is not None:
            Oracle(reference(runs[0][0]), lambda c: [None, None, 2][c % 3]).install(monkeypatch)
        out = target.generate(_prompt(), do_sample=False, assistant_model=assistant, **hooks[1], **kw)
        runs.append((out, hooks[0]))
    return runs


def reference(output):
    return output.sequences if hasattr(output, "sequences") else output


def stopped_inside_block(stats) -> bool:
    """The last cycle was cut by a stop on one of its accepted drafts (more drafts were verified after it)."""
    return stats.accepted_drafts[-1] == stats.acceptance_lengths[-1] < stats.draft_lengths[-1]


def eos_inside(free: torch.LongTensor, at_least: int) -> tuple[int, int]:
    """``(token, tokens generated up to it)``: the first token ``free`` generates at index >= ``at_least`` for the
    first time (an EOS there stops plain decoding after exactly that many tokens)."""
    new = free[0, PROMPT:].tolist()
    index = next(i for i in range(at_least, len(new)) if new[i] not in new[:i])
    return new[index], index + 1


class ProbabilityStop(StoppingCriteria):
    """Stops once the last token's probability exceeds a threshold (reads ``scores[-1]``, as documented)."""

    def __init__(self, after: int):
        self.after, self.seen = after, []

    def __call__(self, input_ids, scores, **kwargs):
        if scores is None:
            self.seen.append((input_ids.shape[1], None))
            return torch.tensor([len(self.seen) >= self.after])
        top = float(scores[-1].softmax(-1).max())
        self.seen.append((input_ids.shape[1], len(scores), round(top, 5), input_ids[0, -1].item()))
        return torch.tensor([len(self.seen) >= self.after and top > 0.0])


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("output_scores", [True, False])
@pytest.mark.parametrize("after", [3, 9])
def test_stopping_criteria_see_input_ids_and_scores_up_to_each_token(targets, monkeypatch, arch, output_scores, after):
    """Regression (issue 15.1): criteria got the scores tuple of before the cycle, the same for every token."""
    target = targets[arch]
    drafter = make_drafter(target)

    def hooks():
        criterion = ProbabilityStop(after)
        return criterion, dict(stopping_criteria=StoppingCriteriaList([criterion]))

    (ref, plain), (out, ours) = _both(
        target, drafter, monkeypatch, hooks, max_new_tokens=30, return_dict_in_generate=True, output_scores=output_scores
    )
    assert torch.equal(ref.sequences, out.sequences)
    assert ours.seen == plain.seen and len(plain.seen) == after
    assert out.sequences.shape[1] == PROMPT + after
    assert stopped_inside_block(drafter.generation_stats)


class RecordingProcessor(LogitsProcessor):
    """Records every call (the prefix it conditions on) and bans one token, so it really changes the scores."""

    def __init__(self, banned: int):
        self.banned, self.calls = banned, []

    def __call__(self, input_ids, scores):
        self.calls.append(input_ids[0].tolist())
        scores = scores.clone()
        scores[:, self.banned] = -float("inf")
        return scores


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_processors_are_called_exactly_as_in_plain_decoding(targets, monkeypatch, arch):
    """Same prefixes, same order, nothing past a stop inside a block (stateful processors stay right)."""
    target = targets[arch]
    drafter = make_drafter(target)
    banned = int(target.generate(_prompt(), max_new_tokens=5, do_sample=False)[0, PROMPT + 4])
    processed = LogitsProcessorList([RecordingProcessor(banned)])
    eos, _ = eos_inside(target.generate(_prompt(), max_new_tokens=20, do_sample=False, logits_processor=processed), 3)

    def hooks():
        processor = RecordingProcessor(banned)
        return processor, dict(logits_processor=LogitsProcessorList([processor]))

    (ref, plain), (out, ours) = _both(target, drafter, monkeypatch, hooks, max_new_tokens=20, eos_token_id=eos)
    assert torch.equal(ref, out)
    assert ours.calls == plain.calls
    assert stopped_inside_block(drafter.generation_stats)


def test_classifier_free_guidance_processor_stays_exact(targets, monkeypatch):
    """guidance_scale runs its own cached model call per token: it only works if called once per token, in order."""
    target = targets["llama"]
    drafter = make_drafter(target)
    kw = dict(max_new_tokens=14, guidance_scale=1.5, negative_prompt_ids=_prompt(9)[:, :3])
    (ref, _), (out, _) = _both(target, drafter, monkeypatch, lambda: (None, {}), **kw)
    assert torch.equal(ref, out)
    assert max(drafter.generation_stats.acceptance_lengths) > 2


class Recorder(BaseStreamer):
    def __init__(self):
        self.events = []

    def put(self, value):
        self.events.append((tuple(value.shape), value.tolist()))

    def end(self):
        self.events.append("end")


def test_streamer_gets_what_plain_decoding_puts(targets, monkeypatch):
    """The prompt, then one (1,)-shaped tensor per token, then end(): nothing past a stop inside a block."""
    target = targets["gemma3"]
    drafter = make_drafter(target)
    free = target.generate(_prompt(), max_new_tokens=20, do_sample=False)

    def hooks():
        streamer = Recorder()
        return streamer, dict(streamer=streamer)

    (ref, plain), (out, ours) = _both(target, drafter, monkeypatch, hooks, max_new_tokens=20,
                                      eos_token_id=eos_inside(free, 3)[0])
    assert torch.equal(ref, out)
    assert ours.events == plain.events
    assert stopped_inside_block(drafter.generation_stats)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_return_dict_fields_match_plain_with_a_stop_inside_a_block(targets, monkeypatch, arch):
    target = targets[arch]
    drafter = make_drafter(target)
    free = target.generate(_prompt(), max_new_tokens=20, do_sample=False)
    eos, length = eos_inside(free, 3)
    kw = dict(max_new_tokens=20, eos_token_id=eos, return_dict_in_generate=True, output_scores=True, output_logits=True)
    (ref, _), (out, _) = _both(target, drafter, monkeypatch, lambda: (None, {}), **kw)
    assert stopped_inside_block(drafter.generation_stats)
    assert set(ref.keys()) == set(out.keys())
    assert torch.equal(ref.sequences, out.sequences)
    assert len(ref.scores) == len(out.scores) == len(ref.logits) == len(out.logits) == length
    for a, b in zip(ref.scores + ref.logits, out.scores + out.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    key = next(k for k in ("cache", "past_key_values") if k in ref)  # transformers 5.24 / 5.23
    cache_ref, cache_out = ref[key], out[key]  # every token but the last, as in plain decoding
    assert cache_ref.get_seq_length() == cache_out.get_seq_length() == PROMPT + length - 1
    for a, b in zip(cache_ref.layers, cache_out.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(a.values, b.values, rtol=1e-4, atol=1e-4)


def test_sampling_shows_each_token_once_with_its_scores(targets):
    """Sampling cannot be compared token for token, but each emitted token is processed once, in order, and each
    criterion call sees the scores of exactly the tokens emitted so far (the ones returned)."""
    target = targets["qwen3"]
    drafter = make_drafter(target)
    torch.manual_seed(0)
    processor, criterion = RecordingProcessor(banned=7), ProbabilityStop(after=25)
    out = target.generate(
        _prompt(), assistant_model=drafter, do_sample=True, max_new_tokens=25, return_dict_in_generate=True,
        output_scores=True, logits_processor=LogitsProcessorList([processor]),
        stopping_criteria=StoppingCriteriaList([criterion]),
    )
    tokens = out.sequences[0].tolist()
    assert processor.calls == [tokens[:n] for n in range(PROMPT, len(tokens))]
    assert [s[:2] for s in criterion.seen] == [(n, n - PROMPT) for n in range(PROMPT + 1, len(tokens) + 1)]
    assert [s[3] for s in criterion.seen] == tokens[PROMPT:]
    tops = [round(float(s.softmax(-1).max()), 5) for s in out.scores]
    assert [s[2] for s in criterion.seen] == tops
