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

from . import resolve_device
from .train_args import add_arguments, add_lora_arguments, cache_kwargs, distill_weight, resolve_precision  # noqa: F401
from .train_drafter import build_drafter, check_draft_vocab_args, check_lora_args, choose_draft_vocab, wrap_model
from .train_records import default_features_root, is_code_folder, keep_code, last_complete_checkpoint, load_eval_records

logger = logging.getLogger("dflash2.train")


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
