"""Published DFlash / DFlash2 config variants draft as the reference semantics say (DESIGN.md section 6, issue 14).

Every folder here is written by the test itself the way the reference code's authors write theirs (a Qwen3 config
with a nested ``dflash_config``, none of our own fields), then loaded as a new user would: ``from_pretrained``.
Checked per variant: the loaded config, the rotary embedding against ``transformers``' own ``Qwen3RotaryEmbedding``
of the same config (what the reference builds), every layer's attention against a naive masked attention written
here, cached drafting against a from-scratch recomputation (rollback across the window edge), greedy identity with
plain ``generate()`` in fp32 (prompts longer than the window), and training.
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from conftest import make_drafter, randomize_convs, randomize_selector
from dflash2_hf import CheckpointError, DFlash2Config, DFlash2DraftModel
from dflash2_hf.masking import LayerAttention, drafter_cache, parse_layer_types
from dflash2_hf.published import published_target_layer_ids

S, FULL = "sliding_attention", "full_attention"
W = 4  # the window: shorter than the block (6) and than most prompts


def _base(target, **overrides):
    d = make_drafter(target, **overrides)
    return randomize_convs(randomize_selector(d) if d.candidate_selector is not None else d)


def _published(c: DFlash2Config, dflash: dict | None = None, **top) -> dict:
    """A config as the reference code writes it; ``top`` keys override (None removes), ``dflash`` adds."""
    d = {
        "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim, "vocab_size": c.vocab_size, "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": 512, "num_target_layers": c.num_target_layers, "tie_word_embeddings": False,
        "hidden_act": "silu", "rope_theta": 1e6, "torch_dtype": "float32", "transformers_version": "4.57.1",
        "dflash_config": {"block_size": c.block_size, "mask_token_id": c.mask_token_id,
                          "target_layer_ids": list(c.target_layer_ids), "conv_kernel_size": c.conv_kernel_size,
                          "conv_group_size": c.conv_group_size, "selector_rank": c.selector_rank,
                          "selector_top_k": c.selector_top_k, **(dflash or {})},
    }
    d.update(top)
    return {k: v for k, v in d.items() if v is not None}


def _write(path, drafter, config: dict):
    path.mkdir(parents=True, exist_ok=True)
    weights = {k: v.contiguous() for k, v in drafter.state_dict().items() if not k.startswith("rotary_emb")}
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))
    return path


def _load(tmp_path, drafter, config: dict, name="folder"):
    return DFlash2DraftModel.from_pretrained(_write(tmp_path / name, drafter, config)).eval()


# ---------------------------------------------------------------------------------------------------------- rope
ROPE_CASES = {
    "legacy_theta": ({"rope_theta": 1e6}, {"rope_type": "default", "rope_theta": 1e6}),
    "linear": ({"rope_scaling": {"type": "linear", "factor": 2.0}},
               {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}),
    "dynamic": ({"rope_scaling": {"type": "dynamic", "factor": 2.0}},
                {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}),
    "yarn": ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}},
             {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "rope_theta": 1e6}),
    "llama3": ({"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 128}},
               {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}),
    "rope_parameters": ({"rope_theta": None, "rope_parameters": {"rope_type": "default", "rope_theta": 2e5}},
                        {"rope_type": "default", "rope_theta": 2e5}),
    "none": ({"rope_theta": None}, {"rope_type": "default", "rope_theta": 10000.0}),  # Qwen3Config's default
}


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rope_variants_match_transformers_qwen3_rotary(targets, tmp_path, case):
    top, expected = ROPE_CASES[case]
    drafter = _base(targets["qwen3"])
    config = _published(drafter.config, **top)
    loaded = _load(tmp_path, drafter, config)
    rope = loaded.config.rope_parameters
    assert {k: rope.get(k) for k in expected} == expected
    saved = json.loads(loaded.config.to_json_string())
    assert "rope_theta" not in saved and saved["rope_parameters"] == rope  # ours records the standard form only
    # the 4.x `torch_dtype`, read as transformers reads it
    assert DFlash2Config.from_dict({**config, "torch_dtype": "bfloat16"}).dtype == torch.bfloat16
    # the rotary the reference builds: transformers' Qwen3RotaryEmbedding of the same config.json
    reference = Qwen3RotaryEmbedding(Qwen3Config.from_dict(config))
    x = torch.zeros(1, 1, loaded.config.head_dim)
    for positions in (torch.arange(0, 40)[None], torch.arange(600, 700)[None]):  # past 512: dynamic rescales
        for ours, theirs in zip(loaded.rotary_emb(x, positions), reference(x, positions)):
            torch.testing.assert_close(ours, theirs)


def test_legacy_rope_keys_in_our_own_config():
    config = DFlash2Config(rope_theta=1e6, rope_scaling={"type": "yarn", "factor": 2.0,
                                                         "original_max_position_embeddings": 1024})
    assert config.rope_parameters["rope_type"] == "yarn" and config.rope_parameters["rope_theta"] == 1e6
    assert DFlash2Config(rope_theta=5e5).rope_parameters == {"rope_type": "default", "rope_theta": 5e5}
    assert DFlash2Config().rope_parameters == {"rope_type": "default", "rope_theta": 100000.0}


# ----------------------------------------------------------------------------------------------------- attention
ATTENTION_CASES = {
    "sliding_causal": ({"layer_types": [S, S], "use_sliding_window": True, "sliding_window": W}, None,
                       [LayerAttention(True, W)] * 2),
    "sliding_bidirectional": ({"layer_types": [S, S], "use_sliding_window": True, "sliding_window": W,
                               "is_causal": False}, None, [LayerAttention(False, W)] * 2),
    "mixed": ({"layer_types": [S, FULL], "use_sliding_window": True, "sliding_window": W}, None,
              [LayerAttention(True, W), LayerAttention(False, None)]),
    "causal_full": ({"is_causal": True}, None, [LayerAttention(True, None)] * 2),
    "vllm_causal": ({}, {"causal": True}, [LayerAttention(True, None)] * 2),
    # no layer_types: Qwen3Config derives them (layers >= max_window_layers slide)
    "derived": ({"use_sliding_window": True, "sliding_window": W, "max_window_layers": 1}, None,
                [LayerAttention(False, None), LayerAttention(True, W)]),
    # use_sliding_window false: Qwen3Config drops the window, the sliding layers stay causal
    "sliding_no_window": ({"layer_types": [S, S], "use_sliding_window": False, "sliding_window": W}, None,
                          [LayerAttention(True, None)] * 2),
    "full": ({"layer_types": [FULL, FULL], "use_sliding_window": False}, None, [LayerAttention(False, None)] * 2),
}


def _visible(q: int, k: int, rule: LayerAttention) -> bool:
    """DESIGN.md section 6, literally."""
    w = rule.window
    return (not rule.causal or k <= q) and (w is None or q - k < w) and (rule.causal or w is None or k - q < w)


def _naive_attention(q, k, v, q_pos, k_pos, rule, scale):
    """Softmax attention over the visible keys only, one query and one head at a time."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = torch.zeros_like(q)
    for h in range(q.shape[1]):
        for i, qp in enumerate(q_pos):
            keep = [j for j, kp in enumerate(k_pos) if _visible(qp, kp, rule)]
            weights = torch.softmax((k[0, h, keep] @ q[0, h, i]) * scale, dim=0)
            out[0, h, i] = weights @ v[0, h, keep]
    return out


def _record_attention(monkeypatch):
    calls = []
    sdpa = F.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, scale=None, enable_gqa=False, **kw):
        out = sdpa(q, k, v, attn_mask=attn_mask, scale=scale, enable_gqa=enable_gqa, **kw)
        calls.append((q, k, v, attn_mask, scale, out))
        return out

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    return calls


def _ctx(drafter, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, n, drafter.fc.in_features, generator=g)


def _block(drafter, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, drafter.config.block_size, drafter.config.hidden_size, generator=g)


@pytest.mark.parametrize("case", sorted(ATTENTION_CASES))
def test_attention_variants_match_naive_masked_attention(targets, tmp_path, monkeypatch, case):
    top, dflash, rules = ATTENTION_CASES[case]
    drafter = _base(targets["qwen3"])
    loaded = _load(tmp_path, drafter, _published(drafter.config, dflash=dflash, **top))
    assert loaded.layer_rules == rules
    B = loaded.config.block_size
    calls = _record_attention(monkeypatch)
    with torch.no_grad():
        # one pass over 10 context positions + the block, then the same split over a cache: 7, then 3 + the block
        loaded(_block(loaded, 0), _ctx(loaded, 10, 1), position_ids=torch.arange(10 + B)[None])
        cache = drafter_cache(loaded.config)
        loaded(_block(loaded, 2), _ctx(loaded, 10, 1)[:, :7], position_ids=torch.arange(7 + B)[None], cache=cache)
        cache.crop(-B)
        calls.clear()
        loaded(_block(loaded, 0), _ctx(loaded, 10, 1)[:, 7:], position_ids=torch.arange(7, 10 + B)[None], cache=cache)
    assert len(calls) == loaded.config.num_hidden_layers
    total = 10 + B
    for layer, (q, k, v, mask, scale, out) in enumerate(calls):
        rule = rules[layer]
        k_pos = list(range(total))[-k.shape[2]:]  # a windowed cache keeps only its last keys...
        dropped = range(total - k.shape[2])
        assert not any(_visible(qp, kp, rule) for qp in range(10, total) for kp in dropped)  # ...never a visible one
        expected = torch.tensor([[_visible(qp, kp, rule) for kp in k_pos] for qp in range(10, total)])
        assert torch.equal(mask[0, 0] if mask is not None else torch.ones_like(expected), expected), layer
        torch.testing.assert_close(out, _naive_attention(q, k, v, range(10, total), k_pos, rule, scale))


@pytest.mark.parametrize("case", ["sliding_bidirectional", "mixed", "sliding_causal"])
def test_cached_drafting_equals_recomputation_across_the_window_edge(targets, tmp_path, case):
    top, dflash, _ = ATTENTION_CASES[case]
    drafter = _base(targets["qwen3"])
    loaded = _load(tmp_path, drafter, _published(drafter.config, dflash=dflash, **top))
    B = loaded.config.block_size
    cache, seen = drafter_cache(loaded.config), 0
    context = _ctx(loaded, 40, 5)
    with torch.no_grad():
        for step, new in enumerate([3, 1, 5, 2, 6, 1, 4, 7]):  # accepted lengths straddling the window of 4
            block = _block(loaded, step)
            pos = torch.arange(seen, seen + new + B)[None]
            cached = loaded(block, context[:, seen: seen + new], position_ids=pos, cache=cache).last_hidden_state
            cache.crop(-B)
            seen += new
            fresh = loaded(block, context[:, :seen], position_ids=torch.arange(seen + B)[None]).last_hidden_state
            torch.testing.assert_close(cached, fresh, rtol=1e-5, atol=1e-5)
            assert cache.get_seq_length() == seen


class _Recompute:
    """Wraps a drafter's forward: every cached call must equal a from-scratch pass over the whole context."""

    def __init__(self, drafter):
        self.original, self.context, self.checked = drafter.forward, [], 0
        drafter.forward = self

    def __call__(self, noise_embeds, context_hidden_states=None, position_ids=None, **kwargs):
        out = self.original(noise_embeds, context_hidden_states, position_ids=position_ids, **kwargs)
        self.context.append(context_hidden_states)
        ctx = torch.cat(self.context, dim=1)
        if position_ids[0, 0] == 0 and ctx.shape[1] == position_ids.shape[1] - noise_embeds.shape[1]:
            fresh = self.original(noise_embeds, ctx, position_ids=torch.arange(position_ids.shape[1])[None])
        else:
            anchor = int(position_ids[0, -noise_embeds.shape[1]])
            fresh = self.original(noise_embeds, ctx[:, :anchor],
                                  position_ids=torch.arange(anchor + noise_embeds.shape[1])[None])
            self.context = [ctx[:, :anchor]]
        torch.testing.assert_close(out.last_hidden_state, fresh.last_hidden_state, rtol=1e-4, atol=1e-4)
        self.checked += 1
        return out


@pytest.mark.parametrize("case", sorted(ATTENTION_CASES))
def test_greedy_identity_and_drafts_for_prompts_longer_than_the_window(targets, tmp_path, case):
    top, dflash, _ = ATTENTION_CASES[case]
    target = targets["qwen3"]
    drafter = _base(target)
    loaded = _load(tmp_path, drafter, _published(drafter.config, dflash=dflash, **top))
    check = _Recompute(loaded)
    g = torch.Generator().manual_seed(3)
    for length in (3, 9, 20):
        ids = torch.randint(6, 96, (1, length), generator=g)
        ref = target.generate(ids, max_new_tokens=16, do_sample=False)
        check.context = []
        assert torch.equal(target.generate(ids, assistant_model=loaded, max_new_tokens=16, do_sample=False), ref)
    assert check.checked >= 6


def test_builtin_dflash_path_with_a_windowed_drafter(targets, tmp_path):
    top, _, _ = ATTENTION_CASES["sliding_bidirectional"]
    target = targets["qwen3"]
    drafter = _base(target, use_candidate_selector=False)
    loaded = _load(tmp_path, drafter, _published(drafter.config, **top) | {
        "dflash_config": {k: v for k, v in _published(drafter.config)["dflash_config"].items()
                          if not k.startswith("selector")}})
    ids = torch.randint(6, 96, (1, 11), generator=torch.Generator().manual_seed(4))
    ref = target.generate(ids, max_new_tokens=14, do_sample=False)
    out = target.generate(ids, assistant_model=loaded, max_new_tokens=14, do_sample=False, speculation_type="dflash")
    assert torch.equal(out, ref)


# ---------------------------------------------------------------------------------------------- target_layer_ids
def test_reference_default_target_layer_ids():
    assert published_target_layer_ids(52, 5) == [1, 13, 25, 37, 49]  # the reference's DFlash2 fixture
    assert published_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert published_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]
    assert published_target_layer_ids(6, 5) == [1, 2, 2, 2, 3]  # duplicates kept
    assert published_target_layer_ids(30, 1) == [15] and published_target_layer_ids(6, 1) == [3]


@pytest.mark.parametrize("layers,expected", [(1, [3]), (5, [1, 2, 2, 2, 3])])
def test_config_without_target_layer_ids_uses_the_reference_rule(targets, tmp_path, layers, expected):
    target = targets["qwen3"]
    drafter = _base(target, num_hidden_layers=layers, target_layer_ids=expected)
    config = _published(drafter.config)
    del config["dflash_config"]["target_layer_ids"]
    loaded = _load(tmp_path, drafter, config)
    assert loaded.config.target_layer_ids == expected
    saved = json.loads(loaded.config.to_json_string())
    assert saved["target_layer_ids"] == expected  # recorded in every config we write
    ids = torch.randint(6, 96, (1, 9), generator=torch.Generator().manual_seed(1))
    ref = target.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(target.generate(ids, assistant_model=loaded, max_new_tokens=12, do_sample=False), ref)


# --------------------------------------------------------------------------------------- our formats round trip
def test_attention_layout_round_trips_and_reads_the_same_in_qwen3config(targets, tmp_path):
    drafter = _base(targets["qwen3"], layer_types=[S, FULL], sliding_window=W, is_causal=False)
    assert drafter.layer_rules == [LayerAttention(False, W), LayerAttention(False, None)]
    drafter.save_pretrained(tmp_path / "ours")
    drafter.save_pretrained_published(tmp_path / "published")
    published = json.loads((tmp_path / "published" / "config.json").read_text())
    qwen = Qwen3Config.from_dict(published)  # how the reference reads what we publish
    assert (qwen.layer_types, qwen.sliding_window, published["is_causal"]) == ([S, FULL], W, False)
    block, ctx = _block(drafter, 0), _ctx(drafter, 12, 1)
    with torch.no_grad():
        ref = drafter(block, ctx).last_hidden_state
        for folder in ("ours", "published"):
            loaded = DFlash2DraftModel.from_pretrained(tmp_path / folder)
            assert loaded.layer_rules == drafter.layer_rules
            torch.testing.assert_close(loaded(block, ctx).last_hidden_state, ref)


# ----------------------------------------------------------------------------------------------------- training
@pytest.mark.parametrize("case", ["sliding_bidirectional", "mixed", "causal_full"])
def test_training_block_mask_combines_with_the_layer_rules(tmp_path, case):
    from test_training import B, _items, _records, _target

    from dflash2_hf.training import BlockCollator

    top, dflash, rules = ATTENTION_CASES[case]
    target = _target()
    drafter = _base(target, block_size=B)
    loaded = _load(tmp_path, drafter, _published(drafter.config, dflash=dflash, **top))
    assert loaded.layer_rules == rules
    items = _items(target, loaded, _records(3, seed=5))
    batch = BlockCollator(block_size=B, mask_token_id=loaded.config.mask_token_id, num_blocks=6, seed=0)(items)
    embeds = loaded.embed_block(batch["block_input_ids"], target.get_input_embeddings().weight)
    with torch.no_grad():
        multi = loaded(embeds, batch["context_hidden_states"], position_ids=batch["position_ids"],
                       attention_mask=batch["attention_mask"]).last_hidden_state
        checked = 0
        for r in range(len(items)):
            for j, a in enumerate(batch["anchors"][r].tolist()):
                if a >= 0:  # each block of the batch = the single-block inference pass at its anchor
                    single = loaded(embeds[r: r + 1, j * B: (j + 1) * B], items[r]["context_hidden_states"][None, :a],
                                    position_ids=torch.arange(a + B)[None]).last_hidden_state
                    torch.testing.assert_close(multi[r: r + 1, j * B: (j + 1) * B], single, rtol=1e-5, atol=1e-5)
                    checked += 1
    assert checked >= 12


def test_training_runs_on_a_windowed_published_drafter(tmp_path):
    from test_training import B, _records, _target, _trainer

    target = _target()
    drafter = _base(target, block_size=B)
    top, _, _ = ATTENTION_CASES["mixed"]
    loaded = _load(tmp_path, drafter, _published(drafter.config, **top)).train()
    before = {k: v.detach().clone() for k, v in loaded.named_parameters()}
    trainer = _trainer(target, tmp_path / "run", loaded, _records(3, seed=2), tmp_path / "feat", max_steps=3)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert any(not torch.equal(v, before[k]) for k, v in loaded.named_parameters())
    trainer.save_model(str(tmp_path / "run"))
    assert DFlash2DraftModel.from_pretrained(tmp_path / "run").layer_rules == loaded.layer_rules


# ------------------------------------------------------------------------------------------------- CLI choices
def test_train_cli_chooses_the_attention_layout(targets):
    from dflash2_hf.cli.train import add_arguments
    from dflash2_hf.training.build import attention_overrides

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--data", "d", "--output-dir", "o", "--num-layers", "2", "--layer-types", "sliding,full",
                              "--sliding-window", "64", "--causal", "no"])
    overrides = attention_overrides(args)
    assert overrides == {"layer_types": [S, FULL], "sliding_window": 64, "is_causal": False}
    drafter = make_drafter(targets["llama"], **overrides)
    assert drafter.layer_rules == [LayerAttention(False, 64), LayerAttention(False, None)]
    args = parser.parse_args(["--data", "d", "--output-dir", "o", "--num-layers", "3", "--layer-types", "sliding"])
    assert attention_overrides(args) == {"layer_types": [S, S, S]}
    assert attention_overrides(parser.parse_args(["--data", "d", "--output-dir", "o"])) == {}
    with pytest.raises(ValueError, match="full or sliding"):
        parse_layer_types("sliding,chunked", 2)


# ------------------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("change,message", [
    ({"rope_scaling": {"rope_type": "weird", "factor": 2.0}}, "Unknown rope type 'weird'"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}}, "per-layer-type"),
    ({"dflash_config": {"swa_window_size": 8}}, "swa_window_size=8"),
    ({"dflash_config": {"use_swa": True}}, "use_swa=True"),
    ({"is_neox_style": False}, "is_neox_style=False"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ({"is_causal": True, "dflash_config": {"causal": False}}, "contradict"),
    ({"dflash_config": {"mask_token_id": None}}, "lacks `mask_token_id`"),
    ({"dflash_config": {"mask_token_id": None, "mask_token": "<|MASK|>"}}, "names the token '<|MASK|>'"),
    ({"layer_types": ["chunked_attention", S]}, "chunked_attention"),
    ({"layer_types": ["chunked_attention", FULL]}, r"layer_types \['chunked_attention'\] are not supported"),
    ({"is_causal": "false"}, "is_causal='false': it must be true, false or null"),
    ({"dflash_config": {"causal": "no"}}, "dflash_config.causal='no': it must be true, false or null"),
    ({"dflash_config": {"mask_token_id": "3"}}, "mask_token_id='3' must be an integer"),
    ({"dflash_config": {"block_size": "6"}}, "block_size='6' must be an integer"),
    ({"num_target_layers": "6"}, "num_target_layers='6' must be an integer"),
    ({"dflash_config": {"target_layer_ids": ["1", 3]}}, r"target_layer_ids=\['1', 3\] must be a list of integer"),
    ({"rope_theta": "1000000"}, "rope_theta='1000000' .* must be a positive number"),
    ({"hidden_act": "bogus"}, "hidden_act='bogus' is not an activation"),
    ({"architectures": "DFlash2DraftModel"}, "architectures='DFlash2DraftModel': it must be a list"),
    ({"rope_scaling": {"factor": 2.0}}, r"give \['factor'\] but no rope type.*add \"rope_type\""),
])
def test_unsupported_fields_are_clear_errors(targets, tmp_path, change, message):
    drafter = _base(targets["qwen3"])
    config = _published(drafter.config)
    for key, value in change.items():
        if key == "dflash_config":
            config["dflash_config"].update(value)
            config["dflash_config"] = {k: v for k, v in config["dflash_config"].items() if v is not None}
        else:
            config[key] = value
    with pytest.raises(Exception, match=message):
        _load(tmp_path, drafter, config)


@pytest.mark.parametrize("change,unused,field", [
    ({"dflash_config": {"conv_kernel_size": None}}, "attention_conv", "dflash_config.conv_kernel_size"),
    ({"dflash_config": {"selector_rank": None}}, "candidate_selector", "dflash_config.selector_rank"),
    ({"architectures": ["DFlashDraftModel"]}, "candidate_selector", r'architectures \["DFlash2DraftModel"\]'),
])
def test_weights_the_config_does_not_use_are_refused(targets, tmp_path, change, unused, field):
    drafter = _base(targets["qwen3"])
    config = _published(drafter.config, **{k: v for k, v in change.items() if k != "dflash_config"})
    config["dflash_config"] = {k: v for k, v in {**config["dflash_config"], **change.get("dflash_config", {})}.items()
                               if v is not None}
    with pytest.raises(CheckpointError, match=f"does not use: .*{unused}.*{field}"):
        _load(tmp_path, drafter, config)


def test_fc_of_another_layer_count_names_target_layer_ids_and_the_rule(targets, tmp_path):
    drafter = _base(targets["qwen3"], target_layer_ids=[1, 2, 3])  # the rule gives [1, 3] for 2 layers on 6
    config = _published(drafter.config)
    del config["dflash_config"]["target_layer_ids"]
    with pytest.raises(CheckpointError, match=r"target_layer_ids=\[1, 3\] gives 2 x 64, the file's reads 192 \(3 "
                                              r"layers\).*round\(1 \+ i \* \(L - 4\) / \(n - 1\)\); here L=6, n=2"
                                              r".*set dflash_config.target_layer_ids"):
        _load(tmp_path, drafter, config)


def test_published_load_does_not_warn_about_the_qwen3_model_type(targets, tmp_path, monkeypatch):
    from transformers import configuration_utils

    warnings = []
    monkeypatch.setattr(configuration_utils.logger, "warning", lambda msg, *a, **k: warnings.append(str(msg)))
    drafter = _base(targets["qwen3"])
    _load(tmp_path, drafter, _published(drafter.config))
    assert not [w for w in warnings if "to instantiate a model of type" in w]


@pytest.mark.parametrize("kwargs,message", [
    ({"is_causal": "false"}, "is_causal='false' must be true, false or null"),
    ({"mask_token_id": "3"}, "mask_token_id='3' must be an integer"),
    ({"rope_theta": "1e6"}, "rope_theta='1e6'"),
    ({"rope_scaling": {"factor": 2.0}}, "no rope type"),
    ({"hidden_act": "bogus"}, "hidden_act='bogus'"),
])
def test_wrongly_typed_fields_of_our_config(kwargs, message):
    with pytest.raises(Exception, match=message):
        DFlash2Config(**kwargs)


def test_rope_scaling_alone_takes_our_default_theta():
    rope = DFlash2Config(rope_scaling={"rope_type": "linear", "factor": 2.0}).rope_parameters
    assert rope == {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0}


@pytest.mark.parametrize("rope,legacy_scaling", [
    (None, None),
    ({"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e6, "original_max_position_embeddings": 256},
     {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256}),
])
def test_published_save_writes_the_legacy_rope_keys_too(targets, tmp_path, rope, legacy_scaling):
    drafter = _base(targets["qwen3"], **({"rope_parameters": rope} if rope else {}))
    drafter.save_pretrained_published(tmp_path / "published")
    path = tmp_path / "published" / "config.json"
    saved = json.loads(path.read_text())
    expected = drafter.config.rope_parameters
    assert (saved["rope_theta"], saved["rope_scaling"]) == (expected["rope_theta"], legacy_scaling)
    assert saved["rope_parameters"] == expected
    assert DFlash2DraftModel.from_pretrained(tmp_path / "published").config.rope_parameters == expected
    del saved["rope_parameters"]  # what a transformers 4.x reader reads
    path.write_text(json.dumps(saved))
    assert DFlash2DraftModel.from_pretrained(tmp_path / "published").config.rope_parameters == expected


def test_neutral_values_of_other_readers_fields_load(targets, tmp_path):
    drafter = _base(targets["qwen3"])
    config = _published(drafter.config, dflash={"use_aux_hidden_state": True, "attention_sink_bias": False,
                                                "mask_token": "<|MASK|>"},
                        is_neox_style=True, max_window_layers=28, use_sliding_window=False)
    assert _load(tmp_path, drafter, config).layer_rules == [LayerAttention()] * 2


@pytest.mark.parametrize("fields,message", [
    ({"sliding_window": 8}, "no layer is a sliding one"),
    ({"layer_types": [S]}, "1 entries for num_hidden_layers=2"),
    ({"layer_types": [S, S], "sliding_window": 0}, "positive"),
])
def test_bad_attention_fields_of_our_config(fields, message):
    with pytest.raises(Exception, match=message):
        DFlash2Config(num_hidden_layers=2, **fields)
