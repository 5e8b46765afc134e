"""from_target serves every causal-LM family (or says clearly what it lacks), and decoding stays lossless for each:
rotary, absolute learned positions (GPT-2, OPT, GPT-Neo), ALiBi (Bloom, Falcon-ALiBi, MPT), sliding windows."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers as tf
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from dflash2_hf import DFlash2Config, DFlash2DraftModel, TargetConfigError, UnsupportedGenerationError
from dflash2_hf.target_config import drafter_sizes, lookup, text_config
from conftest import Oracle

IDS = dict(vocab_size=96, eos_token_id=5, bos_token_id=1, pad_token_id=0)
LLAMA_LIKE = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=6, intermediate_size=128, **IDS)
GQA = dict(LLAMA_LIKE, num_key_value_heads=2)
FAMILIES = {
    "llama": (tf.LlamaConfig, GQA),
    "qwen3": (tf.Qwen3Config, dict(GQA, head_dim=16)),
    "gemma3": (tf.Gemma3TextConfig, dict(GQA, head_dim=16, sliding_window=8)),
    "mistral": (tf.MistralConfig, dict(GQA, sliding_window=8)),
    "phi3": (tf.Phi3Config, dict(GQA, max_position_embeddings=512)),
    "qwen2": (tf.Qwen2Config, GQA),
    "gemma2": (tf.Gemma2Config, dict(GQA, head_dim=16, sliding_window=8)),
    "starcoder2": (tf.Starcoder2Config, GQA),
    "stablelm": (tf.StableLmConfig, GQA),
    "olmo": (tf.OlmoConfig, LLAMA_LIKE),
    "cohere": (tf.CohereConfig, LLAMA_LIKE),
    "phi": (tf.PhiConfig, LLAMA_LIKE),
    "gpt_neox": (tf.GPTNeoXConfig, LLAMA_LIKE),
    "gpt2": (tf.GPT2Config, dict(n_embd=64, n_head=4, n_layer=6, n_positions=256, **IDS)),
    "opt": (tf.OPTConfig, dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=6, ffn_dim=128,
                               word_embed_proj_dim=64, max_position_embeddings=256, **IDS)),
    "falcon": (tf.FalconConfig, dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=6, **IDS)),
    "falcon_alibi": (tf.FalconConfig, dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=6, alibi=True, **IDS)),
    "bloom": (tf.BloomConfig, dict(hidden_size=64, n_head=4, n_layer=6, **IDS)),
    "mpt": (tf.MptConfig, dict(d_model=64, n_heads=4, n_layers=6, **IDS)),
    "gptj": (tf.GPTJConfig, dict(n_embd=64, n_head=4, n_layer=6, rotary_dim=8, **IDS)),
    "codegen": (tf.CodeGenConfig, dict(n_embd=64, n_head=4, n_layer=6, rotary_dim=8, **IDS)),
    "gpt_bigcode": (tf.GPTBigCodeConfig, dict(n_embd=64, n_head=4, n_layer=6, **IDS)),
    "gpt_neo": (tf.GPTNeoConfig, dict(hidden_size=64, num_heads=4, num_layers=6, window_size=8, max_position_embeddings=256,
                                      attention_types=[[["global", "local"], 3]], **IDS)),
}


def tiny_target(family: str):
    config_class, kwargs = FAMILIES[family]
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config_class(**kwargs)).eval()
    with torch.no_grad():  # sharpen the random target so greedy continuations vary
        model.get_output_embeddings().weight.mul_(4.0)
    model.generation_config.eos_token_id = None  # run to max_new_tokens: every cycle has a whole block to accept
    return model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_identity_through_from_target(family, monkeypatch):
    """Plain greedy == speculative greedy with a fresh from_target drafter, then with long accepted blocks."""
    target = tiny_target(family)
    drafter = DFlash2DraftModel.from_target(target, num_hidden_layers=2, block_size=6, selector_rank=16, selector_top_k=8)
    assert drafter.config.num_target_layers == 6 and drafter.config.vocab_size == 96
    kw = dict(max_new_tokens=24, do_sample=False, use_cache=True)  # MPT's config defaults to use_cache=False
    for seed in range(2):
        ids = torch.randint(6, 96, (1, 7 + 5 * seed), generator=torch.Generator().manual_seed(seed))
        ref = target.generate(ids, **kw)
        assert torch.equal(ref, target.generate(ids, assistant_model=drafter, **kw)), (family, seed, "random drafter")
        with monkeypatch.context() as patch:
            Oracle(ref, lambda c: [None, 3, None, 1][c % 4]).install(patch)
            assert torch.equal(ref, target.generate(ids, assistant_model=drafter, **kw)), (family, seed, "oracle")
        assert drafter.config.block_size in drafter.generation_stats.acceptance_lengths  # a whole block accepted


@pytest.mark.parametrize(
    "family,expected",
    [
        ("gpt2", dict(intermediate_size=256, max_position_embeddings=256, hidden_act="gelu_new", rms_norm_eps=1e-5)),
        ("opt", dict(intermediate_size=128, max_position_embeddings=256)),
        ("falcon", dict(intermediate_size=256, max_position_embeddings=2048)),
        ("bloom", dict(intermediate_size=256, max_position_embeddings=8192)),
        ("mpt", dict(intermediate_size=256, max_position_embeddings=2048)),
    ],
)
def test_from_target_reads_each_architectures_names(family, expected):
    """Regression (issue 15.3): GPT-2/OPT/Falcon/Bloom configs have no intermediate_size / max_position_embeddings."""
    drafter = DFlash2DraftModel.from_target(tiny_target(family), num_hidden_layers=2)
    config = drafter.config
    assert (config.hidden_size, config.target_hidden_size, config.num_target_layers) == (64, 64, 6)
    assert (config.num_attention_heads, config.head_dim) == (4, 16)
    assert {key: getattr(config, key) for key in expected} == pytest.approx(expected)


def test_overrides_win_over_the_targets_config():
    target = tiny_target("gpt2")
    drafter = DFlash2DraftModel.from_target(
        target, num_hidden_layers=2, intermediate_size=40, max_position_embeddings=99, num_attention_heads=2
    )
    config = drafter.config
    assert (config.intermediate_size, config.max_position_embeddings) == (40, 99)
    assert (config.num_attention_heads, config.head_dim, config.num_key_value_heads) == (2, 32, 2)  # derived from 2


def test_a_missing_size_is_named_with_its_override():
    config = tf.MambaConfig(hidden_size=64, num_hidden_layers=6, vocab_size=96)  # no attention heads at all
    with pytest.raises(TargetConfigError, match=r"MambaConfig.*num_attention_heads.*from_target\(target, num_attention_heads="):
        drafter_sizes(config, 64)
    assert drafter_sizes(config, 64, {"num_attention_heads": 4})["head_dim"] == 16
    with pytest.raises(TargetConfigError, match="SimpleNamespace.*num_target_layers"):
        drafter_sizes(SimpleNamespace(hidden_size=64, num_attention_heads=4), 64)
    with pytest.raises(TargetConfigError, match="not divisible by 5 attention heads.*head_dim="):
        drafter_sizes(SimpleNamespace(hidden_size=64, num_attention_heads=5, num_hidden_layers=6), 64)


def test_stateful_targets_are_refused_up_front():
    torch.manual_seed(0)
    mamba = tf.MambaForCausalLM(tf.MambaConfig(hidden_size=32, num_hidden_layers=2, vocab_size=96, state_size=4))
    with pytest.raises(UnsupportedGenerationError, match=r"MambaForCausalLM is a stateful.*Mamba, RWKV.*cannot be "
                                                         "served by assisted decoding"):
        DFlash2DraftModel.from_target(mamba, num_attention_heads=4)


def test_every_causal_lm_config_gets_drafter_sizes_or_a_clear_error():
    """All of transformers' causal-LM families, at their default configs: sizes a DFlash2Config accepts, or a
    TargetConfigError naming the field (recurrent models without attention heads, ...)."""
    outcomes = {"ok": [], "named": []}
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        try:
            config = text_config(CONFIG_MAPPING[model_type]())
        except Exception:  # noqa: BLE001 - a few default configs do not construct at all (not our concern)
            continue
        hidden = lookup(config, "target_hidden_size") or 64
        try:
            DFlash2Config(vocab_size=100, hidden_size=hidden, **drafter_sizes(config, hidden, {"target_layer_ids": [0]}))
            outcomes["ok"].append(model_type)
        except TargetConfigError as error:
            assert "from_target(target," in str(error), model_type
            outcomes["named"].append(model_type)
    assert len(outcomes["ok"]) > 150 and {"gpt2", "opt", "falcon", "bloom", "mpt", "llama"} <= set(outcomes["ok"])
    assert {"mamba", "rwkv"} <= set(outcomes["named"])


def test_lm_head_of_another_width_is_refused():
    target = tiny_target("opt")
    target.lm_head = torch.nn.Linear(32, 96, bias=False)  # as if OPT projected 64 -> 32 before its LM head
    with pytest.raises(TargetConfigError, match="LM head reads width 32 but its embeddings have width 64"):
        DFlash2DraftModel.from_target(target)
