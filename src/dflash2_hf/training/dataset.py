"""Training records (target-regenerated conversations) joined with their cached target features.

Records come from :func:`dflash2_hf.data.load_dataset_folder` (the Parquet shards of a ``prepare-data`` dataset
folder with ``record_id``, ``input_ids`` and ``response_spans``; see :mod:`dflash2_hf.data.prepared`).
:func:`normalize_record` turns one record into the three fields training needs (``record_id``, ``input_ids``,
``response_mask``) and also accepts records that carry a ``response_mask`` / ``loss_mask`` list or ``labels`` with
``-100`` instead of spans.
"""

from __future__ import annotations

import logging
import os
from typing import Sequence

import torch
from torch.utils.data import ConcatDataset, Dataset, Sampler

from .features import FeatureCache

logger = logging.getLogger(__name__)


def normalize_record(rec: dict) -> dict:
    """``{"record_id": int, "input_ids": list[int], "response_mask": list[int]}`` from a prepared record.

    Raises:
        ValueError: the record has no way to tell response tokens (spans, mask or labels), or lengths differ.
    """
    ids = [int(t) for t in rec["input_ids"]]
    if "response_spans" in rec:
        mask = [0] * len(ids)
        for s, e in rec["response_spans"]:
            mask[s:e] = [1] * (e - s)
    elif "response_mask" in rec or "loss_mask" in rec:
        mask = [int(bool(m)) for m in rec.get("response_mask", rec.get("loss_mask"))]
    elif "labels" in rec:
        mask = [int(lab != -100) for lab in rec["labels"]]
    else:
        raise ValueError(
            f"record {rec.get('record_id')!r} has no response_spans / response_mask / loss_mask / labels: "
            "cannot tell which tokens are responses"
        )
    if len(mask) != len(ids):
        raise ValueError(f"record {rec.get('record_id')!r}: {len(mask)} mask entries for {len(ids)} input_ids")
    return {"record_id": int(rec["record_id"]), "input_ids": ids, "response_mask": mask}


def load_training_records(
    data_dir: str | os.PathLike,
    max_records: int | None = None,
    train_only: bool = True,
) -> list[dict]:
    """Normalised records of a dataset folder (its complete shards), sorted by ``record_id``.

    Args:
        data_dir: a dataset folder written by ``dflash2 prepare-data`` (or a committed one under dataset_cards/).
        max_records: keep the first ``max_records`` records (by ``record_id``), e.g. to fit a time budget.
        train_only: read the ``train`` split and, for ShareGPT-derived folders, drop records outside the training
            range ``[0, 16000)`` (dev / held-out records must never be trained on; DESIGN.md section 7). ``False``
            asks for evaluation records: the ``dev`` split. A folder of one split only serves it for both: one with
            no ``train`` split (e.g. ``...-code-validation``) trains on its ``dev`` records, with a warning; one with
            no ``dev`` split evaluates on its ``train`` records.

    Raises:
        FileNotFoundError: ``data_dir`` is not a dataset folder.
        PreparedDataError: a corrupt shard, or an old JSONL folder (the message names the converter).
    """
    from ..data import TRAIN_RANGE, load_dataset_folder

    raw = load_dataset_folder(data_dir, split="train" if train_only else "dev")
    if not raw:  # a folder of one split only, named as the other on purpose
        raw = load_dataset_folder(data_dir, split="dev" if train_only else "train")
        if train_only and raw:
            logger.warning("%s has no train split: training on its %d dev (held-out) records; never evaluate the "
                           "result on this folder", data_dir, len(raw))
    recs = [normalize_record(r) for r in raw]
    if train_only:
        kept = [r for r in recs if TRAIN_RANGE[0] <= r["record_id"] < TRAIN_RANGE[1]]
        if len(kept) != len(recs):
            logger.warning("dropped %d records outside the ShareGPT training range %s", len(recs) - len(kept),
                           TRAIN_RANGE)
        recs = kept
    recs.sort(key=lambda r: r["record_id"])
    if max_records is not None:
        recs = recs[:max_records]
    return recs


class FeatureDataset(Dataset):
    """Map-style dataset of records whose features are in a :class:`FeatureCache`.

    Records the cache lacks (or holds for other tokens) are left out; :attr:`skipped` counts them.
    Items (what :class:`~dflash2_hf.training.collator.BlockCollator` takes): ``record_id`` int, ``input_ids``
    ``(L,)`` int64, ``response_mask`` ``(L,)`` bool, ``context_hidden_states`` ``(L, n*H_t)`` bfloat16 (read from
    disk on access), where ``L`` is the cached length; ``target_next`` ``(L,)`` int64 (the target's greedy next
    token at each position) when the cache stores it and ``target_labels`` is on; ``target_topk_logits`` ``(L, k)`` float32 and
    ``target_topk_ids`` ``(L, k)`` int64 (its k largest next-token logits) when the cache stores them.
    """

    def __init__(self, records: Sequence[dict], cache: FeatureCache, max_length: int | None = None,
                 target_labels: bool | None = None):
        """``target_labels``: give the items the target's greedy tokens (the collator then labels with them);
        default: whenever the cache stores them. A cache built for distillation stores them too, which must not
        switch the labels by itself: pass ``False`` there."""
        self.cache = cache
        self.target_labels = cache.with_next if target_labels is None else bool(target_labels)
        if self.target_labels and not cache.with_next:
            raise ValueError(f"target_labels needs a cache with the target's greedy tokens; {cache.dir} has none")
        stale = {r["record_id"] for r in cache.missing(records, max_length)}
        self.records = [r for r in records if r["record_id"] not in stale and r["record_id"] in cache]
        self.skipped = len(records) - len(self.records)

    def add_records(self, records: Sequence[dict], max_length: int | None = None) -> int:
        """Appends the records of ``records`` that are cached (fresh) and not in the dataset yet; returns how many.

        Lets a training run pick up data that a still-running ``prepare-data`` job wrote after it started.
        """
        have = {r["record_id"] for r in self.records}
        new = [r for r in records if r["record_id"] not in have and r["record_id"] in self.cache]
        stale = {r["record_id"] for r in self.cache.missing(new, max_length)}
        new = [r for r in new if r["record_id"] not in stale]
        self.records.extend(new)
        return len(new)

    def __len__(self) -> int:
        return len(self.records)

    def num_response_tokens(self) -> int:
        """Response tokens inside the cached lengths (what the blocks can be trained on)."""
        return sum(sum(r["response_mask"][: self.cache.length(r["record_id"])]) for r in self.records)

    def num_tokens(self) -> int:
        """Cached context tokens."""
        return sum(self.cache.length(r["record_id"]) for r in self.records)

    def __getitem__(self, i: int) -> dict:
        rec = self.records[i]
        feats = self.cache.get(rec["record_id"])
        L = feats.shape[0]
        item = {
            "record_id": rec["record_id"],
            "input_ids": torch.tensor(rec["input_ids"][:L], dtype=torch.long),
            "response_mask": torch.tensor(rec["response_mask"][:L], dtype=torch.bool),
            "context_hidden_states": feats,
        }
        if self.target_labels:
            item["target_next"] = self.cache.get_next(rec["record_id"])
        if self.cache.topk:
            item["target_topk_logits"], item["target_topk_ids"] = self.cache.get_topk(rec["record_id"])
        return item


class GrowingConcatDataset(ConcatDataset):
    """:class:`torch.utils.data.ConcatDataset` whose parts may grow while it is in use.

    ``ConcatDataset`` fixes its offsets when built, so records that ``--follow-data`` appends to the first part
    (a :class:`FeatureDataset`) would never be drawn next to an ``--extra-data`` part; here the offsets follow the
    parts' current lengths (a sampler re-reads ``len()`` at every epoch).
    """

    @property
    def cumulative_sizes(self) -> list[int]:
        return self.cumsum(self.datasets)

    @cumulative_sizes.setter
    def cumulative_sizes(self, _value) -> None:  # ConcatDataset.__init__ assigns the sizes of the moment
        pass


class GrowingRandomSampler(Sampler[int]):
    """Random order without replacement over a dataset that may grow while it is drawn from.

    ``torch.utils.data.RandomSampler`` draws its permutation when an epoch's iterator is created, so records that
    ``--follow-data`` appends during the epoch are never drawn before the next one, and a run whose ``max_steps``
    ends within its first epoch trains only on what was cached when it started. Here every draw picks uniformly
    among the indices not drawn yet in the current pass over the data, the indices added since included; a pass
    ends when every index has been drawn, and the next pass starts at once (its state carries over the Trainer's
    epochs). On a dataset that does not grow it is a plain random permutation per pass.

    Args:
        data_source: a sized dataset; ``len()`` is read again at every draw.
        seed: seed of the order (the same seed and the same growth give the same order, which ``--resume``
            relies on when it skips the batches already trained).

    ``len()`` is the dataset's length at the moment of the call (the Trainer's epoch length).
    """

    def __init__(self, data_source, seed: int = 0):
        self.data_source = data_source
        self.generator = torch.Generator().manual_seed(int(seed))
        self._pool: list[int] = []  # indices not drawn yet in this pass
        self._known = 0  # indices [0, _known) have joined the current pass

    def __len__(self) -> int:
        return len(self.data_source)

    def _next_index(self) -> int:
        n = len(self.data_source)
        if n < self._known:  # records were dropped (regenerated under the same id): forget indices past the end
            self._pool = [i for i in self._pool if i < n]
            self._known = n
        self._pool.extend(range(self._known, n))  # records added since the last draw join this pass
        self._known = n
        if not self._pool:  # pass complete: start the next one over everything there is now
            if n == 0:
                raise ValueError("GrowingRandomSampler: the dataset is empty")
            self._pool = list(range(n))
        j = int(torch.randint(len(self._pool), (1,), generator=self.generator))
        self._pool[j], self._pool[-1] = self._pool[-1], self._pool[j]
        return self._pool.pop()

    def __iter__(self):
        for _ in range(len(self.data_source)):
            yield self._next_index()


__all__ = ["FeatureDataset", "GrowingConcatDataset", "GrowingRandomSampler", "load_training_records",
           "normalize_record"]
