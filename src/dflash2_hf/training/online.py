"""Online target features: the frozen target runs inside the training step instead of a disk cache.

:class:`RecordDataset` holds the training records cut exactly as :class:`~dflash2_hf.training.features.FeatureCache`
cuts them (:func:`~dflash2_hf.training.features.feature_length`); :class:`OnlineFeatures` runs the frozen target on
such items (``no_grad``, in the target's own dtype, on its device) and adds what a
:class:`~dflash2_hf.training.dataset.FeatureDataset` item would carry: ``context_hidden_states`` rounded to the
cache's storage dtype, ``target_next`` (``target_labels``) and the top-k logits rounded as the cache stores them.
Same records, same forward per record, same rounding: the same batch gives the same loss as cached features
(``tests/test_training_pipeline.py``). Nothing is written.

:class:`~dflash2_hf.training.trainer.DFlash2Trainer` (``online_features=``) calls it in ``compute_loss`` and in
``evaluate``; the DataLoader carries only token ids (:func:`defer_collation`).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torch.utils.data import Dataset

from .features import STORAGE_DTYPE, feature_length
from .target_features import target_features


class RecordDataset(Dataset):
    """Training records without features: items ``record_id``, ``input_ids`` ``(L,)`` int64 and ``response_mask``
    ``(L,)`` bool, ``L = feature_length(...)`` (records with fewer than 2 such tokens are left out, as the cache
    leaves them out). ``cache`` is ``None``: nothing is stored."""

    cache = None

    def __init__(self, records: Sequence[dict], max_length: int | None = None):
        self.max_length = max_length
        self.records, self.lengths = [], []
        for rec in records:
            n = feature_length(rec["input_ids"], rec["response_mask"], max_length)
            if n >= 2:
                self.records.append(rec)
                self.lengths.append(n)
        self.skipped = len(records) - len(self.records)

    def __len__(self) -> int:
        return len(self.records)

    def num_tokens(self) -> int:
        return sum(self.lengths)

    def num_response_tokens(self) -> int:
        return sum(sum(r["response_mask"][:n]) for r, n in zip(self.records, self.lengths))

    def __getitem__(self, i: int) -> dict:
        rec, n = self.records[i], self.lengths[i]
        return {"record_id": rec["record_id"], "input_ids": torch.tensor(rec["input_ids"][:n], dtype=torch.long),
                "response_mask": torch.tensor(rec["response_mask"][:n], dtype=torch.bool)}


class OnlineFeatures:
    """The frozen target as a feature provider (what the cache would have stored, computed now).

    Args:
        target: the target (frozen here: ``requires_grad_(False)``, ``eval()``), already in the dtype and on the
            device it should run in.
        layer_ids: the drafter's ``target_layer_ids``.
        target_labels: add ``target_next`` (the target's greedy next tokens) to the items.
        topk: add the target's ``topk`` largest next-token logits (``target_topk_logits`` / ``target_topk_ids``).
    """

    def __init__(self, target: nn.Module, layer_ids: Sequence[int], target_labels: bool = False, topk: int = 0):
        self.target = target.requires_grad_(False).eval()
        self.layer_ids = [int(i) for i in layer_ids]
        self.target_labels, self.topk = bool(target_labels), int(topk)

    def __call__(self, items: list[dict]) -> list[dict]:
        """``items`` with the target's outputs added (new dicts, CPU tensors like a cached item's)."""
        device = next(self.target.parameters()).device
        with_next = self.target_labels or self.topk > 0
        out = []
        for item in items:
            ids = item["input_ids"].to(device).reshape(1, -1)
            res = target_features(self.target, ids, self.layer_ids, with_next=with_next, topk=self.topk)
            feats, *extra = res if with_next else (res,)
            new = {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in item.items()}
            new["context_hidden_states"] = feats[0].to(STORAGE_DTYPE).cpu()
            if self.target_labels:
                new["target_next"] = extra[0][0].cpu()
            if self.topk:  # float16, as the cache stores them
                new["target_topk_logits"] = extra[1][0].to(torch.float16).float().cpu()
                new["target_topk_ids"] = extra[2][0].cpu()
            out.append(new)
        return out


class WithOnlineFeatures(Dataset):
    """``dataset``'s items with the target's outputs added on access (for evaluation, which reads items one by one)."""

    def __init__(self, dataset: Dataset, provider: OnlineFeatures):
        self.dataset, self.provider = dataset, provider

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict:
        return self.provider([self.dataset[i]])[0]


def defer_collation(items: list[dict]) -> dict:
    """DataLoader collate function of online runs: the raw items travel as they are (the Trainer moves them to the
    device); the block collator runs in the training step, after the target."""
    return {"online_items": items}


__all__ = ["OnlineFeatures", "RecordDataset", "WithOnlineFeatures", "defer_collation"]
