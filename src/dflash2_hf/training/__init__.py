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

The whole pipeline as one call, configured by typed dataclasses (what ``dflash2 train`` parses with
``HfArgumentParser`` and calls; ``features="online"`` runs the target in the training step instead of a cache)::

    from dflash2_hf.training import DataArguments, FeatureArguments, default_training_arguments, train
    train(DataArguments(data="data/smollm2-sharegpt"), default_training_arguments("runs/x", max_steps=1000),
          features=FeatureArguments(features="online"))
"""

from .config import (
    RECIPE_DEFAULTS,
    DataArguments,
    DFlash2TrainingArguments,
    DrafterArguments,
    FeatureArguments,
    LoraArguments,
    default_training_arguments,
)
from .collator import IGNORE_INDEX, BlockCollator, block_labels, response_offsets, sample_anchors, valid_anchors
from .dataset import FeatureDataset, GrowingConcatDataset, GrowingRandomSampler, load_training_records, normalize_record
from .evaluate import evaluate_blocks
from .features import FeatureCache, cache_key, feature_length
from .target_features import target_features
from .init import initialize_from_target, target_layer_choice
from .losses import DrafterLossOutput, accumulate_stats, default_gamma, drafter_loss, slot_weights, summarize_stats
from .online import OnlineFeatures, RecordDataset
from .trainer import DFlash2Trainer, FollowDataCallback, freeze_target, unwrap_drafter, write_summary
from .parser import TrainArgumentParser, TrainConfig
from .pipeline import train

__all__ = [
    "BlockCollator",
    "DataArguments",
    "DrafterArguments",
    "FeatureArguments",
    "LoraArguments",
    "OnlineFeatures",
    "RECIPE_DEFAULTS",
    "RecordDataset",
    "TrainArgumentParser",
    "TrainConfig",
    "train",
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
