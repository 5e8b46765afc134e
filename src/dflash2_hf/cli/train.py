"""Train a DFlash2 drafter on target-regenerated data (target features cached, resumable).

Steps: load the target -> build (or resume) the drafter -> compute the target features the cache lacks (stored
under --features-dir, reused by every later run) -> train with transformers.Trainer (checkpoints in --output,
resumable with --resume) -> save the final drafter to --output with save_pretrained (safetensors).

Example:
  dflash2 train --target smollm2 --data data/smollm2-sharegpt --output runs/smollm2-v1 \\
      --num-layers 5 --block-size 16 --max-steps 1000 --num-threads 1
  dflash2 train ... --resume            # continue from the last checkpoint in --output
  dflash2 train ... --features-only     # only fill the feature cache
  dflash2 train ... --follow-data       # keep adding records a running prepare-data job writes

Logged every --logging-steps: loss, ce_loss, selector_loss, acc_slot_j (top-1 accuracy of draft slot j),
acc_top1, acc_selector, topk_recall, tau_top1 / tau_selector (teacher-forced greedy acceptance estimate on the
training blocks) and pred_tokens_per_s (labelled slots per wall second, feature refreshes included).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
import time

from ..errors import CheckpointError
from . import resolve_device
from .train_args import add_arguments, add_lora_arguments, cache_kwargs, distill_weight, resolve_precision  # noqa: F401

logger = logging.getLogger("dflash2.train")


def check_lora_args(args: argparse.Namespace) -> None:
    """Validates the LoRA options before any work (target load, features).

    Raises:
        SystemExit: ``--lora`` without ``--init`` (an adapter needs a trained base drafter), LoRA-only options without
            ``--lora``, ``--lora-modules-lr`` without modules to train in full, or a local ``--lora-init`` folder that
            is missing or no adapter (``dflash2_hf.lora.check_adapter_folder``'s message).
    """
    if not args.lora:
        if (args.lora_modules_to_save or args.lora_modules_lr is not None or args.lora_init
                or args.lora_save_dtype != "fp32"):
            raise SystemExit("--lora-modules-to-save / --lora-modules-lr / --lora-init / --lora-save-dtype shape a LoRA "
                             "adapter: add --lora (and --init).")
        return
    if args.lora_modules_lr is not None and not (args.lora_modules_to_save or args.lora_init):
        raise SystemExit("--lora-modules-lr sets the rate of --lora-modules-to-save: name those modules too.")
    if not args.init:
        raise SystemExit("--lora needs --init PATH_OR_ID: the trained drafter the adapter adapts.")
    if args.lora_init:
        from ..hub import is_local_path
        from ..lora import check_adapter_folder

        if is_local_path(args.lora_init):
            try:
                check_adapter_folder(args.lora_init)
            except (FileNotFoundError, CheckpointError) as err:
                raise SystemExit(f"--lora-init: {err}") from err


def wrap_model(drafter, args: argparse.Namespace):
    """The module the Trainer optimizes: the drafter, or (``--lora``) a PEFT LoRA model around it (options checked
    by :func:`check_lora_args`)."""
    if not args.lora:
        return drafter
    from ..lora import add_lora, lora_config

    if args.lora_init:  # go on training an existing adapter (its own rank, targets and modules to save)
        from ..lora import load_adapter

        return load_adapter(drafter, args.lora_init, is_trainable=True)
    modules = args.lora_target_modules.split(",") if args.lora_target_modules else None
    full = args.lora_modules_to_save.split(",") if args.lora_modules_to_save else None
    return add_lora(drafter, lora_config(args.lora_r, args.lora_alpha, args.lora_dropout, modules, full))


def is_code_record(tokenizer, record: dict) -> bool:
    """True when the rendered conversation holds a fenced code block (Markdown ```)."""
    return "```" in tokenizer.decode(record["input_ids"])


def default_features_root(data_dir: str) -> str:
    """``$DFLASH2_CACHE/features/<basename of data_dir>`` (see ``dflash2_hf.targets.cache_dir``)."""
    from ..targets import cache_dir

    name = os.path.basename(os.path.normpath(os.path.abspath(data_dir))) or "data"
    return str(cache_dir() / "features" / name)


def last_complete_checkpoint(output: str) -> str | None:
    """Newest ``checkpoint-N`` folder of ``output`` that a resume can use, or None.

    A checkpoint counts only if it holds ``trainer_state.json`` (written last by the Trainer) and the drafter
    weights; a folder left half-written by a kill is skipped with a warning (``transformers``'
    ``get_last_checkpoint`` would pick it and restart the step count from 0).
    """
    import re

    if not os.path.isdir(output):
        return None
    found = []
    for name in os.listdir(output):
        m = re.fullmatch(r"checkpoint-(\d+)", name)
        if m and os.path.isdir(os.path.join(output, name)):
            found.append((int(m.group(1)), os.path.join(output, name)))
    for _step, path in sorted(found, reverse=True):
        files = set(os.listdir(path))
        if "trainer_state.json" in files and ("model.safetensors" in files or "model.safetensors.index.json" in files
                                              or "adapter_model.safetensors" in files):
            return path
        logger.warning("skipping incomplete checkpoint %s (no trainer_state.json or weights)", path)
    return None


def attention_overrides(args: argparse.Namespace) -> dict:
    """``layer_types`` / ``sliding_window`` / ``is_causal`` of a fresh drafter from ``--layer-types``,
    ``--sliding-window`` and ``--causal`` (only those given); raises ValueError for bad layer types."""
    from ..masking import parse_layer_types

    out = {"layer_types": parse_layer_types(args.layer_types, args.num_layers)} if args.layer_types else {}
    if args.sliding_window is not None:
        out["sliding_window"] = args.sliding_window
    if args.causal != "auto":
        out["is_causal"] = args.causal == "yes"
    return out


def build_drafter(args: argparse.Namespace, target, resume_from: str | None):
    """The drafter to train: the resumed checkpoint's, ``--init``'s, or a fresh one sized for the target."""
    import torch

    from .. import DFlash2DraftModel

    if resume_from and not args.lora:  # a LoRA checkpoint holds the adapter only: the base comes from --init
        drafter = DFlash2DraftModel.from_pretrained(resume_from)
    elif args.init:
        drafter = DFlash2DraftModel.from_pretrained(args.init)
    else:
        overrides = dict(num_hidden_layers=args.num_layers, block_size=args.block_size)
        if args.target_layer_ids:
            overrides["target_layer_ids"] = [int(x) for x in args.target_layer_ids.split(",")]
        if args.mask_token_id is not None:
            overrides["mask_token_id"] = args.mask_token_id
        if args.selector_top_k is not None:
            overrides["selector_top_k"] = args.selector_top_k
        if args.selector_rank is not None:
            overrides["selector_rank"] = args.selector_rank
        if args.no_conv:
            overrides["use_local_conv"] = False
        if args.no_selector:
            overrides["use_candidate_selector"] = False
        overrides.update(attention_overrides(args))
        drafter = DFlash2DraftModel.from_target(target, **overrides)
        from ..training import initialize_from_target

        initialize_from_target(drafter, target, layers=args.init_layers_from_target,
                               final_norm=args.init_norm_from_target)
        if args.init_norm is not None:
            with torch.no_grad():
                drafter.norm.weight.fill_(args.init_norm)
    drafter.check_target(target)
    return drafter.float().train()


def check_draft_vocab_args(args: argparse.Namespace, drafter) -> None:
    """Validates ``--draft-vocab`` before any feature is computed (see :func:`choose_draft_vocab`)."""
    if args.draft_vocab is None:
        return
    if args.lora:
        raise ValueError("--draft-vocab cannot be used with --lora: the adapter drafts with its base drafter's "
                         "vocabulary; choose it when training the base drafter")
    if not 1 <= args.draft_vocab <= drafter.config.vocab_size:
        raise ValueError(f"--draft-vocab must be in [1, {drafter.config.vocab_size}] (the target vocabulary), "
                         f"got {args.draft_vocab}")


def choose_draft_vocab(args: argparse.Namespace, drafter, records: list[dict]) -> None:
    """``--draft-vocab N``: restricts ``drafter`` to the N most frequent response tokens of ``records`` (+ EOS).

    Raises:
        ValueError: with ``--lora`` (an adapter shares its base drafter's vocabulary), or N outside [1, vocab size].
    """
    from ..training.draft_vocab import draft_vocab_coverage, draft_vocab_from_records, eos_ids

    check_draft_vocab_args(args, drafter)
    old = drafter.draft_vocab_ids
    ids, coverage = draft_vocab_from_records(records, args.draft_vocab, always=eos_ids(drafter.config))
    before = 1.0 if old is None else draft_vocab_coverage(old.tolist(), records)
    drafter.set_draft_vocab(ids)
    logger.info("--draft-vocab %d: covers %.4f of the training data's response tokens (was %s: %.4f)", ids.numel(),
                coverage, "the whole vocabulary" if old is None else f"{old.numel()} ids", before)


def is_code_folder(data_dir: str) -> bool:
    """True for a folder made by ``prepare-data --only-code``: code-domain as a whole (its records were chosen by the
    original conversation; the target's own answer need not hold a fenced block), so --only-code keeps all of it."""
    from ..data import read_meta

    return (os.path.isfile(os.path.join(data_dir, "meta.json"))
            and read_meta(data_dir).get("source", {}).get("filter") == "code")


def keep_code(args: argparse.Namespace, tokenizer, data_dir: str, records: list[dict]) -> tuple[list[dict], bool]:
    """With ``--only-code``: the records with a fenced code block, unless ``data_dir`` is code-domain as a whole
    (:func:`is_code_folder`). Returns ``(records, filtered)``."""
    filtered = args.only_code and not is_code_folder(data_dir)
    return ([r for r in records if is_code_record(tokenizer, r)] if filtered else records), filtered


def load_eval_records(args: argparse.Namespace, tokenizer) -> list[dict]:
    """The first ``--eval-max-records`` records of ``--eval-data`` (with ``--only-code``: of its code records, so the
    evaluation is in the training domain).

    Raises:
        ValueError: no record to evaluate on.
    """
    from ..training import load_training_records

    recs = load_training_records(args.eval_data, max_records=None if args.only_code else args.eval_max_records,
                                 train_only=False)
    recs, code_filter = keep_code(args, tokenizer, args.eval_data, recs)
    recs = recs[:args.eval_max_records]
    if code_filter:
        logger.info("--only-code: %d held-out records with a fenced code block", len(recs))
    if not recs:
        raise ValueError(f"--eval-data {args.eval_data}: no record to evaluate on"
                         + (" (none has a fenced code block; drop --only-code or use a code folder)" if code_filter
                            else ""))
    return recs


def _eval_only(args, target, drafter, progress, tokenizer, resume_from: str | None) -> int:
    import torch

    from ..training import BlockCollator, FeatureCache, FeatureDataset, evaluate_blocks, freeze_target

    if args.lora:  # evaluate the trained adapter (from --resume's checkpoint, else the finished --output) on --init
        from ..lora import load_adapter

        adapter = resume_from or args.output
        if not os.path.isfile(os.path.join(adapter, "adapter_config.json")):
            raise FileNotFoundError(f"--eval-only --lora: no trained adapter in {adapter!r} (adapter_config.json); "
                                    "pass the --output of a finished `dflash2 train --lora` run, or add --resume")
        logger.info("evaluating the drafter %s with the LoRA adapter %s", args.init, adapter)
        drafter = load_adapter(drafter, adapter).eval()
    cfg = drafter.config
    recs = load_eval_records(args, tokenizer)
    cache = FeatureCache(args.features_dir or default_features_root(args.eval_data), args.target, cfg.target_layer_ids,
                         **cache_kwargs(args))
    cache.build(target, recs, max_length=args.max_length, compute_dtype=getattr(torch, args.feature_dtype),
                progress=progress)
    dataset = FeatureDataset(recs, cache, max_length=args.max_length, target_labels=args.target_labels)
    emb, head = freeze_target(target)
    collator = BlockCollator(block_size=cfg.block_size, mask_token_id=cfg.mask_token_id, num_blocks=args.num_blocks,
                             max_length=args.max_length)
    metrics = evaluate_blocks(drafter, emb, head, dataset, collator, gamma=args.gamma)
    print(json.dumps(metrics, indent=2))
    return 0


def run(args: argparse.Namespace) -> int:
    import torch

    from ..targets import load_target
    from ..training import (
        BlockCollator,
        DFlash2Trainer,
        FeatureCache,
        FeatureDataset,
        FollowDataCallback,
        GrowingConcatDataset,
        default_training_arguments,
        load_training_records,
        write_summary,
    )

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    check_lora_args(args)
    if args.eval_only and not args.eval_data:
        logger.error("--eval-only needs --eval-data")
        return 2
    if args.distill_topk < 0:
        logger.error("--distill-topk must be >= 0, got %d", args.distill_topk)
        return 2
    try:
        distill = distill_weight(args)
    except ValueError as err:
        logger.error("%s", err)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    progress = not args.no_progress and sys.stderr.isatty()
    t_start = time.time()

    resume_from = last_complete_checkpoint(args.output) if args.resume else None
    if args.resume and resume_from is None:
        logger.warning("--resume: no checkpoint in %s yet, starting fresh", args.output)
    device = resolve_device(args.device)
    for choice in resolve_precision(args, device):
        logger.info("%s", choice)
    target, tokenizer = load_target(args.target, dtype=torch.float32, device=device)
    drafter = build_drafter(args, target, resume_from).to(device)  # the Trainer would place it; --eval-only does not run one
    cfg = drafter.config
    n_params = sum(p.numel() for p in drafter.parameters())
    logger.info("drafter: %d layers, B=%d, target layers %s, %.1fM parameters%s", cfg.num_hidden_layers,
                cfg.block_size, cfg.target_layer_ids, n_params / 1e6,
                f" (resumed from {resume_from})" if resume_from else "")

    check_draft_vocab_args(args, drafter)
    if args.eval_only:
        return _eval_only(args, target, drafter, progress, tokenizer, resume_from)

    # ---- target features (computed once, reused by every run)
    def load_records():
        return keep_code(args, tokenizer, args.data,
                         load_training_records(args.data, max_records=args.max_records))[0]

    records = load_records()
    if args.only_code:
        logger.info("--only-code: %d records %s", len(records), "(a prepare-data --only-code folder, all kept)"
                    if is_code_folder(args.data) else "with a fenced code block")
    feat_root = args.features_dir or default_features_root(args.data)
    budget = None if args.feature_time_budget is None else args.feature_time_budget * 60
    parts, all_ids, all_records = [], set(), []
    for k, data_dir in enumerate([args.data, *args.extra_data]):
        recs = records if k == 0 else load_training_records(data_dir, max_records=args.max_records)
        all_ids |= {r["record_id"] for r in recs}
        all_records += recs
        root = feat_root if k == 0 else (os.path.join(args.features_dir, f"extra-{k}") if args.features_dir
                                         else default_features_root(data_dir))
        part_cache = FeatureCache(root, args.target, cfg.target_layer_ids, **cache_kwargs(args))
        stats = part_cache.build(target, recs, max_length=args.max_length,
                                 compute_dtype=getattr(torch, args.feature_dtype), progress=progress,
                                 time_budget_s=budget)
        logger.info("features of %s: %d records computed (%d tokens, %.0f tokens/s), %d cached in %s", data_dir,
                    stats["computed"], stats["tokens"], stats["tokens_per_s"], stats["cached"], part_cache.dir)
        part = FeatureDataset(recs, part_cache, max_length=args.max_length, target_labels=args.target_labels)
        logger.info("training data from %s: %d sequences, %d context tokens, %d response tokens (%d records not "
                    "cached)", data_dir, len(part), part.num_tokens(), part.num_response_tokens(), part.skipped)
        parts.append(part)
    if args.features_only:
        return 0
    if args.draft_vocab is not None and resume_from is None:  # a resumed checkpoint already holds the chosen one
        choose_draft_vocab(args, drafter, all_records)
    train_set = parts[0] if len(parts) == 1 else GrowingConcatDataset(parts)  # parts grow under --follow-data
    if len(train_set) == 0:
        logger.error("no training sequence has cached features: nothing to train on")
        return 1

    eval_dataset = None
    if args.eval_data:
        eval_records = load_eval_records(args, tokenizer)
        if any(r["record_id"] in all_ids for r in eval_records):
            logger.error("--eval-data shares record ids with --data: evaluation must use held-out records")
            return 1
        eval_cache = FeatureCache(default_features_root(args.eval_data) if not args.features_dir else
                                  os.path.join(args.features_dir, "eval"), args.target, cfg.target_layer_ids,
                                  **cache_kwargs(args))
        eval_cache.build(target, eval_records, max_length=args.max_length,
                         compute_dtype=getattr(torch, args.feature_dtype), progress=progress)
        eval_dataset = FeatureDataset(eval_records, eval_cache, max_length=args.max_length,
                                      target_labels=args.target_labels)
        logger.info("evaluation data: %d held-out sequences", len(eval_dataset))

    collator = BlockCollator(block_size=cfg.block_size, mask_token_id=cfg.mask_token_id, num_blocks=args.num_blocks,
                             max_length=args.max_length, seed=args.seed, early_anchor_tokens=args.early_anchor_tokens,
                             early_anchor_weight=args.early_anchor_weight)
    model = wrap_model(drafter, args)
    if args.lora:
        n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
        logger.info("LoRA: %.2fM trainable adapter parameters (the %.1fM of the base drafter are frozen)",
                    n_train / 1e6, n_params / 1e6)
    overrides = dict(
        learning_rate=args.lr,
        warmup_steps=args.warmup,
        weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        num_train_epochs=args.epochs,
        max_steps=args.max_steps if args.max_steps is not None else -1,
        logging_steps=args.logging_steps,
        logging_first_step=True,
        save_steps=args.save_steps,
        save_total_limit=args.save_total_limit,
        bf16=args.bf16,
        use_cpu=device.type == "cpu",
        seed=args.seed,
        disable_tqdm=not progress,
        loss_gamma=args.gamma,
        selector_loss_weight=args.selector_weight,
        selector_detach=not args.selector_no_detach,
        distill_weight=distill,
        modules_to_save_learning_rate=args.lora_modules_lr,
        eval_strategy="steps" if eval_dataset is not None else "no",
        eval_steps=args.eval_steps if eval_dataset is not None else None,
    )
    targs = default_training_arguments(args.output, **overrides)
    trainer = DFlash2Trainer(model=model, args=targs, target=target, train_dataset=train_set, eval_dataset=eval_dataset,
                             data_collator=collator)
    if args.follow_data:  # every part: --data gains new records, every part gains features cached meanwhile
        loaders = [load_records, *(functools.partial(load_training_records, d, max_records=args.max_records)
                                   for d in args.extra_data)]
        for part, loader in zip(parts, loaders):
            trainer.add_callback(FollowDataCallback(
                part, part.cache, target, load_records=loader,
                max_length=args.max_length, every_steps=args.follow_every, time_budget_s=budget,
                compute_dtype=getattr(torch, args.feature_dtype)))
    os.makedirs(args.output, exist_ok=True)
    with open(os.path.join(args.output, "train_command.json"), "w") as f:
        json.dump({"argv": sys.argv, "args": vars(args), "threads": torch.get_num_threads()}, f, indent=2,
                  default=str)
    result = trainer.train(resume_from_checkpoint=resume_from)
    trainer.save_model(args.output)
    if args.lora:  # save_model wrote the adapter files and their fingerprint (DFlash2Trainer._save)
        from ..lora import adapter_size_bytes, checkpoint_size_bytes, save_adapter

        if args.lora_save_dtype == "bf16":
            save_adapter(trainer.model, args.output, dtype=torch.bfloat16)

        base_bytes = checkpoint_size_bytes(args.init) if os.path.isdir(args.init) else None
        logger.info("adapter: %.2f MB%s", adapter_size_bytes(args.output) / 1e6,
                    f" = {100 * adapter_size_bytes(args.output) / base_bytes:.1f}% of the base drafter's "
                    f"{base_bytes / 1e6:.1f} MB" if base_bytes else "")
    final_eval = trainer.evaluate() if eval_dataset is not None else {}
    path = write_summary(args.output, trainer, {
        "train_runtime_s": result.metrics.get("train_runtime"), "wall_s": round(time.time() - t_start, 1),
        "sequences": len(train_set), "feature_cache": [str(p.cache.dir) for p in parts], "resumed_from": resume_from,
        "final_eval": final_eval,
    })
    logger.info("saved the %s to %s (summary: %s)", "LoRA adapter" if args.lora else "drafter", args.output, path)
    return 0
