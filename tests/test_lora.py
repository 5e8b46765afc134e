"""LoRA adapters on drafters: generation unmerged and merged, adapter-only saving, mismatch errors."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from dflash2_hf import DFlash2DraftModel
from dflash2_hf.lora import (
    SMALL_MODULES,
    AdapterMismatchError,
    adapter_size_bytes,
    add_lora,
    base_weights_digest,
    checkpoint_size_bytes,
    extract_adapter,
    load_adapter,
    lora_config,
    save_adapter,
)
from conftest import make_drafter, make_target, randomize_selector


def _perturb_adapter(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def _drafter_inputs(drafter):
    """A random block of input embeddings and 5 positions of context features for ``drafter``."""
    return (torch.randn(1, drafter.config.block_size, drafter.config.hidden_size),
            torch.randn(1, 5, drafter.fc.in_features))


def test_lora_wraps_only_projections_and_generates(targets, tmp_path):
    target = targets["llama"]
    base = randomize_selector(make_drafter(target))
    base.save_pretrained(tmp_path / "base")
    model = add_lora(DFlash2DraftModel.from_pretrained(tmp_path / "base"))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert any("q_proj.lora_A" in n for n in trainable) and any("down_proj.lora_B" in n for n in trainable)
    _perturb_adapter(model)

    ids = torch.tensor([[9, 14, 3, 77, 41, 8]])
    ref = target.generate(ids, max_new_tokens=20, do_sample=False)
    out_unmerged = target.generate(ids, assistant_model=model, max_new_tokens=20, do_sample=False)
    assert torch.equal(ref, out_unmerged)
    proposals_unmerged = list(model.get_base_model().generation_stats.accepted_drafts)

    save_adapter(model, tmp_path / "adapter")
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert saved and all("lora_" in k for k in saved)  # only the adapter, never the base weights
    assert adapter_size_bytes(tmp_path / "adapter") < checkpoint_size_bytes(tmp_path / "base")

    reloaded = load_adapter(DFlash2DraftModel.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    embeds, ctx = _drafter_inputs(base)
    with torch.no_grad():
        h1 = model(embeds, ctx).last_hidden_state
        h2 = reloaded(embeds, ctx).last_hidden_state
        merged = reloaded.merge_and_unload()
        h3 = merged(embeds, ctx).last_hidden_state
        h0 = base(embeds, ctx).last_hidden_state
    torch.testing.assert_close(h1, h2)
    torch.testing.assert_close(h1, h3, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(h0, h1, atol=1e-3)  # the adapter really changes the drafter
    assert isinstance(merged, DFlash2DraftModel)
    out_merged = target.generate(ids, assistant_model=merged, max_new_tokens=20, do_sample=False)
    assert torch.equal(ref, out_merged)
    assert merged.generation_stats.accepted_drafts == proposals_unmerged


def test_modules_to_save_train_in_full_and_round_trip(targets, tmp_path):
    base = make_drafter(targets["llama"])
    base.save_pretrained(tmp_path / "base")
    digest = base_weights_digest(base)
    model = add_lora(DFlash2DraftModel.from_pretrained(tmp_path / "base"), lora_config(modules_to_save=SMALL_MODULES))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("attention_conv.modules_to_save.default.base_kernel" in n for n in trainable)
    assert any("input_layernorm.modules_to_save.default.weight" in n for n in trainable)
    assert all("lora_" in n or ".modules_to_save." in n for n in trainable)
    with torch.no_grad():  # train the small modules only: the LoRA layers stay at their zero start
        for n, p in model.named_parameters():
            if ".modules_to_save." in n:
                p.add_(0.05 * torch.randn_like(p))
    # the fingerprint still names the base weights, not the adapter's trained copies of them
    assert base_weights_digest(model.get_base_model()) == digest
    save_adapter(model, tmp_path / "adapter")
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert any("mlp_conv" in k for k in saved) and any("post_attention_layernorm" in k for k in saved)

    reloaded = load_adapter(DFlash2DraftModel.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    embeds, ctx = _drafter_inputs(base)
    with torch.no_grad():
        h0 = base(embeds, ctx).last_hidden_state
        h1 = model(embeds, ctx).last_hidden_state
        h2 = reloaded(embeds, ctx).last_hidden_state
        merged = reloaded.merge_and_unload()
        h3 = merged(embeds, ctx).last_hidden_state
    assert not torch.allclose(h0, h1, atol=1e-3)
    torch.testing.assert_close(h1, h2)
    torch.testing.assert_close(h1, h3)
    assert isinstance(merged, DFlash2DraftModel) and not any("modules_to_save" in k for k in merged.state_dict())
    with pytest.raises(ValueError, match="both LoRA targets and modules to train in full"):
        lora_config(target_modules=["q_proj", "mlp_conv"], modules_to_save=["mlp_conv"])


def test_extracted_adapter_reproduces_a_low_rank_fine_tune(targets, tmp_path):
    base = randomize_selector(make_drafter(targets["llama"]))
    base.save_pretrained(tmp_path / "base")
    tuned = DFlash2DraftModel.from_pretrained(tmp_path / "base")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # a rank-2 update of every projection, and new small modules
        for name, module in tuned.named_modules():
            if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")):
                out_f, in_f = module.weight.shape
                module.weight += torch.randn(out_f, 2, generator=g) @ torch.randn(2, in_f, generator=g) * 0.1
        for name, p in tuned.named_parameters():
            if "layernorm" in name or "conv" in name:
                p += 0.1 * torch.randn(p.shape, generator=g)
    embeds, ctx = _drafter_inputs(base)
    config = lora_config(r=2, alpha=4, modules_to_save=SMALL_MODULES)
    model = extract_adapter(DFlash2DraftModel.from_pretrained(tmp_path / "base"), tuned, config)
    save_adapter(model, tmp_path / "fp32")
    save_adapter(model, tmp_path / "bf16", dtype=torch.bfloat16)
    assert adapter_size_bytes(tmp_path / "bf16") < 0.6 * adapter_size_bytes(tmp_path / "fp32")
    with torch.no_grad():
        want = tuned(embeds, ctx).last_hidden_state
        torch.testing.assert_close(model(embeds, ctx).last_hidden_state, want, rtol=1e-4, atol=1e-4)
        base_out = base(embeds, ctx).last_hidden_state
        assert not torch.allclose(base_out, want, atol=1e-2)
        reloaded = load_adapter(DFlash2DraftModel.from_pretrained(tmp_path / "base"), tmp_path / "bf16")
        got = reloaded(embeds, ctx).last_hidden_state  # bf16 storage: close to the fine-tune, far from the base
        assert (got - want).abs().max() < 0.1 * (base_out - want).abs().max()
    # a rank below the update's loses part of it; another architecture is refused
    low = extract_adapter(DFlash2DraftModel.from_pretrained(tmp_path / "base"), tuned, lora_config(r=1, alpha=1))
    with torch.no_grad():
        assert not torch.allclose(low(embeds, ctx).last_hidden_state, want, atol=1e-3)
    with pytest.raises(AdapterMismatchError, match="differs from the base"):
        extract_adapter(DFlash2DraftModel.from_pretrained(tmp_path / "base"), make_drafter(targets["llama"], num_hidden_layers=3), config)


def test_adapter_for_another_drafter_is_refused(targets, tmp_path):
    model = add_lora(make_drafter(targets["llama"]))
    save_adapter(model, tmp_path / "adapter")
    other = make_drafter(make_target("llama", hidden_size=32))
    with pytest.raises(AdapterMismatchError, match="trained for another drafter.*hidden_size: adapter 64 vs drafter 32"):
        load_adapter(other, tmp_path / "adapter")
    deeper = make_drafter(targets["llama"], num_hidden_layers=3)
    with pytest.raises(AdapterMismatchError, match="num_hidden_layers"):
        load_adapter(deeper, tmp_path / "adapter")


def test_adapted_drafter_for_another_target_is_refused(targets):
    model = add_lora(make_drafter(make_target("qwen3", hidden_size=32)))
    with pytest.raises(Exception, match="built for another target"):
        targets["qwen3"].generate(torch.tensor([[5, 6, 7]]), assistant_model=model, max_new_tokens=3)


def test_adapter_for_same_shaped_other_weights_is_refused(targets, tmp_path, caplog):
    """Same architecture, other weights (e.g. a newer release of the drafter): refused unless strict=False."""
    make_drafter(targets["llama"]).save_pretrained(tmp_path / "base")
    save_adapter(add_lora(DFlash2DraftModel.from_pretrained(tmp_path / "base")), tmp_path / "adapter")
    # the digest ignores the dtype the base is loaded in (bf16 checkpoints are upcast for training)
    assert load_adapter(DFlash2DraftModel.from_pretrained(tmp_path / "base", dtype=torch.bfloat16),
                        tmp_path / "adapter") is not None
    # float16 rounds differently from the digest's bf16 cast: the check is skipped, not failed
    assert load_adapter(DFlash2DraftModel.from_pretrained(tmp_path / "base", dtype=torch.float16),
                        tmp_path / "adapter") is not None
    other = DFlash2DraftModel.from_pretrained(tmp_path / "base")
    with torch.no_grad():
        other.layers[0].mlp.up_proj.weight.add_(0.01)
    with pytest.raises(AdapterMismatchError, match="trained on other base weights.*strict=False"):
        load_adapter(other, tmp_path / "adapter")
    loaded = load_adapter(other, tmp_path / "adapter", strict=False)
    assert any("lora_A" in n for n, _ in loaded.named_parameters())


def test_adapter_loaded_twice_names_the_real_cause(targets, tmp_path):
    """A second load_adapter on the same drafter object (peft injected LoRA layers in place) says so."""
    make_drafter(targets["llama"]).save_pretrained(tmp_path / "base")
    save_adapter(add_lora(DFlash2DraftModel.from_pretrained(tmp_path / "base")), tmp_path / "adapter")
    drafter = DFlash2DraftModel.from_pretrained(tmp_path / "base")
    adapted = load_adapter(drafter, tmp_path / "adapter")
    for again in (drafter, adapted):
        with pytest.raises(AdapterMismatchError, match="already carries a LoRA adapter.*merge_and_unload"):
            load_adapter(again, tmp_path / "adapter")
    _perturb_adapter(adapted)  # a fresh adapter is a no-op (lora_B = 0); make merging change the weights
    merged = adapted.merge_and_unload()  # a merged drafter is a plain drafter again: the digest check applies
    with pytest.raises(AdapterMismatchError, match="trained on other base weights"):
        load_adapter(merged, tmp_path / "adapter")


def test_bad_adapter_folders_give_clear_errors(targets, tmp_path, caplog):
    from dflash2_hf import CheckpointError

    base = make_drafter(targets["llama"])
    with pytest.raises(FileNotFoundError, match="adapter folder .* not found"):
        load_adapter(base, tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="adapter_config.json is missing"):
        load_adapter(base, tmp_path / "empty")
    save_adapter(add_lora(make_drafter(targets["llama"])), tmp_path / "good")
    weights = tmp_path / "good" / "adapter_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_adapter(make_drafter(targets["llama"]), tmp_path / "good")
    # an adapter saved by plain peft (no fingerprint) loads, with a warning that nothing could be checked
    plain = add_lora(make_drafter(targets["llama"]))
    plain.save_pretrained(tmp_path / "plain")
    with caplog.at_level("WARNING"):
        assert load_adapter(make_drafter(targets["llama"]), tmp_path / "plain") is not None
    assert "cannot check" in caplog.text


def test_adapters_damaged_after_saving_are_refused_by_name(targets, tmp_path):
    """Damage that keeps the files parseable: a broken fingerprint, bytes overwritten in place, a config edited so
    that it no longer fits (or silently drops) the saved weights."""
    import json
    import shutil

    from safetensors.torch import save_file

    from dflash2_hf import CheckpointError

    config = lora_config(r=4, alpha=8, modules_to_save=["mlp_conv"])
    good = tmp_path / "good"
    save_adapter(_perturb_adapter_and_return(add_lora(make_drafter(targets["llama"]), config)), good)
    assert load_adapter(make_drafter(targets["llama"]), good) is not None

    def damaged(name, fn):
        folder = tmp_path / name
        shutil.copytree(good, folder)
        fn(folder)
        return folder

    broken_json = damaged("json", lambda f: (f / "dflash2_adapter.json").write_text('{"fields": {'))
    with pytest.raises(CheckpointError, match="dflash2_adapter.json .* is corrupt"):
        load_adapter(make_drafter(targets["llama"]), broken_json)
    empty_json = damaged("empty-json", lambda f: (f / "dflash2_adapter.json").write_text("{}"))
    with pytest.raises(CheckpointError, match='no "fields"'):
        load_adapter(make_drafter(targets["llama"]), empty_json)

    def nan_weights(folder):
        tensors = load_file(folder / "adapter_model.safetensors")
        name = next(k for k in tensors if "lora_A" in k)
        tensors[name][0, 0] = float("nan")
        save_file(tensors, folder / "adapter_model.safetensors")

    with pytest.raises(CheckpointError, match="non-finite values in 1 tensors .*lora_A"):
        load_adapter(make_drafter(targets["llama"]), damaged("nan", nan_weights))

    def edit_config(**changes):
        def fn(folder):
            cfg = json.loads((folder / "adapter_config.json").read_text())
            cfg.update(changes)
            (folder / "adapter_config.json").write_text(json.dumps(cfg))
        return fn

    with pytest.raises(CheckpointError, match="do not fit its own adapter_config.json"):
        load_adapter(make_drafter(targets["llama"]), damaged("rank", edit_config(r=8)))
    with pytest.raises(CheckpointError, match="have no place in the model .*mlp_conv"):
        load_adapter(make_drafter(targets["llama"]), damaged("no-save", edit_config(modules_to_save=None)))
    targets_cfg = json.loads((good / "adapter_config.json").read_text())["target_modules"]
    renamed = [m + "X" if m == "gate_proj" else m for m in targets_cfg]
    with pytest.raises(CheckpointError, match="have no place in the model .*gate_proj"):
        load_adapter(make_drafter(targets["llama"]), damaged("renamed", edit_config(target_modules=renamed)))


def _perturb_adapter_and_return(model):
    _perturb_adapter(model)
    return model


def test_unreachable_hub_adapter_is_a_clear_error_without_the_fingerprint_warning(targets, monkeypatch, caplog):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def offline(repo_id, filename, **kw):
        raise LocalEntryNotFoundError(f"{repo_id}/{filename} is not cached and the Hub is offline")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    drafter = make_drafter(targets["llama"])
    with caplog.at_level("WARNING"), pytest.raises(FileNotFoundError, match="no LoRA adapter at 'someorg/none'"):
        load_adapter(drafter, "someorg/none")
    assert "dflash2_adapter.json" not in caplog.text


def test_extract_adapter_script_records_the_fine_tune_chain(targets, tmp_path, monkeypatch):
    import json
    import runpy
    from pathlib import Path

    base = make_drafter(targets["llama"])
    base.save_pretrained(tmp_path / "base")
    tuned = DFlash2DraftModel.from_pretrained(tmp_path / "base")
    with torch.no_grad():
        tuned.layers[0].mlp.up_proj.weight.add_(0.1)  # a rank-1 update
    for stage, init in (("ft1", tmp_path / "base"), ("ft2", tmp_path / "ft1")):
        tuned.save_pretrained(tmp_path / stage)
        (tmp_path / stage / "train_command.json").write_text(json.dumps(
            {"argv": ["dflash2", "train", "--init", str(init)], "args": {"init": str(init)}, "threads": 1}))
    script = Path(__file__).resolve().parents[1] / "examples" / "extract_adapter.py"
    monkeypatch.setattr("sys.argv", ["extract_adapter.py", "--base", str(tmp_path / "base"), "--finetuned",
                                     str(tmp_path / "ft2"), "--out", str(tmp_path / "x"), "--r", "2", "--alpha", "2"])
    runpy.run_path(str(script), run_name="__main__")
    record = json.loads((tmp_path / "x" / "extraction.json").read_text())
    assert [stage["output"] for stage in record["finetune"]] == [str(tmp_path / "ft1"), str(tmp_path / "ft2")]
    assert 0 < record["adapter_parameters"] < record["base_parameters"]
    adapted = load_adapter(DFlash2DraftModel.from_pretrained(tmp_path / "base"), tmp_path / "x").merge_and_unload()
    torch.testing.assert_close(adapted.layers[0].mlp.up_proj.weight, tuned.layers[0].mlp.up_proj.weight,
                               rtol=1e-2, atol=1e-2)  # bf16 storage of the factors


def test_ship_adapter_provenance_follows_lora_init_through_a_shipped_adapter(tmp_path):
    """A LoRA run that continued an extracted adapter cites the fine-tunes and the extraction before it, and the
    shipped folder keeps that history (provenance.json) for a run that continues it in turn."""
    import json
    import runpy
    from pathlib import Path

    script = runpy.run_path(str(Path(__file__).resolve().parents[1] / "examples" / "ship_adapter.py"))
    provenance = script["provenance"]

    def run_folder(name, argv, args):
        (tmp_path / name).mkdir()
        (tmp_path / name / "train_command.json").write_text(json.dumps({"argv": argv, "args": args, "threads": 1}))
        return tmp_path / name

    extracted = tmp_path / "x"
    extracted.mkdir()
    (extracted / "extraction.json").write_text(json.dumps({
        "argv": ["python", "examples/extract_adapter.py", "--r", "4"], "adapter_parameters": 10,
        "base_parameters": 100, "finetune": [{"output": "ft1", "argv": ["dflash2", "train"], "threads": 1,
                                              "wall_s": 5.0}]}))
    lora = run_folder("a", ["dflash2", "train", "--lora-init", str(extracted)], {"lora_init": str(extracted)})
    stages = provenance(lora)
    assert [s["kind"] for s in stages] == ["finetune", "extract", "lora"]
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    (shipped / script["PROVENANCE_FILE"]).write_text(json.dumps({"stages": stages}))
    later = run_folder("b", ["dflash2", "train", "--lora-init", str(shipped)], {"lora_init": str(shipped)})
    assert [s["kind"] for s in provenance(later)] == ["finetune", "extract", "lora", "lora"]
    text = script["recipe_text"](provenance(later), [], Path("base"))
    assert text.index("extraction into an adapter") < text.index("--lora-init " + str(shipped))
    assert "  4. LoRA training" in text and text.count("held stage 3's adapter at the time") == 1  # only the last
    bare = run_folder("c", ["dflash2", "train", "--lora-init", str(tmp_path / "nothing")],
                      {"lora_init": str(tmp_path / "nothing")})
    with pytest.raises(FileNotFoundError, match="records how it was made in none of"):
        provenance(bare)


def test_load_adapter_refuses_what_is_no_drafter_before_touching_it(targets, tmp_path):
    """A target, a drafter's name, or swapped arguments: a typed error naming what was given and load_drafter."""
    from dflash2_hf import DrafterArgumentTypeError

    drafter = make_drafter(targets["llama"])
    save_adapter(add_lora(make_drafter(targets["llama"])), tmp_path / "adapter")
    with pytest.raises(DrafterArgumentTypeError, match=r"got a LlamaForCausalLM \(a transformers model: the target\?\)"
                       r".*load_drafter\(name, target, precision=\"fp32\"\)"):
        load_adapter(targets["llama"], tmp_path / "adapter")
    with pytest.raises(DrafterArgumentTypeError, match=r"the name or path 'dflash2-smollm2-135m-instruct', not a "
                       r"loaded model.*load_drafter\('dflash2-smollm2-135m-instruct', target, precision=\"fp32\"\)"):
        load_adapter("dflash2-smollm2-135m-instruct", tmp_path / "adapter")
    with pytest.raises(DrafterArgumentTypeError, match=r"adapter_path must be .*got a DFlash2DraftModel \(a "
                       r"drafter\) \(arguments swapped\? the drafter comes first\)"):
        load_adapter(tmp_path / "adapter", drafter)
    assert not any("lora_" in n for n, _ in drafter.named_parameters())  # untouched: it still takes the adapter
    assert load_adapter(drafter, tmp_path / "adapter") is not None


def test_add_lora_takes_a_drafter_only(targets):
    from dflash2_hf import DrafterArgumentTypeError

    with pytest.raises(DrafterArgumentTypeError, match=r"add_lora\(drafter\): .*got the name or path 'name'.*"
                       r"load_drafter\('name', target"):
        add_lora("name")
    with pytest.raises(DrafterArgumentTypeError, match=r"got a LlamaForCausalLM .*peft.get_peft_model"):
        add_lora(targets["llama"])
    assert not any("lora_" in n for n, _ in targets["llama"].named_modules())
    with pytest.raises(DrafterArgumentTypeError, match=r"add_lora\(drafter\): this drafter already carries a LoRA "
                       "adapter.*merge_and_unload"):
        add_lora(add_lora(make_drafter(targets["llama"])))
    with pytest.raises(DrafterArgumentTypeError, match=r"extract_adapter.*finetuned.*got a LlamaForCausalLM"):
        extract_adapter(make_drafter(targets["llama"]), targets["llama"], lora_config())


def test_save_adapter_of_a_plain_drafter_writes_nothing(targets, tmp_path):
    from dflash2_hf import DrafterArgumentTypeError

    with pytest.raises(DrafterArgumentTypeError, match=r"got a plain DFlash2DraftModel; nothing was written.*"
                       r"add_lora\(drafter\).*save_pretrained"):
        save_adapter(make_drafter(targets["llama"]), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(DrafterArgumentTypeError, match="got a LlamaForCausalLM"):
        save_adapter(targets["llama"], tmp_path / "out")
    with pytest.raises(DrafterArgumentTypeError, match=r"arguments swapped\?.*save_adapter\(peft_model, "):
        save_adapter(str(tmp_path / "out"), add_lora(make_drafter(targets["llama"])))
    assert not (tmp_path / "out").exists()
    assert not (tmp_path / "out").exists()


def test_save_adapter_refuses_a_folder_holding_a_drafter_and_overwrites_an_adapter(targets, tmp_path):
    from dflash2_hf.errors import FolderHoldsModelError

    base = make_drafter(targets["llama"])
    base.save_pretrained(tmp_path / "drafter")
    before = sorted(p.name for p in (tmp_path / "drafter").iterdir())
    model = add_lora(DFlash2DraftModel.from_pretrained(tmp_path / "drafter"))
    with pytest.raises(FolderHoldsModelError, match=r"holds a drafter \(config.json with model_type 'dflash2', "
                       r"model.safetensors\).*new folder, e.g. '.*drafter-lora'"):
        save_adapter(model, tmp_path / "drafter")
    assert sorted(p.name for p in (tmp_path / "drafter").iterdir()) == before
    DFlash2DraftModel.from_pretrained(tmp_path / "drafter")  # still a loadable drafter
    targets["llama"].save_pretrained(tmp_path / "target")  # other model weights: refused too
    with pytest.raises(FolderHoldsModelError, match=r"holds model weights \(config.json with model_type 'llama'"):
        save_adapter(model, tmp_path / "target")
    save_adapter(model, tmp_path / "adapter")  # saving again over an adapter (a training checkpoint) replaces it
    _perturb_adapter(model)
    save_adapter(model, tmp_path / "adapter")
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    name = next(k for k in saved if "lora_B" in k)
    assert saved[name].abs().sum() > 0


def test_int8_drafter_is_refused_by_lora(targets, tmp_path):
    """The message comes from dflash2_hf.quantization.refuse_int8 (shared with save/push/train)."""
    from dflash2_hf import UnsupportedGenerationError

    save_adapter(add_lora(make_drafter(targets["llama"])), tmp_path / "adapter")
    drafter = make_drafter(targets["llama"])
    drafter.int8_drafting = True  # what quantize_drafter marks (no int8 kernels needed to test the refusal)
    for call in (lambda: add_lora(drafter), lambda: load_adapter(drafter, tmp_path / "adapter")):
        with pytest.raises(UnsupportedGenerationError, match="int8-quantized drafter .* cannot be given a LoRA"):
            call()


def test_adapter_folder_check_names_a_drafter_folder(targets, tmp_path):
    from dflash2_hf import CheckpointError
    from dflash2_hf.lora import check_adapter_folder

    make_drafter(targets["llama"]).save_pretrained(tmp_path / "drafter")
    folder = str(tmp_path / "drafter")
    with pytest.raises(CheckpointError) as err:
        check_adapter_folder(folder)
    message = str(err.value)
    assert "is not a LoRA adapter folder: adapter_config.json is missing" in message
    assert f"this is a drafter folder; pass it as --drafter {folder} / dflash2_hf.load_drafter({folder!r}" in message
    targets["llama"].save_pretrained(tmp_path / "target")
    with pytest.raises(CheckpointError, match=r"adapter_config.json is missing .*it holds model weights \(config.json "
                       r"with model_type 'llama', model.safetensors\), not an adapter"):
        check_adapter_folder(tmp_path / "target")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"adapter_config.json is missing \(expected the output of `dflash2 "
                       r"train --lora` or `dflash2_hf.lora.save_adapter`\)$"):
        check_adapter_folder(tmp_path / "empty")


def test_an_adapter_on_a_drafter_with_prepacked_cpu_kernels_merges_into_what_drafts(targets, tmp_path):
    """load_drafter puts a CPU drafter on prepacked kernels; a LoRA merge writes into the weights in place, which the
    packed copies would not see (the merged drafter drafted with the base weights). The adapter functions put the
    drafter back on stock kernels first, and quantize_drafter quantizes a prepacked drafter all the same."""
    from dflash2_hf import optimize_for_cpu
    from dflash2_hf.cpu_kernels import is_optimized
    from dflash2_hf.quantization import int8_support, is_int8, is_quantized_linear, quantize_drafter

    target = targets["llama"]
    make_drafter(target).save_pretrained(tmp_path / "base")
    save_adapter_from = add_lora(DFlash2DraftModel.from_pretrained(tmp_path / "base"))
    _perturb_adapter(save_adapter_from)
    save_adapter(save_adapter_from, tmp_path / "adapter")
    embeds, ctx = _drafter_inputs(save_adapter_from.get_base_model())
    with torch.no_grad():
        reference = load_adapter(DFlash2DraftModel.from_pretrained(tmp_path / "base"),
                                 tmp_path / "adapter").merge_and_unload()(embeds, ctx).last_hidden_state
        prepacked = optimize_for_cpu(DFlash2DraftModel.from_pretrained(tmp_path / "base").eval())
        merged = load_adapter(prepacked, tmp_path / "adapter").merge_and_unload()
        assert not is_optimized(merged)
        torch.testing.assert_close(merged(embeds, ctx).last_hidden_state, reference, rtol=1e-4, atol=1e-4)
        merged = optimize_for_cpu(merged)  # packed again after the merge: the merged weights
        torch.testing.assert_close(merged(embeds, ctx).last_hidden_state, reference, rtol=1e-4, atol=1e-4)
    if int8_support("cpu")[0]:
        quantized = quantize_drafter(optimize_for_cpu(DFlash2DraftModel.from_pretrained(tmp_path / "base").eval()))
        assert is_int8(quantized) and any(is_quantized_linear(m) for m in quantized.layers.modules())
