"""Growing a trained drafter deeper (``dflash2 train --init D --grow-layers N [--train-only new-layers]``)."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import make_drafter, make_target, randomize_convs, randomize_selector
from dflash2_hf import DFlash2DraftModel
from dflash2_hf.training.init import freeze_all_but, grow_layers, grown_layer_indices

torch.set_num_threads(1)


@pytest.mark.parametrize("num_layers, grow, expected", [
    (7, 2, [2, 5]),  # 5 + 2: after original layers 1 and 3
    (6, 1, [3]),
    (8, 3, [2, 4, 6]),
    (3, 2, [1, 2]),  # more new layers than gaps: consecutive copies
])
def test_new_layers_are_spread_evenly(num_layers, grow, expected):
    assert grown_layer_indices(num_layers, grow) == expected


@pytest.mark.parametrize("num_layers, grow", [(5, 0), (5, 5), (2, -1)])
def test_impossible_growth_is_refused(num_layers, grow):
    with pytest.raises(ValueError, match="cannot find"):
        grown_layer_indices(num_layers, grow)


@pytest.mark.parametrize("overrides", [{}, {"layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                                            "sliding_window": 5}])
def test_a_grown_drafter_drafts_exactly_what_it_drafted_before(tmp_path, overrides):
    """Identity at the start: same hidden states, same drafts (selector path) through a save / load round trip;
    the new layers are copies of their predecessors with zeroed output projections, renumbered in order."""
    target = make_target("llama")
    drafter = randomize_convs(randomize_selector(make_drafter(target, num_hidden_layers=3, **overrides)))
    grown = copy.deepcopy(drafter)
    new = grow_layers(grown, 2)
    assert new == [1, 3] and grown.config.num_hidden_layers == 5  # after original layers 0 and 1
    assert [layer.self_attn.layer_idx for layer in grown.layers] == list(range(5))
    if overrides:
        assert grown.config.layer_types == ["sliding_attention", "sliding_attention", "full_attention",
                                            "full_attention", "sliding_attention"]
    assert torch.equal(grown.layers[3].self_attn.q_proj.weight, drafter.layers[1].self_attn.q_proj.weight)
    assert grown.layers[3].mlp.down_proj.weight.abs().sum() == 0
    grown.save_pretrained(tmp_path / "grown")
    loaded = DFlash2DraftModel.from_pretrained(tmp_path / "grown").eval()
    c = drafter.config
    torch.manual_seed(0)
    context = torch.randn(1, 11, c.target_hidden_size * len(c.target_layer_ids))
    noise = torch.randn(1, 2 * c.block_size, c.hidden_size)
    positions = torch.arange(11 + 2 * c.block_size)[None]
    with torch.no_grad():
        want = drafter(noise, context_hidden_states=context, position_ids=positions).last_hidden_state
        for model in (grown, loaded):
            got = model(noise, context_hidden_states=context, position_ids=positions).last_hidden_state
            assert torch.equal(got, want)
    ids = torch.tensor([[3, 17, 5, 9, 22, 4]])
    plain = target.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(target.generate(ids, assistant_model=loaded, max_new_tokens=12, do_sample=False), plain)
    assert (loaded.generation_stats.accepted_drafts == drafter_accepts(target, drafter, ids))


def drafter_accepts(target, drafter, ids):
    target.generate(ids, assistant_model=drafter, max_new_tokens=12, do_sample=False)
    return drafter.generation_stats.accepted_drafts


def test_only_the_new_layers_and_the_selector_train():
    target = make_target("llama")
    drafter = make_drafter(target, num_hidden_layers=2)
    new = grow_layers(drafter, 1)
    freeze_all_but(drafter, new)
    trainable = {name.split(".")[0] + ("." + name.split(".")[1] if name.startswith("layers") else "")
                 for name, p in drafter.named_parameters() if p.requires_grad}
    assert trainable == {"layers.1", "candidate_selector"}


def test_grow_layers_through_the_command_line(tmp_path, monkeypatch):
    """``train --init base --grow-layers 1 --train-only new-layers``: the base's layers come out bit-identical at
    their new places, the new layer and the selector train, and generation stays lossless."""
    from transformers import AutoModelForCausalLM

    from dflash2_hf.cli import main
    from test_data import assert_greedy_lossless, regenerated_tiny_chat

    t = regenerated_tiny_chat(tmp_path, monkeypatch)
    target = AutoModelForCausalLM.from_pretrained(t).eval()
    torch.manual_seed(0)
    base = DFlash2DraftModel.from_target(target, num_hidden_layers=2, block_size=4, selector_rank=4)
    base.save_pretrained(tmp_path / "base")
    before = DFlash2DraftModel.from_pretrained(tmp_path / "base").state_dict()
    assert main(["train", "--target", t, "--data", str(tmp_path / "regen"), "--features", "online", "--init",
                 str(tmp_path / "base"), "--grow-layers", "1", "--train-only", "new-layers", "--num-blocks", "4",
                 "--max-steps", "3", "--learning-rate", "1e-2", "--disable-tqdm", "true", "--save-strategy", "no",
                 "--selector-top-k", str(target.config.vocab_size), "--output-dir", str(tmp_path / "out")]) == 0
    grown = DFlash2DraftModel.from_pretrained(tmp_path / "out")
    assert grown.config.num_hidden_layers == 3
    after = grown.state_dict()
    moved = {"layers.0.": "layers.0.", "layers.1.": "layers.2."}  # the new layer sits at index 1
    for name, value in before.items():
        if "candidate_selector" in name:
            continue
        new_name = next((name.replace(a, b, 1) for a, b in moved.items() if name.startswith(a)), name)
        assert torch.equal(after[new_name], value), name
    assert after["layers.1.mlp.down_proj.weight"].abs().sum() > 0  # trained away from its zero start
    assert not torch.equal(after["candidate_selector.successor_codebook"], before["candidate_selector.successor_codebook"])
    assert_greedy_lossless(target, grown)


@pytest.mark.parametrize("options, message", [
    (["--grow-layers", "2"], "--grow-layers needs --init"),
    (["--grow-layers", "0", "--init", "d"], "--grow-layers must be >= 1"),
    (["--grow-layers", "1", "--init", "d", "--lora"], "--grow-layers and --lora exclude each other"),
    (["--train-only", "new-layers", "--init", "d"], "name --init PATH_OR_ID --grow-layers N"),
    (["--grow-layers", "1", "--init", "d", "--train-only", "selector"], "new layers frozen at zero"),
])
def test_growth_options_are_checked_before_any_work(options, message):
    from dflash2_hf.cli import build_parser
    from dflash2_hf.training.config import check_run
    from dflash2_hf.training.parser import configs_from_namespace

    cfg = configs_from_namespace(build_parser("train").parse_args(["train", "--data", "d", "--output-dir", "o",
                                                                   *options]))
    with pytest.raises(ValueError, match=message):
        check_run(cfg.data, cfg.features, cfg.drafter, cfg.lora, cfg.training_args)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", None, True])
def test_grow_layers_refuses_anything_but_a_positive_integer(bad):
    drafter = make_drafter(make_target("llama"), num_hidden_layers=2)
    with pytest.raises(ValueError, match="integer >= 1"):
        grow_layers(drafter, bad)
    assert len(drafter.layers) == 2 and drafter.config.num_hidden_layers == 2  # untouched


def test_a_resumed_growth_run_must_name_the_same_number_of_layers(tmp_path):
    from dflash2_hf.training.build import check_grown_checkpoint

    target = make_target("llama")
    make_drafter(target, num_hidden_layers=2).save_pretrained(tmp_path / "base")
    checkpoint = make_drafter(target, num_hidden_layers=2)
    grow_layers(checkpoint, 2)
    check_grown_checkpoint(checkpoint, str(tmp_path / "base"), 2)
    with pytest.raises(ValueError, match="resume with --grow-layers 2"):
        check_grown_checkpoint(checkpoint, str(tmp_path / "base"), 1)
