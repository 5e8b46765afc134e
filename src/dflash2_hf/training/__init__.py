"""Drafter training (DESIGN.md section 4): target feature cache, block sampling, losses and the Trainer.

Pipeline::

    records = load_training_records("data/smollm2-sharegpt")            # target-regenerated conversations
    cache = FeatureCache("~/.cache/dflash2_hf/features/smollm2-sharegpt", "smollm2", drafter.config.target_layer_ids)
    cache.build(target, records, max_length=1024)                        # once; resumable; reused by every run
    dataset = FeatureDataset(records, cache)
    collator = BlockCollator(block_size=16, mask_token_id=drafter.config.mask_token_id, num_blocks=32)
    trainer = DFlash2Trainer(model=drafter, args=default_training_arguments("runs/x", max_steps=1000),
                             target=target, train_dataset=dataset, data_collator=collator)
    trainer.train(); trainer.save_model("runs/x")

The ``dflash2 train`` command (:mod:`dflash2_hf.cli.train`) runs exactly this (plus ``--follow-data``:
:class:`FollowDataCallback` adds records a still-running ``prepare-data`` job writes, and ``--resume``).
"""

from .collator import IGNORE_INDEX, BlockCollator, block_labels, response_offsets, sample_anchors, valid_anchors
from .dataset import FeatureDataset, GrowingConcatDataset, GrowingRandomSampler, load_training_records, normalize_record
from .evaluate import evaluate_blocks
from .features import FeatureCache, cache_key, feature_length
from .target_features import target_features
from .init import initialize_from_target, target_layer_choice
from .losses import DrafterLossOutput, accumulate_stats, default_gamma, drafter_loss, slot_weights, summarize_stats
from .trainer import (
    DFlash2Trainer,
    DFlash2TrainingArguments,
    FollowDataCallback,
    default_training_arguments,
    freeze_target,
    unwrap_drafter,
    write_summary,
)

__all__ = [
    "BlockCollator",
    "DFlash2Trainer",
    "DFlash2TrainingArguments",
    "DrafterLossOutput",
    "FeatureCache",
    "FollowDataCallback",
    "FeatureDataset",
    "GrowingConcatDataset",
    "GrowingRandomSampler",
    "IGNORE_INDEX",
    "accumulate_stats",
    "block_labels",
    "cache_key",
    "default_gamma",
    "default_training_arguments",
    "drafter_loss",
    "evaluate_blocks",
    "feature_length",
    "freeze_target",
    "initialize_from_target",
    "load_training_records",
    "normalize_record",
    "response_offsets",
    "sample_anchors",
    "slot_weights",
    "summarize_stats",
    "target_features",
    "target_layer_choice",
    "unwrap_drafter",
    "valid_anchors",
    "write_summary",
]
