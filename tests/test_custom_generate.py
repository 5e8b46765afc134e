"""The public, patch-free path: ``generate(..., custom_generate=dflash2_generate, drafter=draft)`` gives what
``generate(..., assistant_model=draft)`` gives, on every target family the suite covers; the private routing
degrades to a message naming it (issue 40)."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers.generation.utils import GenerationMixin

from dflash2_hf import DFlash2DraftModel, UnsupportedGenerationError, UnsupportedTransformersVersionError, dflash2_generate
from dflash2_hf.generation import routing
from conftest import Oracle, make_drafter, make_target, randomize_selector
from test_target_families import FAMILIES, tiny_target

KW = dict(max_new_tokens=24, do_sample=False, use_cache=True)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_public_path_is_greedy_identical_on_every_family(family, monkeypatch):
    target = tiny_target(family)
    drafter = DFlash2DraftModel.from_target(target, num_hidden_layers=2, block_size=6, selector_rank=16, selector_top_k=8)
    ids = torch.randint(6, 96, (1, 9), generator=torch.Generator().manual_seed(0))
    ref = target.generate(ids, **KW)
    with monkeypatch.context() as patch:  # long accepted blocks, one wrong slot now and then
        Oracle(ref, lambda c: [None, 3, None, 1][c % 4]).install(patch)
        out = target.generate(ids, custom_generate=dflash2_generate, drafter=drafter, **KW)
    assert torch.equal(ref, out), family
    public = drafter.generation_stats.acceptance_lengths
    assert drafter.config.block_size in public  # a whole block accepted: the DFlash2 loop ran, not plain decoding
    with monkeypatch.context() as patch:
        Oracle(ref, lambda c: [None, 3, None, 1][c % 4]).install(patch)
        assert torch.equal(ref, target.generate(ids, assistant_model=drafter, **KW))
    assert drafter.generation_stats.acceptance_lengths == public  # the same cycles as the routed path


def test_public_path_samples_as_the_routed_path():
    target = make_target("llama")
    drafter = randomize_selector(make_drafter(target))
    ids = torch.tensor([[7, 8, 9, 10]])
    kw = dict(max_new_tokens=20, do_sample=True, temperature=0.8, top_p=0.9)
    torch.manual_seed(3)
    routed = target.generate(ids, assistant_model=drafter, **kw)
    torch.manual_seed(3)
    public = target.generate(ids, custom_generate=dflash2_generate, drafter=drafter, **kw)
    assert torch.equal(routed, public)



def test_public_path_streamer_and_return_dict():
    target = make_target("llama")
    drafter = make_drafter(target)
    ids = torch.tensor([[7, 8, 9, 10]])

    class Collect:
        def __init__(self):
            self.tokens = []

        def put(self, value):
            self.tokens.extend(value.reshape(-1).tolist())

        def end(self):
            self.tokens.append("end")

    streamer = Collect()
    out = target.generate(ids, custom_generate=dflash2_generate, drafter=drafter, token_streamer=streamer,
                          return_dict_in_generate=True, output_scores=True, **KW)
    assert streamer.tokens[-1] == "end" and streamer.tokens[:-1] == out.sequences[0].tolist()
    assert len(out.scores) == out.sequences.shape[1] - ids.shape[1]


def test_public_path_needs_the_drafter_by_name():
    target = make_target("llama")
    drafter = make_drafter(target)
    ids = torch.tensor([[7, 8, 9, 10]])
    with pytest.raises(UnsupportedGenerationError, match="needs drafter=.*does not forward assistant_model"):
        target.generate(ids, custom_generate=dflash2_generate, assistant_model=drafter, max_new_tokens=4)
    with pytest.raises(UnsupportedGenerationError, match="num_beams=2"):
        target.generate(ids, custom_generate=dflash2_generate, drafter=drafter, num_beams=2, max_new_tokens=4)


def test_untested_transformers_names_the_public_path():
    with pytest.raises(UnsupportedTransformersVersionError, match="custom_generate=dflash2_hf.dflash2_generate"):
        routing.check_transformers_version("5.30.0")


def test_routing_degrades_without_the_private_method(monkeypatch):
    monkeypatch.delattr(GenerationMixin, "_assisted_decoding")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        routing.install()  # no AttributeError: a warning that names the public path
    assert any("custom_generate=dflash2_hf.dflash2_generate" in str(w.message) for w in caught)
