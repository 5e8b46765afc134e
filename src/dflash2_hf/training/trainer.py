"""`transformers.Trainer` for the DFlash2 drafter (DESIGN.md section 4).

:class:`DFlash2Trainer` trains only the drafter (``fc``, ``hidden_norm``, ``layers`` with their convolutions,
``norm``, ``candidate_selector``). The target's input embedding table and LM head are FROZEN and held by the
trainer (``target_embedding``, ``target_lm_head``), not by the model: the optimizer never sees them and drafter
checkpoints never contain them.

One step: the collator's batch (see :class:`~dflash2_hf.training.collator.BlockCollator`) -> block embeddings from
the frozen target table -> one multi-block drafter forward with the block mask -> target LM head on the labelled
slots -> :func:`~dflash2_hf.training.losses.drafter_loss`. Per-slot top-1 accuracy, selector accuracy,
teacher-forced ``tau`` estimates and predicted tokens/s are accumulated between logging steps and logged through
``Trainer.log`` (console, ``trainer_state.json``, any ``report_to`` integration).

Defaults (:func:`default_training_arguments`): AdamW lr 6e-4, cosine schedule, 4% linear warm-up, grad clip 1.0,
CPU, safetensors checkpoints; ``bf16=True`` turns on CPU bfloat16 autocast (weights and optimizer stay float32).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time

import torch
from torch import nn
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import has_length

from ..modeling_dflash2 import DFlash2DraftModel
from ..quantization import refuse_int8
from .config import DFlash2TrainingArguments, default_training_arguments
from .dataset import GrowingRandomSampler
from .losses import accumulate_stats, drafter_loss, lm_head_on, summarize_stats

logger = logging.getLogger(__name__)


def unwrap_drafter(model: nn.Module) -> DFlash2DraftModel:
    """The :class:`DFlash2DraftModel` inside ``model`` (itself, or under a PEFT / DDP / compile wrapper).

    Raises:
        TypeError: no drafter inside.
    """
    seen = model
    for _ in range(8):
        if isinstance(seen, DFlash2DraftModel):
            return seen
        if hasattr(seen, "get_base_model"):
            seen = seen.get_base_model()
        elif hasattr(seen, "module"):
            seen = seen.module
        elif hasattr(seen, "_orig_mod"):
            seen = seen._orig_mod
        else:
            break
    raise TypeError(f"{type(model).__name__} is not (and does not wrap) a DFlash2DraftModel")


def freeze_target(target: nn.Module) -> tuple[torch.Tensor, nn.Module]:
    """Freezes the whole target; returns ``(input embedding weight (V, H_t), LM head module)``."""
    target.requires_grad_(False)
    target.eval()
    return target.get_input_embeddings().weight, target.get_output_embeddings()


class _CollatorReseed(TrainerCallback):
    """Re-seeds the collator's anchor RNG at train start with ``seed + global_step`` (a resumed run draws new
    anchors instead of replaying the first steps' draws), and hands the collator the epoch at every epoch start
    (records then draw their anchors from ``(seed, epoch, record_id)``: the same in any process or batch)."""

    def __init__(self, collator):
        self.collator = collator

    def on_train_begin(self, args, state, control, **kwargs):
        rng = getattr(self.collator, "rng", None)
        if rng is not None:
            rng.seed(int(getattr(self.collator, "seed", 0)) * 1_000_003 + int(state.global_step))

    def on_epoch_begin(self, args, state, control, **kwargs):
        if hasattr(self.collator, "epoch"):
            self.collator.epoch = int(state.epoch or 0)


class FollowDataCallback(TrainerCallback):
    """Grows the training set while a ``prepare-data`` job is still writing: at the start of every epoch (and
    every ``every_steps`` steps), re-reads the data folder, computes the features of the new records (at most
    ``time_budget_s`` seconds per refresh) and appends them to the dataset.

    The cache index is re-read first, so features that another process wrote meanwhile (a ``dflash2 train
    --features-only`` job on the other core) are picked up instead of computed again; with ``time_budget_s=0`` a
    refresh computes at most one record and leaves the rest to that job.

    New records are drawn from the next step on: :class:`DFlash2Trainer` samples with a
    :class:`~dflash2_hf.training.dataset.GrowingRandomSampler` (a plain random sampler would draw only the records
    there were when the epoch began).
    """

    def __init__(self, dataset, cache, target, load_records, max_length=None, every_steps=None,
                 time_budget_s=None, compute_dtype=torch.float32):
        self.dataset, self.cache, self.target = dataset, cache, target
        self.load_records = load_records
        self.max_length, self.every_steps, self.time_budget_s = max_length, every_steps, time_budget_s
        self.compute_dtype = compute_dtype

    def refresh(self) -> int:
        """Loads new records, caches their features, appends them; returns how many were added."""
        try:
            records = self.load_records()
        except Exception as err:  # a data folder being written may be briefly unreadable: try again later
            logger.warning("follow-data: could not read the data folder (%s); keeping %d sequences", err,
                           len(self.dataset))
            return 0
        self.cache.refresh()
        have = {r["record_id"]: i for i, r in enumerate(self.dataset.records)}
        new = [r for r in records if r["record_id"] not in have]
        # a record regenerated with other tokens under the same id (the data folder was rebuilt): drop the old
        # copy, it comes back with fresh features like a new record
        changed = [r for r in records if r["record_id"] in have
                   and self.dataset.records[have[r["record_id"]]]["input_ids"] != r["input_ids"]]
        if changed:
            gone = {r["record_id"] for r in changed}
            self.dataset.records = [r for r in self.dataset.records if r["record_id"] not in gone]
            new.extend(changed)
        if not new:
            return 0
        stats = self.cache.build(self.target, new, max_length=self.max_length, compute_dtype=self.compute_dtype,
                                 progress=False, time_budget_s=self.time_budget_s)
        added = self.dataset.add_records(new, self.max_length)
        logger.info("follow-data %s: +%d sequences (features for %d records, %.0f tokens/s) -> %d sequences",
                    self.cache.dir.parent.name, added, stats["computed"], stats["tokens_per_s"], len(self.dataset))
        return added

    def on_epoch_begin(self, args, state, control, **kwargs):
        if state.global_step > 0:
            self.refresh()

    def on_step_end(self, args, state, control, **kwargs):
        if self.every_steps and state.global_step % self.every_steps == 0:
            self.refresh()


class DFlash2Trainer(Trainer):
    """Trainer of a DFlash2 drafter against a frozen target.

    Args:
        model: the drafter (:class:`~dflash2_hf.DFlash2DraftModel`, or a PEFT wrapper of one).
        args: :class:`DFlash2TrainingArguments` (see :func:`default_training_arguments`).
        target: the target model; only its input embeddings and LM head are used (frozen). Alternatively pass
            ``target_embedding`` ``(V, H_t)`` and ``target_lm_head`` directly.
        train_dataset / data_collator: usually a :class:`~dflash2_hf.training.dataset.FeatureDataset` and a
            :class:`~dflash2_hf.training.collator.BlockCollator`.
        online_features: an :class:`~dflash2_hf.training.online.OnlineFeatures` (with a
            :class:`~dflash2_hf.training.online.RecordDataset`): the target's features are computed in the training
            step (``compute_loss``) and in ``evaluate`` instead of read from a cache.
        Other keyword arguments go to ``transformers.Trainer``.

    Raises:
        ValueError: neither ``target`` nor both frozen parts were given, or their sizes do not match the drafter.
    """

    loss_is_scaled_for_ga = False  # compute_loss returns a per-batch mean

    def __init__(self, model=None, args=None, target=None, target_embedding=None, target_lm_head=None,
                 online_features=None, **kwargs):
        if target is not None:
            target_embedding, target_lm_head = freeze_target(target)
        if target_embedding is None or target_lm_head is None:
            raise ValueError("DFlash2Trainer needs `target` (or both `target_embedding` and `target_lm_head`).")
        drafter = unwrap_drafter(model)
        refuse_int8(drafter, "trained")
        cfg = drafter.config
        if target_embedding.shape[-1] != cfg.target_hidden_size or target_lm_head.weight.shape[0] != cfg.vocab_size:
            raise ValueError(
                f"Target embedding {tuple(target_embedding.shape)} / LM head {tuple(target_lm_head.weight.shape)} do "
                f"not match the drafter (target_hidden_size={cfg.target_hidden_size}, vocab_size={cfg.vocab_size})."
            )
        target_lm_head.requires_grad_(False)
        self.target_embedding = target_embedding.detach()
        self.target_lm_head = target_lm_head
        if args is None:
            args = default_training_arguments("dflash2-drafter")
        self.online_features = online_features  # an OnlineFeatures: the target runs in compute_loss
        self.block_collator = kwargs.get("data_collator")
        if online_features is not None:
            from .online import defer_collation

            kwargs["data_collator"] = defer_collation
        super().__init__(model=model, args=args, **kwargs)
        self.model_accepts_loss_kwargs = False
        if self.block_collator is not None and hasattr(self.block_collator, "rng"):
            self.add_callback(_CollatorReseed(self.block_collator))
        self._train_stats = None
        self._stats_t0 = time.time()

    def create_optimizer(self, model=None):
        """The Trainer's optimizer; with ``modules_to_save_learning_rate``, a LoRA adapter's fully trained modules get
        their own parameter groups at that rate (the schedule scales every group alike)."""
        fresh = self.optimizer is None  # the Trainer builds it once and hands back the same one after
        optimizer = super().create_optimizer(model)
        rate = self.args.modules_to_save_learning_rate
        if rate is None or not fresh:
            return optimizer
        names = {id(p): n for n, p in (self.model if model is None else model).named_parameters()}
        split = []
        for group in optimizer.param_groups:
            full = [p for p in group["params"] if ".modules_to_save." in names.get(id(p), "")]
            if full:
                group["params"] = [p for p in group["params"] if ".modules_to_save." not in names.get(id(p), "")]
                split.append({**group, "params": full, "lr": rate, "initial_lr": rate})
        for group in split:  # the optimizer holds no state yet: moving parameters between groups is safe
            optimizer.add_param_group(group)
        return optimizer

    def _get_train_sampler(self, train_dataset=None):
        """The Trainer's random order, made to also draw records appended while an epoch runs (``--follow-data``);
        any other ``train_sampling_strategy`` (e.g. ``group_by_length``) is left to the Trainer."""
        dataset = self.train_dataset if train_dataset is None else train_dataset
        if dataset is None or not has_length(dataset) or self.args.train_sampling_strategy != "random":
            return super()._get_train_sampler(train_dataset)
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        return GrowingRandomSampler(dataset, seed=seed)

    # ------------------------------------------------------------------ loss
    def autocast_smart_context_manager(self, cache_enabled: bool | None = True):
        """bfloat16 autocast when ``args.bf16``, around the whole loss: accelerate's autocast wraps only
        ``model.forward``, and the LM head and the selector live outside it."""
        if self.args.bf16:
            return torch.autocast(device_type=self.args.device.type, dtype=torch.bfloat16, cache_enabled=cache_enabled)
        return contextlib.nullcontext()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Weighted block cross entropy + weighted selector loss (see :func:`~dflash2_hf.training.losses.drafter_loss`).

        ``inputs`` is a :class:`~dflash2_hf.training.collator.BlockCollator` batch.
        """
        if "online_items" in inputs:  # the frozen target runs now, then the blocks are drawn (no grad reaches it)
            inputs = self._prepare_inputs(self.block_collator(self.online_features(inputs["online_items"])))
        drafter = unwrap_drafter(model)
        embed_w = self.target_embedding
        if embed_w.device != inputs["block_input_ids"].device:
            embed_w = self.target_embedding = embed_w.to(inputs["block_input_ids"].device)
        embeds = drafter.embed_block(inputs["block_input_ids"], embed_w)
        self.target_lm_head = lm_head_on(self.target_lm_head, embeds.device)
        out = model(
            noise_embeds=embeds,
            context_hidden_states=inputs["context_hidden_states"],
            position_ids=inputs["position_ids"],
            attention_mask=inputs["attention_mask"],
        )
        res = drafter_loss(
            drafter,
            out.last_hidden_state,
            inputs["labels"],
            inputs["predecessor_ids"],
            self.target_lm_head,
            drafter.config.block_size,
            gamma=self.args.loss_gamma if isinstance(self.args, DFlash2TrainingArguments) else None,
            selector_weight=getattr(self.args, "selector_loss_weight", 1.0),
            selector_detach=getattr(self.args, "selector_detach", True),
            soft_logits=inputs.get("soft_logits"),
            soft_ids=inputs.get("soft_ids"),
            distill_weight=getattr(self.args, "distill_weight", 0.0) or 0.0,
            previous_block=inputs.get("previous_block"),
            post_miss_weight=getattr(self.block_collator, "post_miss_weight", 1.0),
        )
        if model.training:
            self._train_stats = accumulate_stats(self._train_stats, res.stats)
        return (res.loss, {"last_hidden_state": out.last_hidden_state, "stats": res.stats}) if return_outputs else res.loss

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Teacher-forced block metrics on ``eval_dataset`` (default: the trainer's), same blocks every time; computed
        and logged by the main process only (other ranks return ``{}``; the drafter is read unwrapped, no collective).

        Logs and returns ``{prefix}_acc_slot_j``, ``{prefix}_tau_top1``, ``{prefix}_tau_selector``,
        ``{prefix}_ce_loss``, ... (see :func:`~dflash2_hf.training.evaluate.evaluate_blocks`).

        Raises:
            ValueError: no evaluation dataset.
        """
        from .evaluate import evaluate_blocks

        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("DFlash2Trainer.evaluate needs an eval_dataset")
        if not self.is_world_process_zero():
            return {}
        if self.online_features is not None:
            from .online import WithOnlineFeatures

            dataset = WithOnlineFeatures(dataset, self.online_features)
        drafter = unwrap_drafter(self.model)
        metrics = evaluate_blocks(
            drafter, self.target_embedding, self.target_lm_head, dataset, self.block_collator,
            batch_size=self.args.per_device_eval_batch_size,
            gamma=self.args.loss_gamma if isinstance(self.args, DFlash2TrainingArguments) else None,
        )
        metrics.pop("labels", None)
        metrics = {f"{metric_key_prefix}_{k}": v for k, v in metrics.items()}
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    # ------------------------------------------------------------------ logging
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Adds the accumulated drafter metrics (per-slot accuracy ``acc_slot_j``, ``acc_top1``, ``acc_selector``,
        ``topk_recall``, ``tau_top1``, ``tau_selector``, ``ce_loss``, ``selector_loss``) and ``pred_tokens_per_s``
        to the training logs."""
        if self._train_stats is not None and "loss" in logs:
            summary = summarize_stats(self._train_stats)
            elapsed = time.time() - self._stats_t0
            if summary.get("labels") and elapsed > 0:
                summary["pred_tokens_per_s"] = round(summary["labels"] / elapsed, 1)
            summary.pop("labels", None)
            logs.update(summary)
            self._train_stats = None
            self._stats_t0 = time.time()
        super().log(logs, start_time)

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        """Saves the drafter only (safetensors); asserts no target weight slipped into the state dict."""
        names = state_dict.keys() if state_dict is not None else self.model.state_dict().keys()
        bad = [k for k in names if "embed_tokens" in k or "lm_head" in k]
        if bad:
            raise RuntimeError(f"target weights would be saved into a drafter checkpoint: {bad[:4]}")
        super()._save(output_dir, state_dict=state_dict)
        from peft import PeftModel

        if isinstance(self.model, PeftModel) and self.args.should_save:  # LoRA checkpoints carry the base fingerprint
            # (the Trainer calls _save on every rank; only the main process writes)
            from ..lora import write_fingerprint

            write_fingerprint(self.model, output_dir or self.args.output_dir)


def write_summary(output_dir: str, trainer: DFlash2Trainer, extra: dict | None = None) -> str:
    """Writes ``training_summary.json`` (last logged metrics, steps, extra info) into ``output_dir``; returns its path."""
    hist = trainer.state.log_history
    last = {}
    for entry in hist:
        if "loss" in entry or "train_loss" in entry:
            last.update(entry)
    summary = {"global_step": trainer.state.global_step, "world_size": trainer.args.world_size, "last_metrics": last,
               **(extra or {})}
    path = os.path.join(output_dir, "training_summary.json")
    with open(path, "w") as f:
        json.dump(summary, f, indent=2, sort_keys=True, default=str)
    return path


__all__ = [
    "DFlash2Trainer",
    "DFlash2TrainingArguments",
    "FollowDataCallback",
    "default_training_arguments",
    "freeze_target",
    "unwrap_drafter",
    "write_summary",
]
