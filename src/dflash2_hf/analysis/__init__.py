"""Offline analyses of a trained drafter (not used by training or generation)."""

from .recall import RecallByPosition, block_metrics, recall_by_position

__all__ = ["RecallByPosition", "block_metrics", "recall_by_position"]
