"""One function that runs a drafter training: :func:`train` (what ``dflash2 train`` calls).

Steps: seed -> load the target (main process first: it may convert and cache it) -> build (or resume) the drafter ->
the training records -> their target features (``features="cache"``: computed once by the main process, stored,
read by every rank; ``"online"``: nothing stored, the target runs in each training step) -> ``transformers.Trainer``
(DDP when launched by ``torchrun`` / ``accelerate launch``: each rank trains on its own shard of every global batch,
the main process logs, evaluates and writes checkpoints) -> the final drafter (or LoRA adapter) in ``output_dir``
with ``training_summary.json`` (``world_size`` included).

Example::

    from dflash2_hf.training import DataArguments, DrafterArguments, FeatureArguments, default_training_arguments, train

    train(DataArguments(data="dataset_cards/smollm2-135m-instruct-code-validation", max_length=256),
          default_training_arguments("runs/x", max_steps=100),
          drafter=DrafterArguments(num_layers=1), features=FeatureArguments(features="online"))
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import os
import sys
import time

import torch

from .build import build_drafter, check_draft_vocab, check_init, check_lora_init, choose_draft_vocab, wrap_model
from .config import (
    DataArguments,
    DFlash2TrainingArguments,
    DrafterArguments,
    FeatureArguments,
    LoraArguments,
    check_output_dir,
    check_run,
)
from .records import default_features_root, is_code_folder, keep_code, last_complete_checkpoint, load_eval_records

logger = logging.getLogger(__name__)


def resolve_resume(training_args: DFlash2TrainingArguments) -> str | None:
    """The checkpoint to resume from: ``resume_from_checkpoint`` = ``"last"`` (or ``"true"``) -> the newest complete
    ``checkpoint-N`` of ``output_dir`` (None, with a warning, when there is none yet); a folder -> that folder."""
    spec = training_args.resume_from_checkpoint
    if spec is None or str(spec).lower() in ("", "false", "no"):
        return None
    if str(spec).lower() in ("last", "true", "yes"):
        found = last_complete_checkpoint(training_args.output_dir)
        if found is None:
            logger.warning("--resume-from-checkpoint %s: no checkpoint in %s yet, starting fresh", spec,
                           training_args.output_dir)
        return found
    if not os.path.isdir(spec):
        raise ValueError(f"--resume-from-checkpoint {spec}: no such checkpoint folder (or pass `last`)")
    return spec


class _Run:
    """What the steps of one run share (configs, target, device, progress bars)."""

    def __init__(self, data, features, training_args, target, layer_ids):
        self.data, self.features, self.args = data, features, training_args
        self.target, self.layer_ids = target, layer_ids
        self.online = None
        if features.features == "online":
            from .online import OnlineFeatures

            self.online = OnlineFeatures(target, layer_ids, target_labels=features.target_labels,
                                         topk=features.distill_topk)
        self.progress = not training_args.disable_tqdm and sys.stderr.isatty()
        self.budget = None if features.feature_time_budget is None else features.feature_time_budget * 60

    def dataset(self, records: list[dict], root: str, what: str):
        """A training / evaluation dataset of ``records``: cached features (built by the main process first) or
        online ones (a :class:`~.online.RecordDataset`)."""
        if self.online is not None:
            from .online import RecordDataset

            return RecordDataset(records, max_length=self.data.max_length)
        from .dataset import FeatureDataset
        from .features import FeatureCache

        with self.args.main_process_first(desc=f"target features of {what}"):  # built once, read by every rank
            cache = FeatureCache(root, self.data.target, self.layer_ids, with_next=self.features.target_labels,
                                 topk=self.features.distill_topk)
            stats = cache.build(self.target, records, max_length=self.data.max_length,
                                compute_dtype=self.features.compute_dtype(), progress=self.progress,
                                time_budget_s=self.budget)
        logger.info("features of %s: %d records computed (%d tokens, %.0f tokens/s), %d cached in %s", what,
                    stats["computed"], stats["tokens"], stats["tokens_per_s"], stats["cached"], cache.dir)
        return FeatureDataset(records, cache, max_length=self.data.max_length,
                              target_labels=self.features.target_labels)

    def cache_root(self, data_dir: str, k: int) -> str:
        fdir = self.features.features_dir
        if k == 0:
            return fdir or default_features_root(data_dir)
        return os.path.join(fdir, f"extra-{k}") if fdir else default_features_root(data_dir)

    def eval_root(self) -> str:
        fdir = self.features.features_dir
        return os.path.join(fdir, "eval") if fdir else default_features_root(self.data.eval_data)


def _setup(data: DataArguments, features: FeatureArguments, training_args: DFlash2TrainingArguments) -> torch.device:
    """Logging per process, threads, ``auto`` precision; returns the training device (this rank's)."""
    from ..generation.precision import bf16_support

    device = training_args.device  # sets up the process group under torchrun / accelerate launch
    level = logging.INFO if training_args.should_log else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("dflash2_hf").setLevel(level)
    if data.device != "auto" and torch.device(data.device).type != device.type:
        raise ValueError(f"device={data.device!r} but the Trainer trains on {device}: set use_cpu to match")
    if data.num_threads:
        torch.set_num_threads(data.num_threads)
    if features.feature_dtype == "auto":
        native, reason = bf16_support(device)
        features.feature_dtype = "bfloat16" if native else "float32"
        logger.info("features in %s (auto: %s)", features.feature_dtype, reason)
    return device


def _frozen_parts(target, online: bool):
    """The target's input embedding and LM head for the loss, in float32 (copies when the target runs in bf16)."""
    from .trainer import freeze_target

    emb, head = freeze_target(target)
    if online and emb.dtype != torch.float32:
        emb, head = emb.float(), copy.deepcopy(head).float()
    return emb, head


def _eval_only(run: _Run, drafter, lora: LoraArguments, tokenizer, resume_from: str | None, block_collator) -> dict:
    from . import evaluate_blocks

    if lora.lora:  # evaluate the trained adapter (from the resumed checkpoint, else the finished output) on --init
        from ..lora import load_adapter

        adapter = resume_from or run.args.output_dir
        if not os.path.isfile(os.path.join(adapter, "adapter_config.json")):
            raise FileNotFoundError(f"--eval-only --lora: no trained adapter in {adapter!r} (adapter_config.json); "
                                    "pass the --output-dir of a finished `dflash2 train --lora` run, or resume")
        drafter = load_adapter(drafter, adapter).eval()
    dataset = run.dataset(load_eval_records(run.data, tokenizer), run.eval_root(), run.data.eval_data)
    if run.online is not None:
        from .online import WithOnlineFeatures

        dataset = WithOnlineFeatures(dataset, run.online)
    emb, head = _frozen_parts(run.target, run.online is not None)
    metrics = evaluate_blocks(drafter, emb, head, dataset, block_collator, gamma=run.args.loss_gamma)
    if run.args.should_save:
        print(json.dumps(metrics, indent=2))
    return metrics


def train(data: DataArguments, training_args: DFlash2TrainingArguments, drafter: DrafterArguments | None = None,
          lora: LoraArguments | None = None, features: FeatureArguments | None = None) -> dict:
    """Trains a drafter (or a LoRA adapter of one) as configured; returns the run's summary (on every rank; the main
    process also writes it to ``output_dir/training_summary.json``). ``eval_only``: returns the metrics instead.

    Raises:
        ValueError: configs that cannot run together (checked before the target is loaded), or no training data.
    """
    from ..targets import load_target
    from . import BlockCollator, DFlash2Trainer, FollowDataCallback, GrowingConcatDataset, load_training_records

    drafter, lora, features = drafter or DrafterArguments(), lora or LoraArguments(), features or FeatureArguments()
    device = _setup(data, features, training_args)
    training_args.distill_weight = check_run(data, features, drafter, lora, training_args)
    check_init(drafter.init)
    check_lora_init(lora, drafter.init)
    t_start = time.time()
    resume_from = resolve_resume(training_args)
    check_output_dir(training_args, resume_from, data, features)
    if training_args.overwrite_output_dir and resume_from is None and training_args.process_index == 0 \
            and not (data.eval_only or features.features_only) and os.path.isdir(training_args.output_dir):
        import shutil  # replaced as a whole: an old checkpoint left there would be what `resume ... last` picks

        logger.info("--overwrite-output-dir: emptying %s", training_args.output_dir)
        shutil.rmtree(training_args.output_dir)
    online = features.features == "online"
    with training_args.main_process_first(desc="target"):  # a first load may convert and cache it
        target, tokenizer = load_target(data.target, dtype=features.compute_dtype() if online else torch.float32,
                                        device=device)
    from transformers import set_seed

    set_seed(training_args.seed)  # the same fresh drafter on every rank
    model = build_drafter(drafter, target, resume_from, lora=lora.lora).to(device)
    cfg = model.config
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("drafter: %d layers, B=%d, target layers %s, %.1fM parameters%s; features %s; %d process(es)",
                cfg.num_hidden_layers, cfg.block_size, cfg.target_layer_ids, n_params / 1e6,
                f" (resumed from {resume_from})" if resume_from else "", features.features, training_args.world_size)
    check_draft_vocab(drafter.draft_vocab, model)
    run = _Run(data, features, training_args, target, cfg.target_layer_ids)
    block_collator = BlockCollator(
        block_size=cfg.block_size, mask_token_id=cfg.mask_token_id, num_blocks=data.num_blocks,
        max_length=data.max_length, seed=training_args.seed, early_anchor_tokens=data.early_anchor_tokens,
        early_anchor_weight=data.early_anchor_weight, post_miss_weight=data.post_miss_weight)
    if data.eval_only:
        return _eval_only(run, model, lora, tokenizer, resume_from, block_collator)

    def load_records():
        recs = load_training_records(data.data, max_records=data.max_records)
        return keep_code(data.only_code, tokenizer, data.data, recs)[0]

    parts, all_ids, all_records = [], set(), []
    for k, data_dir in enumerate([data.data, *data.extra_data]):
        recs = load_records() if k == 0 else load_training_records(data_dir, max_records=data.max_records)
        if k == 0 and data.only_code:
            logger.info("--only-code: %d records %s", len(recs), "(a prepare-data --only-code folder, all kept)"
                        if is_code_folder(data.data) else "with a fenced code block")
        all_ids |= {r["record_id"] for r in recs}
        all_records += recs
        part = run.dataset(recs, run.cache_root(data_dir, k), data_dir)
        logger.info("training data from %s: %d sequences, %d context tokens, %d response tokens (%d records left "
                    "out)", data_dir, len(part), part.num_tokens(), part.num_response_tokens(), part.skipped)
        parts.append(part)
    if features.features_only:
        return {"feature_cache": [str(p.cache.dir) for p in parts]}
    if drafter.draft_vocab is not None and resume_from is None:  # a resumed checkpoint already holds the chosen one
        choose_draft_vocab(drafter.draft_vocab, model, all_records)
    train_set = parts[0] if len(parts) == 1 else GrowingConcatDataset(parts)
    if len(train_set) == 0:
        raise ValueError("no training sequence " + ("has cached features" if not online else "has 2 response "
                                                    "tokens within --max-length") + ": nothing to train on")
    eval_dataset = None
    if data.eval_data:
        eval_records = load_eval_records(data, tokenizer)
        if any(r["record_id"] in all_ids for r in eval_records):
            raise ValueError("--eval-data shares record ids with --data: evaluation must use held-out records")
        eval_dataset = run.dataset(eval_records, run.eval_root(), data.eval_data)
        logger.info("evaluation data: %d held-out sequences", len(eval_dataset))
        from transformers.trainer_utils import IntervalStrategy

        training_args.eval_strategy = IntervalStrategy.STEPS
    trained = wrap_model(model, lora)
    if lora.lora:
        n_train = sum(p.numel() for p in trained.parameters() if p.requires_grad)
        logger.info("LoRA: %.2fM trainable adapter parameters (the %.1fM of the base drafter are frozen)",
                    n_train / 1e6, n_params / 1e6)
    emb, head = _frozen_parts(target, online)
    trainer = DFlash2Trainer(model=trained, args=training_args, target_embedding=emb, target_lm_head=head,
                             online_features=run.online, train_dataset=train_set, eval_dataset=eval_dataset,
                             data_collator=block_collator)
    if data.follow_data:  # every part: --data gains new records, every part gains features cached meanwhile
        loaders = [load_records, *(functools.partial(load_training_records, d, max_records=data.max_records)
                                   for d in data.extra_data)]
        for part, loader in zip(parts, loaders):
            trainer.add_callback(FollowDataCallback(
                part, part.cache, target, load_records=loader, max_length=data.max_length,
                every_steps=data.follow_every, time_budget_s=run.budget, compute_dtype=features.compute_dtype()))
    main = trainer.is_world_process_zero()
    if main:
        os.makedirs(training_args.output_dir, exist_ok=True)
        with open(os.path.join(training_args.output_dir, "train_command.json"), "w") as f:
            flat = {**training_args.to_dict(), **vars(data), **vars(features), **vars(drafter), **vars(lora)}
            json.dump({"argv": sys.argv, "args": flat, "threads": torch.get_num_threads(),
                       "world_size": training_args.world_size}, f, indent=2, default=str)
    result = trainer.train(resume_from_checkpoint=resume_from)
    trainer.save_model(training_args.output_dir)
    if lora.lora and main:  # save_model wrote the adapter files and their fingerprint (DFlash2Trainer._save)
        _finish_adapter(trainer, lora, drafter.init, training_args.output_dir)
    final_eval = trainer.evaluate() if eval_dataset is not None else {}
    summary = {
        "train_runtime_s": result.metrics.get("train_runtime"), "wall_s": round(time.time() - t_start, 1),
        "sequences": len(train_set), "features": features.features, "resumed_from": resume_from,
        "feature_cache": None if online else [str(p.cache.dir) for p in parts], "final_eval": final_eval,
    }
    if main:
        from .trainer import write_summary

        path = write_summary(training_args.output_dir, trainer, summary)
        logger.info("saved the %s to %s (summary: %s)", "LoRA adapter" if lora.lora else "drafter",
                    training_args.output_dir, path)
    return {"global_step": trainer.state.global_step, "world_size": training_args.world_size, **summary}


def _finish_adapter(trainer, lora: LoraArguments, init: str, output_dir: str) -> None:
    from ..lora import adapter_size_bytes, checkpoint_size_bytes, save_adapter

    if lora.lora_save_dtype == "bf16":
        save_adapter(trainer.model, output_dir, dtype=torch.bfloat16)
    base_bytes = checkpoint_size_bytes(init) if os.path.isdir(init) else None
    logger.info("adapter: %.2f MB%s", adapter_size_bytes(output_dir) / 1e6,
                f" = {100 * adapter_size_bytes(output_dir) / base_bytes:.1f}% of the base drafter's "
                f"{base_bytes / 1e6:.1f} MB" if base_bytes else "")


__all__ = ["resolve_resume", "train"]
