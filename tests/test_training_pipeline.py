"""The training pipeline as a library (typed configs + train()), its command line, and online target features."""

from __future__ import annotations

import json

import pytest
import torch

from dflash2_hf import DFlash2DraftModel
from dflash2_hf.training import (
    BlockCollator,
    DFlash2Trainer,
    FeatureCache,
    FeatureDataset,
    OnlineFeatures,
    RecordDataset,
    default_training_arguments,
)
from test_training import _drafter, _records, _target

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def target():
    return _target()


@pytest.mark.parametrize("labels, topk", [(False, 0), (True, 5)])
def test_online_features_give_the_cached_loss(tmp_path, target, labels, topk):
    """The same batch through the cache and through the target in the training step: same features, same loss."""
    drafter = _drafter(target)
    recs = _records(4)
    layer_ids = drafter.config.target_layer_ids
    cache = FeatureCache(tmp_path / "feat", "tiny", layer_ids, with_next=labels, topk=topk)
    cache.build(target, recs, max_length=30, progress=False)
    cached = FeatureDataset(recs, cache, max_length=30, target_labels=labels)
    online = RecordDataset(recs, max_length=30)
    assert [r["record_id"] for r in cached.records] == [r["record_id"] for r in online.records]
    provider = OnlineFeatures(target, layer_ids, target_labels=labels, topk=topk)
    losses = []
    for ds, feats in ((cached, None), (online, provider)):
        collator = BlockCollator(block_size=4, mask_token_id=drafter.config.mask_token_id, num_blocks=6, epoch=0)
        args = default_training_arguments(str(tmp_path / "run"), distill_weight=0.5 if topk else 0.0,
                                          disable_tqdm=True)
        trainer = DFlash2Trainer(model=drafter, args=args, target=target, train_dataset=ds, data_collator=collator,
                                 online_features=feats)
        batch = trainer.data_collator([ds[i] for i in range(len(ds))])
        assert ("online_items" in batch) is (feats is not None)  # online: no features in the DataLoader
        losses.append(trainer.compute_loss(trainer.model, trainer._prepare_inputs(batch)))
    assert torch.equal(losses[0], losses[1])
    item = provider([online[1]])[0]
    assert torch.equal(item["context_hidden_states"], cached[1]["context_hidden_states"])
    for key in ("target_next", "target_topk_logits", "target_topk_ids"):
        if key in cached[1]:
            assert torch.equal(item[key], cached[1][key]), key


def test_parser_uses_transformers_names_and_refuses_old_spellings(capsys):
    from dflash2_hf.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    help_text = capsys.readouterr().out
    for name in ("--output_dir", "--learning_rate", "--per_device_train_batch_size", "--num_train_epochs",
                 "--gradient_accumulation_steps", "--resume_from_checkpoint", "--features {cache,online}"):
        assert name in help_text, name
    for old, new in (("--output", "--output-dir"), ("--lr", "--learning-rate"), ("--resume", "--resume-from-checkpoint"),
                     ("--batch-size", "--per-device-train-batch-size"), ("--epochs", "--num-train-epochs")):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["train", "--data", "d", old, "1"])
        assert f"{old} is now {new}" in capsys.readouterr().err


@pytest.mark.parametrize("options, named", [
    (["--lora-r", "8", "--lora-alpha", "16"], "--lora-r / --lora-alpha"),
    (["--lora-dropout", "0.1"], "--lora-dropout"),
    (["--lora-target-modules", "q_proj"], "--lora-target-modules"),
    (["--lora-save-dtype", "bf16"], "--lora-save-dtype"),
])
def test_lora_options_without_lora_are_refused_naming_them(options, named):
    from dflash2_hf.cli import build_parser
    from dflash2_hf.training.parser import configs_from_namespace

    with pytest.raises(ValueError, match=f"^{named} shapes? a LoRA adapter .* add --lora"):
        configs_from_namespace(build_parser("train").parse_args(["train", "--data", "d", "--output-dir", "o", *options]))
    assert configs_from_namespace(build_parser("train").parse_args(  # the defaults spelled out are not a change
        ["train", "--data", "d", "--output-dir", "o", "--lora-r", "16"])).lora.lora is False


def test_config_file_fills_defaults_and_the_command_line_wins(tmp_path):
    from dflash2_hf.cli import build_parser
    from dflash2_hf.training.parser import configs_from_namespace

    (tmp_path / "run.yaml").write_text("data: some/folder\nlearning_rate: 0.001\nmax_steps: 7\nfeatures: online\n"
                                       "num_layers: 2\nlora: true\nlora_r: 4\n")
    cfg = configs_from_namespace(build_parser().parse_args(
        ["train", str(tmp_path / "run.yaml"), "--max-steps", "3", "--output-dir", str(tmp_path / "o")]))
    assert cfg.data.data == "some/folder" and cfg.features.features == "online" and cfg.drafter.num_layers == 2
    assert cfg.training_args.learning_rate == 0.001 and cfg.training_args.max_steps == 3 and cfg.lora.lora_r == 4
    assert cfg.training_args.lr_scheduler_type == "cosine" and cfg.training_args.seed == 0  # the recipe's defaults
    from dflash2_hf.training import TrainArgumentParser

    same = TrainArgumentParser().parse([str(tmp_path / "run.yaml"), "--max-steps", "3"])  # from Python: the same
    assert (same.training_args.max_steps, same.training_args.learning_rate, same.data.data) == (3, 0.001, "some/folder")
    (tmp_path / "bad.json").write_text(json.dumps({"output": "x"}))
    with pytest.raises(ValueError, match="unknown option"):
        configs_from_namespace(build_parser().parse_args(["train", str(tmp_path / "bad.json")]))


def test_cli_trains_online_without_a_cache_and_decodes_losslessly(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from dflash2_hf.cli import main
    from test_data import assert_greedy_lossless, regenerated_tiny_chat

    t = regenerated_tiny_chat(tmp_path, monkeypatch)
    out = tmp_path / "run"
    assert main(["train", "--target", t, "--data", str(tmp_path / "regen"), "--features", "online", "--num-layers", "1",
                 "--block-size", "4", "--num-blocks", "4", "--max-steps", "3", "--save-steps", "2",
                 "--logging-steps", "1", "--output-dir", str(out), "--disable-tqdm", "true"]) == 0
    assert not (tmp_path / "cache" / "features").exists()  # nothing cached
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["world_size"] == 1 and summary["features"] == "online" and summary["feature_cache"] is None
    assert summary["global_step"] == 3 and (out / "checkpoint-2").is_dir()
    drafter = DFlash2DraftModel.from_pretrained(out)
    target = AutoModelForCausalLM.from_pretrained(t).eval()
    assert_greedy_lossless(target, drafter)
    # resume: continues after the last checkpoint of the same run (the Trainer also saves at the last step)
    assert main(["train", "--target", t, "--data", str(tmp_path / "regen"), "--features", "online", "--num-layers", "1",
                 "--block-size", "4", "--num-blocks", "4", "--max-steps", "4", "--output-dir", str(out),
                 "--resume-from-checkpoint", "last", "--disable-tqdm", "true"]) == 0
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["resumed_from"].endswith("checkpoint-3") and summary["global_step"] == 4
    # the same folder again, not resuming: refused; with --overwrite-output-dir emptied first (no old checkpoint
    # left for a later `--resume-from-checkpoint last` to pick up)
    again = ["train", "--target", t, "--data", str(tmp_path / "regen"), "--features", "online", "--num-layers", "1",
             "--block-size", "4", "--num-blocks", "4", "--max-steps", "1", "--output-dir", str(out),
             "--disable-tqdm", "true"]
    assert main(again) == 2 and (out / "checkpoint-3").is_dir()
    assert main([*again, "--overwrite-output-dir", "true"]) == 0
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1"]


def test_train_only_selector_changes_the_selector_and_nothing_else(tmp_path, monkeypatch):
    """``--train-only selector`` on an ``--init`` drafter: every other weight comes out bit-identical, the selector
    trains; ``--selector-rank`` other than the drafter's gives a new selector of that rank; output stays lossless."""
    from transformers import AutoModelForCausalLM

    from dflash2_hf.cli import main
    from test_data import assert_greedy_lossless, regenerated_tiny_chat

    t = regenerated_tiny_chat(tmp_path, monkeypatch)
    target = AutoModelForCausalLM.from_pretrained(t).eval()
    torch.manual_seed(0)
    base = DFlash2DraftModel.from_target(target, num_hidden_layers=1, block_size=4, selector_rank=4)
    base.save_pretrained(tmp_path / "base")
    before = {k: v.clone() for k, v in DFlash2DraftModel.from_pretrained(tmp_path / "base").state_dict().items()}
    common = ["train", "--target", t, "--data", str(tmp_path / "regen"), "--features", "online", "--init",
              str(tmp_path / "base"), "--train-only", "selector", "--num-blocks", "4", "--max-steps", "3",
              "--learning-rate", "1e-2", "--disable-tqdm", "true", "--save-strategy", "no",
              "--selector-top-k", str(target.config.vocab_size)]  # every label among the candidates: trains
    for rank, out in ((None, tmp_path / "same"), (6, tmp_path / "wider")):
        assert main(common + (["--selector-rank", str(rank)] if rank else []) + ["--output-dir", str(out)]) == 0
        after = DFlash2DraftModel.from_pretrained(out).state_dict()
        assert after.keys() == before.keys()
        for name, value in after.items():
            if "candidate_selector" in name:
                continue
            assert torch.equal(value, before[name]), name
        codebook = after["candidate_selector.successor_codebook"]
        assert codebook.shape[1] == (rank or 4)
        if rank is None:
            assert not torch.equal(codebook, before["candidate_selector.successor_codebook"])
        assert codebook.abs().sum() > 0  # trained away from its zero start
    drafter = DFlash2DraftModel.from_pretrained(tmp_path / "wider")
    assert drafter.config.selector_rank == 6 and drafter.config.selector_top_k == target.config.vocab_size
    assert_greedy_lossless(target, drafter)


@pytest.mark.parametrize("options, message", [
    (["--train-only", "selector"], "--train-only selector needs --init"),
    (["--train-only", "selector", "--init", "d", "--lora"], "exclude each other"),
    (["--selector-rank", "0"], "--selector-rank must be >= 1"),
    (["--selector-rank", "64", "--init", "d", "--lora"], "--selector-rank cannot be used with --lora"),
])
def test_selector_training_options_are_checked_before_any_work(options, message):
    from dflash2_hf.cli import build_parser
    from dflash2_hf.training.config import check_run
    from dflash2_hf.training.parser import configs_from_namespace

    cfg = configs_from_namespace(build_parser("train").parse_args(["train", "--data", "d", "--output-dir", "o",
                                                                   *options]))
    with pytest.raises(ValueError, match=message):
        check_run(cfg.data, cfg.features, cfg.drafter, cfg.lora, cfg.training_args)


@pytest.mark.parametrize("options, message", [
    (["--lora", "--init", "d", "--lora-r", "0"], "--lora-r must be >= 1"),
])
def test_lora_rank_is_checked_before_any_work(options, message):
    from dflash2_hf.cli import build_parser
    from dflash2_hf.training.config import check_run
    from dflash2_hf.training.parser import configs_from_namespace

    cfg = configs_from_namespace(build_parser("train").parse_args(["train", "--data", "d", "--output-dir", "o",
                                                                   *options]))
    with pytest.raises(ValueError, match=message):
        check_run(cfg.data, cfg.features, cfg.drafter, cfg.lora, cfg.training_args)


def test_an_output_dir_holding_a_drafter_or_another_run_is_refused_and_kept(tmp_path, monkeypatch):
    """A training run never writes into a folder that holds something unless it resumes or is told to overwrite;
    --data given a file and a missing --output-dir are refused with the fix, all before any model loads."""
    import dflash2_hf.targets

    monkeypatch.setattr(dflash2_hf.targets, "load_target", lambda *a, **k: pytest.fail("the target was loaded"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    old = tmp_path / "old-drafter"
    old.mkdir()
    (old / "model.safetensors").write_bytes(b"weights of an earlier run")
    (old / "checkpoint-4").mkdir()
    (tmp_path / "chats.jsonl").write_text("{}\n")
    (tmp_path / "runs-x").mkdir()  # runs-x/dev: a missing folder under an existing one (no Hub id)
    base = ["train", "--target", "smollm2", "--data", "data", "--max-steps", "1", "--num-threads", "1"]
    for extra, message in (
            (["--output-dir", str(old)],
             r"already holds a drafter \(checkpoint-4, model.safetensors\).*--overwrite-output-dir true"),
            (["--output-dir", str(old), "--resume-from-checkpoint", str(tmp_path / "nope")], "no such checkpoint"),
            ([], "--output-dir is required"),
            (["--output-dir", "new", "--data", "chats.jsonl"],  # a conversations FILE: the command making a folder
             "is a file; --data takes a prepared data folder.*prepare-data --source"),
            (["--output-dir", "new", "--data", "./no-such-data"], "--data ./no-such-data: no such folder"),
            (["--output-dir", "new", "--eval-data", "runs-x/dev"], "--eval-data runs-x/dev: no such folder")):
        with pytest.raises(ValueError, match=message):
            _run_train([*base, *extra])
    assert (old / "model.safetensors").read_bytes() == b"weights of an earlier run" and not (tmp_path / "new").exists()
    adapter_only = tmp_path / "adapter-only"
    adapter_only.mkdir()
    (adapter_only / "adapter_config.json").write_text("{}")
    with pytest.raises(ValueError, match="already holds an adapter .*Choose a new --output-dir, or pass") as refused:
        _run_train([*base, "--output-dir", str(adapter_only)])
    assert "resume" not in str(refused.value)  # no checkpoint there to resume


def _run_train(argv):
    """``dflash2 train`` as the CLI parses it, with its errors raised (main() prints them as one line)."""
    from dflash2_hf.cli import build_parser
    from dflash2_hf.training import train
    from dflash2_hf.training.parser import configs_from_namespace

    train(**configs_from_namespace(build_parser("train").parse_args(argv))._asdict())


def test_train_only_selector_refuses_a_drafter_without_one(target):
    from dflash2_hf.training.build import apply_selector_options, freeze_all_but_selector

    drafter = _drafter(target)
    drafter.candidate_selector = None
    drafter.config.use_candidate_selector = False
    with pytest.raises(ValueError, match="no candidate selector.*--selector-rank"):
        freeze_all_but_selector(drafter)
    with pytest.raises(ValueError, match="--selector-top-k 1000: this drafter proposes 128 token ids"):
        apply_selector_options(drafter, None, 1000)
    apply_selector_options(drafter, 3, None)  # adds one
    freeze_all_but_selector(drafter)
    assert {n for n, p in drafter.named_parameters() if p.requires_grad} == {
        f"candidate_selector.{n}" for n, _ in drafter.candidate_selector.named_parameters()}


def test_a_batch_without_labels_still_backpropagates_into_a_trainable_selector(target):
    """With the drafter body frozen, a batch whose blocks hold no label must give a loss with a graph (the Trainer
    calls backward on every batch): found on a real ``--train-only selector`` run."""
    from dflash2_hf.training.build import freeze_all_but_selector
    from dflash2_hf.training.losses import IGNORE_INDEX, drafter_loss

    drafter = _drafter(target)
    freeze_all_but_selector(drafter)
    B = drafter.config.block_size
    hidden = torch.randn(1, 2 * B, drafter.config.hidden_size)  # frozen body: no grad on it
    labels = torch.full((1, 2 * B), IGNORE_INDEX)
    out = drafter_loss(drafter, hidden, labels, torch.zeros(1, 2 * B, dtype=torch.long),
                       target.get_output_embeddings(), B)
    assert out.loss.requires_grad and float(out.loss.detach()) == 0.0
    out.loss.backward()
    assert drafter.candidate_selector.successor_codebook.grad is not None


def test_lora_init_of_another_drafter_is_refused_before_the_target_loads(tmp_path, monkeypatch):
    import dflash2_hf.targets
    from conftest import make_drafter, make_target
    from dflash2_hf import DFlash2DraftModel, add_lora
    from dflash2_hf.lora import save_adapter

    target = make_target("llama")
    make_drafter(target, num_hidden_layers=2).save_pretrained(tmp_path / "two")
    make_drafter(target, num_hidden_layers=1).save_pretrained(tmp_path / "one")
    save_adapter(add_lora(DFlash2DraftModel.from_pretrained(tmp_path / "two")), tmp_path / "adapter")
    monkeypatch.setattr(dflash2_hf.targets, "load_target", lambda *a, **k: pytest.fail("the target was loaded"))
    (tmp_path / "data").mkdir()
    with pytest.raises(ValueError, match="--lora-init: The LoRA adapter .* was trained for another drafter "
                                         r"\(num_hidden_layers: adapter 2 vs drafter 1"):
        _run_train(["train", "--target", "smollm2", "--data", str(tmp_path / "data"), "--output-dir",
                    str(tmp_path / "out"), "--init", str(tmp_path / "one"), "--lora", "--lora-init",
                    str(tmp_path / "adapter")])


def test_an_init_that_is_no_drafter_is_refused_with_the_training_fix(tmp_path, monkeypatch):
    import dflash2_hf.targets
    from conftest import make_drafter, make_target
    from dflash2_hf import DFlash2DraftModel, add_lora
    from dflash2_hf.lora import save_adapter

    target = make_target("llama")
    make_drafter(target).save_pretrained(tmp_path / "drafter")
    save_adapter(add_lora(DFlash2DraftModel.from_pretrained(tmp_path / "drafter")), tmp_path / "adapter")
    target.save_pretrained(tmp_path / "target")
    monkeypatch.setattr(dflash2_hf.targets, "load_target", lambda *a, **k: pytest.fail("the target was loaded"))
    (tmp_path / "data").mkdir()
    base = ["train", "--target", "smollm2", "--data", str(tmp_path / "data"), "--output-dir", str(tmp_path / "out")]
    for init, message in ((tmp_path / "missing", "no drafter folder there. Leave out --init"),
                          (tmp_path / "adapter", "is a LoRA adapter, not a drafter. To go on training it: --init "
                                                 ".* --lora --lora-init"),
                          (tmp_path / "target", "not a dflash2 drafter.*leave it out to train a fresh one")):
        with pytest.raises(ValueError, match=message):
            _run_train([*base, "--init", str(init)])


def test_an_interrupted_train_says_which_checkpoint_is_kept(tmp_path, monkeypatch, capsys):
    """Ctrl-C or `kill PID` (SIGTERM: the same, through dflash2_hf.cli.sigterm_as_ctrl_c) during `dflash2 train`:
    exit 130 and name the last complete checkpoint and the option that continues from it."""
    import os
    import signal

    import dflash2_hf.training
    from dflash2_hf.cli import main

    def stopped(**_):
        (tmp_path / "out" / "checkpoint-4").mkdir(parents=True)
        (tmp_path / "out" / "checkpoint-4" / "trainer_state.json").write_text("{}")
        (tmp_path / "out" / "checkpoint-4" / "model.safetensors").write_bytes(b"x")
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(dflash2_hf.training, "train", stopped)
    before = signal.getsignal(signal.SIGTERM)
    assert main(["train", "--data", str(tmp_path), "--output-dir", str(tmp_path / "out")]) == 130
    err = capsys.readouterr().err
    assert "interrupted: the last complete checkpoint is" in err and "checkpoint-4" in err
    assert "--resume-from-checkpoint last" in err
    assert signal.getsignal(signal.SIGTERM) == before  # the handler is restored
