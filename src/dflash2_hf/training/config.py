"""Typed configuration of a drafter training run: what :func:`dflash2_hf.training.train` takes.

Four plain dataclasses say WHAT is trained on WHAT (:class:`DataArguments`, :class:`FeatureArguments`,
:class:`DrafterArguments`, :class:`LoraArguments`); the optimisation settings ARE ``transformers.TrainingArguments``
(:class:`DFlash2TrainingArguments` adds only the drafter loss settings and re-declares none of its fields). Field
names are unique across the five classes, so one flat YAML / JSON file or one command line fills them all
(:mod:`dflash2_hf.training.parser`, ``dflash2 train``).

The recipe's optimisation defaults (:data:`RECIPE_DEFAULTS`: AdamW 6e-4, cosine, 4% warm-up, one epoch, seed 0,
...) differ from ``TrainingArguments``' own; :func:`default_training_arguments` and the parser apply them, a plain
``DFlash2TrainingArguments(...)`` keeps transformers' defaults.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Literal

import torch
from transformers import TrainingArguments

# TrainingArguments defaults that the DFlash recipe changes (DESIGN.md section 4); the parser sets them as its
# defaults, so a command line or a config file still overrides each of them
RECIPE_DEFAULTS = dict(
    learning_rate=6e-4,
    lr_scheduler_type="cosine",
    warmup_steps=0.04,  # < 1: a ratio of the steps
    max_grad_norm=1.0,
    optim="adamw_torch",
    weight_decay=0.0,
    num_train_epochs=1.0,
    per_device_train_batch_size=1,
    per_device_eval_batch_size=1,
    logging_steps=10,
    logging_first_step=True,
    save_steps=100,
    save_total_limit=3,
    eval_steps=200,
    report_to="none",
    remove_unused_columns=False,  # the collator needs every item field
    dataloader_num_workers=0,  # online features run the target in the training process
    dataloader_pin_memory=torch.cuda.is_available(),  # pinned host memory speeds up the feature copies to a GPU
    # every drafter parameter gets a gradient every step (drafter_loss adds 0 * the selector loss when it is off), and
    # the loss reads the selector outside DDP's forward: the unused-parameter search would mark it ready twice
    ddp_find_unused_parameters=False,
    use_cpu=not torch.cuda.is_available(),  # on a CPU-only machine: torchrun / accelerate then run CPU DDP (gloo)
    seed=0,
)


@dataclass
class DataArguments:
    """Which records train and evaluate the drafter, and against which target."""

    _argument_group_name = "data and target"

    target: str = field(default="smollm2", metadata={"help": "target alias (smollm2, gemma3-270m) or a transformers "
                                                              "folder"})
    data: str | None = field(default=None, metadata={"help": "dataset folder (dflash2 prepare-data --output-dir, or a "
                                                             "committed one under dataset_cards/); required"})
    extra_data: list[str] = field(default_factory=list, metadata={
        "action": "append", "metavar": "DIR",
        "help": "another dataset folder trained together with --data (repeatable), e.g. original-answer records "
                "next to regenerated ones"})
    max_length: int = field(default=1024, metadata={"help": "longest context per sequence (tokens)"})
    max_records: int | None = field(default=None, metadata={"help": "use the first N records (by record_id)"})
    only_code: bool = field(default=False, metadata={
        "help": "train (and evaluate) only on records whose conversation holds a fenced code block; a folder made "
                "by prepare-data --only-code is used whole"})
    num_blocks: int = field(default=32, metadata={"help": "blocks (anchors) sampled per sequence per pass"})
    early_anchor_tokens: int = field(default=96, metadata={
        "metavar": "N", "help": "with --early-anchor-weight: the first N tokens of each response count as early"})
    early_anchor_weight: float = field(default=1.0, metadata={
        "metavar": "W", "help": "an anchor among the early tokens of its response is W times as likely to be drawn "
                                "as a later one (1: uniform)"})
    post_miss_weight: float = field(default=1.0, metadata={
        "metavar": "W", "help": "draw anchors in adjacent pairs and weigh a block W times when the drafter missed its "
                                "anchor token from the position before (the anchors serving lands on after a "
                                "rejection; 1: off)"})
    eval_data: str | None = field(default=None, metadata={
        "help": "held-out dataset folder (its dev split): teacher-forced per-slot accuracy and tau estimates on it "
                "are logged as eval_* every --eval-steps"})
    eval_max_records: int = field(default=100, metadata={"help": "evaluate on the first N held-out records"})
    eval_only: bool = field(default=False, metadata={
        "help": "only evaluate (needs --eval-data) the drafter given by --init or by --resume-from-checkpoint; "
                "prints the metrics as JSON"})
    follow_data: bool = field(default=False, metadata={
        "help": "keep picking up the shards a still-running prepare-data job completes in --data (and features another "
                "--features-only job caches), at every epoch start and every --follow-every steps (cached "
                "features, one process)"})
    follow_every: int | None = field(default=None, metadata={"help": "with --follow-data: also refresh every N steps"})
    device: str = field(default="auto", metadata={
        "metavar": "{auto,cpu,cuda,cuda:0}",
        "help": "where the target and the training run (auto: the GPU when torch sees one; under torchrun each "
                "rank takes its own GPU)"})
    num_threads: int | None = field(default=None, metadata={"aliases": ["--threads"], "metavar": "N",
                                                            "help": "torch CPU threads per process"})

    def __post_init__(self):
        # --extra-data A B and --extra-data A --extra-data B both give a flat list
        self.extra_data = [d for part in self.extra_data for d in ([part] if isinstance(part, str) else part)]
        if self.follow_every is not None and not self.follow_data:
            raise ValueError("--follow-every needs --follow-data")
        if self.eval_only and not self.eval_data:
            raise ValueError("--eval-only needs --eval-data")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"--num-threads must be >= 1, got {self.num_threads} (leave it out for torch's default)")
        if self.early_anchor_weight <= 0 or self.post_miss_weight <= 0:
            raise ValueError(f"--early-anchor-weight and --post-miss-weight must be > 0 (1: off), got "
                             f"{self.early_anchor_weight} and {self.post_miss_weight}")


@dataclass
class FeatureArguments:
    """Where the target's context features (and labels) come from: a disk cache, or the target in the training step."""

    _argument_group_name = "target features"

    features: Literal["cache", "online"] = field(default="cache", metadata={
        "help": "cache: compute every record's target features once, store them on disk, reuse them in every "
                "epoch and run (small targets); online: run the frozen target inside each training step (no "
                "grad, nothing stored; targets whose features do not fit a disk)"})
    features_dir: str | None = field(default=None, metadata={
        "help": "feature cache root (default: $DFLASH2_CACHE/features/<name of DATA>)"})
    feature_dtype: Literal["auto", "float32", "bfloat16"] = field(default="float32", metadata={
        "help": "dtype of the target forward that computes the features (stored / handed on as bfloat16 either "
                "way); auto = bfloat16 where the device computes it natively. With --features online the target "
                "is loaded in it"})
    feature_time_budget: float | None = field(default=None, metadata={
        "help": "stop computing cached features after this many minutes (per data folder) and train on what is "
                "cached"})
    features_only: bool = field(default=False, metadata={"help": "fill the feature cache and exit"})
    target_labels: bool = field(default=False, metadata={
        "help": "label every slot with the target's own greedy token and train a slot only while the text agrees "
                "with the target before it (needed for prepare-data --original-answers folders)"})
    distill_topk: int = field(default=0, metadata={
        "metavar": "K", "help": "also take the target's K largest next-token logits and distil them (see "
                                "--distill-weight)"})

    def __post_init__(self):
        if self.distill_topk < 0:
            raise ValueError(f"--distill-topk must be >= 0, got {self.distill_topk}")
        if self.features == "online":
            bad = [n for n, v in (("--features-only", self.features_only), ("--features-dir", self.features_dir),
                                  ("--feature-time-budget", self.feature_time_budget)) if v]
            if bad:
                raise ValueError(f"{', '.join(bad)}: options of the feature cache; --features online stores nothing")

    def compute_dtype(self) -> torch.dtype:
        """The resolved ``feature_dtype`` (call :func:`resolve_auto_precision` first for ``auto``)."""
        if self.feature_dtype == "auto":
            raise ValueError("feature_dtype 'auto' is not resolved yet (resolve_auto_precision)")
        return getattr(torch, self.feature_dtype)


@dataclass
class DrafterArguments:
    """The drafter: a fresh one sized for the target, or ``init``'s."""

    _argument_group_name = "drafter"

    init: str | None = field(default=None, metadata={"help": "start from this drafter (folder or Hub id) instead of "
                                                             "a fresh one"})
    num_layers: int = field(default=5, metadata={"help": "drafter decoder layers (fresh drafter)"})
    block_size: int = field(default=16, metadata={"help": "B: anchor + B-1 draft slots (fresh drafter)"})
    target_layer_ids: str | None = field(default=None, metadata={"help": "comma-separated target layers (default: "
                                                                         "spread)"})
    mask_token_id: int | None = field(default=None, metadata={"help": "mask token id (default: pad / unk / last id)"})
    selector_top_k: int | None = field(default=None, metadata={
        "metavar": "K", "help": "candidates per draft position the selector chooses among (with --init: changes it)"})
    selector_rank: int | None = field(default=None, metadata={
        "metavar": "R", "help": "rank of the selector's codebooks (with --init: a new selector of this rank, which "
                                "starts as the top-1 path)"})
    train_only: Literal["all", "selector", "new-layers"] = field(default="all", metadata={
        "help": "selector: train only the candidate selector of the --init drafter, everything else frozen (steps "
                "~2-3x cheaper; the top-1 path stays exactly as it was); new-layers: train only the layers added by "
                "--grow-layers and the selector"})
    grow_layers: int | None = field(default=None, metadata={
        "metavar": "N", "help": "insert N new decoder layers into the --init drafter, spread evenly, each a copy of "
                                "the layer before it with its output projections zeroed: the drafter starts exactly "
                                "where it was and trains the extra depth (LLaMA Pro block expansion)"})
    no_conv: bool = field(default=False, metadata={"help": "fresh drafter without the local convolutions"})
    no_selector: bool = field(default=False, metadata={"help": "fresh drafter without the candidate selector"})
    layer_types: str | None = field(default=None, metadata={
        "metavar": "TYPES", "help": "fresh drafter: attention per layer, comma-separated full / sliding"})
    sliding_window: int | None = field(default=None, metadata={"metavar": "N", "help": "window of the sliding layers"})
    causal: Literal["auto", "yes", "no"] = field(default="auto", metadata={
        "help": "fresh drafter: every layer causal (yes), bidirectional (no), or sliding layers causal and full "
                "ones bidirectional (auto)"})
    init_layers_from_target: Literal["first", "last", "spread"] | None = field(default=None, metadata={
        "help": "fresh drafter: copy these target decoder layers into the drafter layers"})
    init_norm: float | None = field(default=None, metadata={"help": "fresh drafter: initial final-norm weight"})
    init_norm_from_target: bool = field(default=False, metadata={"help": "fresh drafter: copy the target's final "
                                                                         "norm weight"})
    draft_vocab: int | None = field(default=None, metadata={
        "metavar": "N", "help": "(re)choose the draft vocabulary: the N most frequent response tokens of the "
                                "training data (plus EOS)"})


@dataclass
class LoraArguments:
    """A LoRA adapter on the ``--init`` drafter instead of training all its weights (see :mod:`dflash2_hf.lora`)."""

    _argument_group_name = "LoRA (adapt a trained drafter)"

    lora: bool = field(default=False, metadata={"help": "train a LoRA adapter on the drafter given by --init; "
                                                        "--output-dir then holds only the adapter"})
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_target_modules: str | None = field(default=None, metadata={
        "help": "comma-separated module names (default: q/k/v/o and gate/up/down projections)"})
    lora_modules_to_save: str | None = field(default=None, metadata={
        "metavar": "NAMES", "help": "comma-separated module names trained in full next to the LoRA layers and "
                                    "saved in the adapter (peft's modules_to_save)"})
    lora_init: str | None = field(default=None, metadata={"metavar": "ADAPTER", "help": "start from this adapter "
                                                                                       "of the --init drafter"})
    lora_save_dtype: Literal["fp32", "bf16"] = field(default="fp32", metadata={"help": "precision of the saved "
                                                                                      "adapter"})

    def __post_init__(self):
        if self.lora:
            return
        # every other field shapes the adapter: one set away from its default without --lora would be ignored
        changed = ["--" + f.name.replace("_", "-") for f in fields(self)
                   if f.name != "lora" and getattr(self, f.name) != f.default]
        if changed:
            raise ValueError(f"{' / '.join(changed)} shape{'s' if len(changed) == 1 else ''} a LoRA adapter and "
                             "would be ignored without --lora: add --lora (and --init PATH_OR_ID), or drop "
                             f"{'it' if len(changed) == 1 else 'them'}.")


@dataclass
class DFlash2TrainingArguments(TrainingArguments):
    """``TrainingArguments`` plus the drafter loss settings (every inherited field keeps its transformers name).

    Args:
        loss_gamma (`float`, *optional*): slot-weight decay; default from the block size (7 @ 16, 5 @ 10, 4 @ 8).
        selector_loss_weight (`float`): weight of the selector loss (0 = train the drafter only).
        selector_detach (`bool`): train the selector on detached drafter hidden states / logits.
        distill_weight (`float`, *optional*): share of the distillation term in the block loss (needs the target's
            top-k logits, ``distill_topk``); ``None``: 0.5 with ``distill_topk``, else 0.
        modules_to_save_learning_rate (`float`, *optional*): learning rate of the modules a LoRA adapter trains in
            full (peft ``modules_to_save``), when it should differ from ``learning_rate`` (the LoRA layers').
        overwrite_output_dir (`bool`): train into an ``output_dir`` that already holds files when not resuming:
            the folder is emptied first (:func:`check_output_dir`).
    """

    loss_gamma: float | None = field(default=None, metadata={"aliases": ["--gamma"],
                                                             "help": "slot weight decay gamma (default: by block size)"})
    selector_loss_weight: float = field(default=1.0, metadata={"aliases": ["--selector-weight"],
                                                               "help": "weight of the candidate-selector loss"})
    selector_detach: bool = field(default=True, metadata={"help": "selector loss does not back-propagate into the "
                                                                  "drafter"})
    distill_weight: float | None = field(default=None, metadata={
        "metavar": "W", "help": "block loss = (1 - W) * CE on the true token + W * CE to the target's top-K "
                                "distribution (default 0.5 with --distill-topk, else 0)"})
    modules_to_save_learning_rate: float | None = field(default=None, metadata={
        "aliases": ["--lora-modules-lr"], "help": "learning rate of a LoRA adapter's fully trained modules"})
    overwrite_output_dir: bool = field(default=False, metadata={
        "help": "train into an --output-dir that already holds files (a drafter, an adapter, another run's "
                "checkpoints): the folder is emptied first; without it such a folder is refused"})


def default_training_arguments(output_dir: str, **overrides) -> DFlash2TrainingArguments:
    """:data:`RECIPE_DEFAULTS` (AdamW 6e-4, cosine, 4% warm-up, clip 1.0, no external reporting) for ``output_dir``;
    ``overrides`` replace any field (e.g. ``max_steps=2000, bf16=True``)."""
    kw = dict(RECIPE_DEFAULTS, output_dir=output_dir, save_steps=200)
    kw.update(overrides)
    return DFlash2TrainingArguments(**kw)


def check_output_dir(training_args: DFlash2TrainingArguments, resume_from: str | None, data: DataArguments,
                     features: FeatureArguments) -> None:
    """Refuses, before any work, an ``output_dir`` a training run would silently overwrite or mix into.

    A run that trains (not ``--eval-only`` / ``--features-only``) needs an explicit ``output_dir`` (transformers'
    default ``trainer_output`` is refused) that is new or empty, unless it resumes a checkpoint or
    ``overwrite_output_dir`` is set: a folder holding a drafter, an adapter or another run's checkpoints would
    otherwise get this run's files next to or over its own (and ``--resume-from-checkpoint last`` would later pick
    the other run's newest checkpoint).

    Raises:
        ValueError: the default output folder, a file, or a non-empty folder (the message names its contents and the
            three ways on).
    """
    if data.eval_only or features.features_only:
        return
    out = training_args.output_dir
    if out in (None, "trainer_output"):
        raise ValueError("--output-dir is required: the folder the trained drafter (or adapter) and its checkpoints "
                         "are written to, e.g. --output-dir runs/my-drafter")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--output-dir {out}: is a file; name a folder")
    if resume_from is not None or training_args.overwrite_output_dir or not os.path.isdir(out):
        return
    entries = sorted(os.listdir(out))
    if not entries:
        return
    held = ("a drafter" if "model.safetensors" in entries else "an adapter" if "adapter_config.json" in entries
            else "checkpoints of another run" if any(e.startswith("checkpoint-") for e in entries) else "files")
    shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
    raise ValueError(f"--output-dir {out} already holds {held} ({shown}): a new run would overwrite or mix with it. "
                     "Choose a new --output-dir, " + ("continue that run with --resume-from-checkpoint last, "
                     if any(e.startswith("checkpoint-") for e in entries) else "") +
                     "or pass --overwrite-output-dir true to empty it first.")


def check_run(data: DataArguments, features: FeatureArguments, drafter: DrafterArguments, lora: LoraArguments,
              training_args: DFlash2TrainingArguments) -> float:
    """Cross-checks of the five configs before any work; returns the resolved distillation weight.

    Raises:
        ValueError: a combination that cannot run (the message names the options).
    """
    from ..hub import is_local_path

    if data.data is None and not data.eval_only:
        raise ValueError("--data is required (a prepared data folder)")
    for option, folder in (("--data", data.data), *(("--extra-data", d) for d in data.extra_data or ()),
                           ("--eval-data", data.eval_data)):
        if folder and not os.path.exists(folder) and is_local_path(folder):  # org/name: a Hub data set
            raise ValueError(f"{option} {folder}: no such folder (a `dflash2 prepare-data` output folder or a Hub "
                             "data set id)")
    if data.data is not None and os.path.isfile(data.data):
        raise ValueError(f"--data {data.data}: is a file; --data takes a prepared data folder. Make one from a "
                         "conversations file with `dflash2 prepare-data --source FILE --output-dir DIR` "
                         "(docs/training.md)")
    if lora.lora and lora.lora_r < 1:
        raise ValueError(f"--lora-r must be >= 1 (the adapter's rank), got {lora.lora_r}")
    if drafter.train_only == "selector" and not drafter.init:
        raise ValueError("--train-only selector needs --init PATH_OR_ID: the trained drafter whose selector is "
                         "trained (a fresh drafter's layers would stay random).")
    if drafter.grow_layers is not None:
        if drafter.grow_layers < 1:
            raise ValueError(f"--grow-layers must be >= 1 (new decoder layers), got {drafter.grow_layers}")
        if not drafter.init:
            raise ValueError("--grow-layers needs --init PATH_OR_ID: the trained drafter to grow (a fresh drafter "
                             "takes its depth from --num-layers)")
        if lora.lora:
            raise ValueError("--grow-layers and --lora exclude each other: an adapter cannot add layers; grow the "
                             "base drafter first, then train an adapter on the grown one")
    if drafter.train_only == "new-layers" and not drafter.grow_layers:
        raise ValueError("--train-only new-layers trains the layers --grow-layers N adds to an --init drafter: name "
                         "--init PATH_OR_ID --grow-layers N")
    if drafter.grow_layers and drafter.train_only == "selector":
        raise ValueError("--grow-layers with --train-only selector would leave the new layers frozen at zero (a deeper, "
                         "slower drafter that drafts the same): use --train-only new-layers or all")
    if drafter.train_only == "selector" and lora.lora:
        raise ValueError("--train-only selector and --lora exclude each other: the selector trains in full, "
                         "without an adapter; drop one of them.")
    for name, value in (("--selector-rank", drafter.selector_rank), ("--selector-top-k", drafter.selector_top_k)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
        if value is not None and lora.lora:
            raise ValueError(f"{name} cannot be used with --lora: an adapter keeps its base drafter's selector; "
                             "change the selector of the base drafter instead (--train-only selector)")
    if lora.lora and not drafter.init:
        raise ValueError("--lora needs --init PATH_OR_ID: the trained drafter the adapter adapts.")
    if training_args.modules_to_save_learning_rate is not None and not (lora.lora_modules_to_save or lora.lora_init):
        raise ValueError("--modules-to-save-learning-rate (--lora-modules-lr) sets the rate of "
                         "--lora-modules-to-save: name those modules too.")
    if drafter.draft_vocab is not None and lora.lora:
        raise ValueError("--draft-vocab cannot be used with --lora: the adapter drafts with its base drafter's "
                         "vocabulary; choose it when training the base drafter")
    if features.features == "online" and data.follow_data:
        raise ValueError("--follow-data follows a feature cache: use it with --features cache")
    if data.follow_data and training_args.world_size > 1:
        raise ValueError("--follow-data runs in one process (its dataset grows while ranks shard it)")
    if features.features == "online" and training_args.dataloader_num_workers:
        raise ValueError("--features online runs the target in the training process: --dataloader-num-workers 0")
    w = training_args.distill_weight
    w = w if w is not None else (0.5 if features.distill_topk else 0.0)
    if not 0.0 <= w <= 1.0:
        raise ValueError(f"--distill-weight must be in [0, 1], got {w}")
    if w and not features.distill_topk:
        raise ValueError("--distill-weight needs --distill-topk K (the target's top-K logits)")
    return w


__all__ = ["DFlash2TrainingArguments", "DataArguments", "DrafterArguments", "FeatureArguments", "LoraArguments",
           "RECIPE_DEFAULTS", "check_output_dir", "check_run", "default_training_arguments"]
