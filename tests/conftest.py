"""Shared fixtures: tiny random targets of three architectures, drafters sized for them, an oracle drafter (no downloads)."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import dflash2_hf  # noqa: F401  (registers the routing)
from dflash2_hf import DFlash2DraftModel

torch.set_num_threads(1)

EOS = 5
COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    eos_token_id=EOS,
    pad_token_id=0,
    bos_token_id=1,
)


def make_target(arch: str, seed: int = 0, **overrides):
    """A tiny random target; Gemma3 gets a sliding window of 8 so window roll-back is exercised."""
    torch.manual_seed(seed)
    kw = {**COMMON, **overrides}
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**kw))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **kw))
    elif arch == "gemma3":
        model = Gemma3ForCausalLM(Gemma3TextConfig(head_dim=16, sliding_window=8, **kw))
    else:
        raise ValueError(arch)
    # sharpen the random target so greedy continuations are not all one repeated token
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)
    return model.eval()


def make_drafter(target, seed: int = 1, **overrides):
    torch.manual_seed(seed)
    kw = dict(num_hidden_layers=2, block_size=6, selector_rank=16, selector_top_k=8)
    kw.update(overrides)
    drafter = DFlash2DraftModel.from_target(target, **kw).eval()
    return drafter


def randomize_selector(drafter, seed: int = 2, scale: float = 3.0):
    """Gives the selector non-trivial codebooks so its path differs from the top-1 path."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        sel = drafter.candidate_selector
        sel.successor_codebook.copy_(torch.randn(sel.successor_codebook.shape, generator=g) * scale)
        sel.hidden_projection.weight.copy_(torch.randn(sel.hidden_projection.weight.shape, generator=g))
    return drafter


def randomize_convs(drafter, seed: int = 3):
    """Moves the convolutions away from the identity so they really mix positions."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in drafter.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.add_(torch.randn(conv.base_kernel.shape, generator=g) * 0.3)
                conv.kernel_projection.weight.copy_(torch.randn(conv.kernel_projection.weight.shape, generator=g) * 0.05)
    return drafter


class Oracle:
    """Replaces the drafter's path by the target's true greedy continuation, wrong at chosen draft slots.

    Exercises long accepted blocks on random tiny models (a random drafter almost never guesses right). The real
    drafter still runs, so its cache bookkeeping is exercised too.
    """

    def __init__(self, reference: torch.LongTensor, wrong_slot_per_cycle=lambda cycle: None):
        self.reference = reference[0]  # plain generate()'s output of the same call (aligned with the loop's input_ids)
        self.wrong = wrong_slot_per_cycle  # cycle index -> slot (0-based) to corrupt, or None
        self.cycle = 0

    def install(self, monkeypatch):
        from dflash2_hf.generation import candidate_generator as cg

        original = cg.DFlash2CandidateGenerator.propose
        oracle = self

        def propose(gen, input_ids, num_drafts):
            proposal = original(gen, input_ids, num_drafts)
            start = input_ids.shape[1]
            truth = oracle.reference[start : start + num_drafts].clone()
            if truth.numel() < num_drafts:  # past the reference's end: anything
                truth = torch.cat([truth, torch.full((num_drafts - truth.numel(),), 7, device=truth.device)])
            slot = oracle.wrong(oracle.cycle)
            if slot is not None and slot < num_drafts:
                truth[slot] = (truth[slot] + 1) % 90 + 6
            oracle.cycle += 1
            proposal.tokens = truth[None]
            return proposal

        monkeypatch.setattr(cg.DFlash2CandidateGenerator, "propose", propose)


def make_near_tie_target(seed: int = 0, eps: float = 3e-3, dtype: torch.dtype = torch.bfloat16):
    """A tiny llama whose LM-head rows come in near-identical twins (row 2i+1 = row 2i + eps * noise): at every step
    plain greedy's top two tokens are a twin pair within a few bf16 ulps, so a block verification in bf16 (rounded
    differently from one token at a time) parts from plain greedy at near-ties, and only there."""
    target = make_target("llama", seed=seed)
    with torch.no_grad():
        weight = target.get_output_embeddings().weight
        g = torch.Generator().manual_seed(seed)
        weight[1::2] = weight[0::2] + eps * torch.randn(weight[1::2].shape, generator=g)
    return target.to(dtype)


@pytest.fixture(scope="session")
def targets():
    return {arch: make_target(arch) for arch in ("llama", "qwen3", "gemma3")}
