"""Cache of the frozen target's context features for drafter training (DESIGN.md sections 2 and 4).

The drafter is trained on the hidden states of the target layers ``target_layer_ids``, concatenated on the last
dim (``(T, n * H_t)`` per sequence; layer ``i`` is ``hidden_states[i + 1]`` of a ``transformers`` forward). The
target never changes during training, so :class:`FeatureCache` runs it once per training sequence and keeps the
result on disk; every epoch and every later training run reuses it.

On-disk layout (``<root>/<key>/``, ``key = "<target>__layers-<i>-<j>-..."``)::

    meta.json                          target identity, layer ids, dtypes, per-build throughput (atomic rewrite)
    feat-<time_ns>-<pid>.safetensors   one shard per ``shard_records`` sequences, written to a temp file and
                                       renamed into place (a kill never leaves a half shard behind);
                                       tensors "<record_id>" (L, n*H_t) bfloat16 and "<record_id>.ids" (L,) int32

A record's features cover ``input_ids[:L]`` with ``L = min(len, max_length)`` cut after the last response token
(the context after the last anchor is never read). The stored ids let :meth:`FeatureCache.missing` detect a record
whose tokens changed (regenerated data): it is recomputed into a newer shard, and the newest shard wins. Building
is resumable: whatever shards exist are kept, only missing records are computed.

Numerics: features are STORED in bfloat16 (rounding error ~0.2% relative per token). They are COMPUTED with the
target in ``compute_dtype``: float32 by default, the serving dtype of the project's bar. A bfloat16 forward drifts
~1% per token from the float32 features at deep layers (5x the storage rounding). Its speed depends on the CPU
(SmolLM2-135M, one thread): on an AVX2-only AMD EPYC bfloat16 is emulated (~200-250 tokens/s against ~310 in
float32); on an AMD EPYC with AVX512-BF16 it is 2.6x faster (428 vs 164 tokens/s for a 512-token sequence, the other
core busy: ``examples/train_step_cost.py --compare dtype``). The dtype and measured throughput of every build go
into meta.json, and one cache holds one dtype.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Iterable, Sequence

import torch
from torch import nn

from .target_features import target_features

logger = logging.getLogger(__name__)

STORAGE_DTYPE = torch.bfloat16
_META = "meta.json"
_SHARD_RE = re.compile(r"^feat-(\d+)-(\d+)\.safetensors$")


def cache_key(target_name: str, layer_ids: Sequence[int], with_next: bool = False, topk: int = 0) -> str:
    """Folder name of a cache: the target name (slugged), the layer ids, ``__next`` when it stores greedy labels,
    ``__top<k>`` when it also stores the top-k logits."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(target_name).strip("/")).strip("_") or "target"
    key = f"{slug}__layers-{'-'.join(str(int(i)) for i in layer_ids)}" + ("__next" if with_next else "")
    return key + (f"__top{int(topk)}" if topk else "")


def feature_length(input_ids: Sequence[int], response_mask: Sequence[int], max_length: int | None) -> int:
    """Rows of features a record needs: ``min(len, max_length)``, cut after the last response token (0 if none)."""
    n = len(input_ids) if max_length is None else min(len(input_ids), max_length)
    for i in range(n - 1, -1, -1):
        if response_mask[i]:
            return i + 1
    return 0


def _atomic_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True))
    os.replace(tmp, path)


class FeatureCache:
    """Target features of training sequences, on disk, for one (target, layer ids) pair.

    Args:
        root: parent folder (e.g. ``<data_dir>/features``); the cache lives in ``root / cache_key(...)``.
        target_name: the target's name (``"smollm2"`` or a path / Hub id).
        layer_ids: ``target_layer_ids`` of the drafter.
        with_next: also store the target's greedy next token at every position (``"<record_id>.next"``, int32;
            :meth:`get_next`): training labels that are the target's own choices whatever wrote the text.
        topk: also store the target's ``topk`` largest next-token logits at every position (``"<record_id>.topv"``
            ``(L, topk)`` float16 and ``"<record_id>.topi"`` int32; :meth:`get_topk`): distillation targets.
            Implies ``with_next``; 0 = none.

    Raises:
        ValueError: ``topk`` is negative.

    Use :meth:`build` to compute what is missing and :meth:`get` to read ``(L, n*H_t)`` bfloat16 features.
    """

    def __init__(self, root: str | os.PathLike, target_name: str, layer_ids: Sequence[int], with_next: bool = False,
                 topk: int = 0):
        if int(topk) < 0:
            raise ValueError(f"topk must be >= 0, got {topk}")
        self.layer_ids = [int(i) for i in layer_ids]
        self.target_name = str(target_name)
        self.topk = int(topk)
        self.with_next = bool(with_next) or self.topk > 0
        self.dir = Path(root) / cache_key(target_name, self.layer_ids, self.with_next, self.topk)
        self._index: dict[int, tuple[Path, int]] = {}
        self._handles: dict[Path, object] = {}
        self.refresh()

    # ------------------------------------------------------------------ reading
    @property
    def meta(self) -> dict:
        """Contents of ``meta.json`` (empty dict before the first build)."""
        path = self.dir / _META
        return json.loads(path.read_text()) if path.is_file() else {}

    def shards(self) -> list[Path]:
        """Complete shard files, oldest first (temp files are ignored)."""
        if not self.dir.is_dir():
            return []
        found = [p for p in self.dir.iterdir() if _SHARD_RE.match(p.name)]
        return sorted(found, key=lambda p: tuple(int(x) for x in _SHARD_RE.match(p.name).groups()))

    def refresh(self) -> None:
        """Re-reads the shard headers (cheap: only the safetensors header is read); newest shard wins."""
        from safetensors import safe_open

        self._index.clear()
        self._handles.clear()
        for path in self.shards():
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    if "." not in name:
                        self._index[int(name)] = (path, f.get_slice(name).get_shape()[0])

    def __contains__(self, record_id: int) -> bool:
        return int(record_id) in self._index

    def __len__(self) -> int:
        return len(self._index)

    def record_ids(self) -> list[int]:
        """Ids of the cached records (sorted)."""
        return sorted(self._index)

    def length(self, record_id: int) -> int:
        """Rows of features stored for ``record_id``. Raises KeyError if it is not cached."""
        return self._index[int(record_id)][1]

    def _handle(self, path: Path):
        from safetensors import safe_open

        h = self._handles.get(path)
        if h is None:
            h = self._handles[path] = safe_open(str(path), framework="pt")
        return h

    def get(self, record_id: int) -> torch.Tensor:
        """``(L, n*H_t)`` bfloat16 features of ``record_id``. Raises KeyError if it is not cached."""
        path, _ = self._index[int(record_id)]
        return self._handle(path).get_tensor(str(int(record_id)))

    def get_ids(self, record_id: int) -> torch.Tensor:
        """``(L,)`` int64 token ids the features were computed on. Raises KeyError if not cached."""
        path, _ = self._index[int(record_id)]
        return self._handle(path).get_tensor(f"{int(record_id)}.ids").long()

    def get_next(self, record_id: int) -> torch.Tensor:
        """``(L,)`` int64 greedy next tokens of the target at each position. Raises KeyError if not stored."""
        if not self.with_next:
            raise KeyError(f"{self.dir} stores no greedy next tokens (built without with_next)")
        path, _ = self._index[int(record_id)]
        return self._handle(path).get_tensor(f"{int(record_id)}.next").long()

    def get_topk(self, record_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(L, topk)`` float32 largest next-token logits of the target (descending) and ``(L, topk)`` int64 their
        token ids, at each position. Raises KeyError if not stored."""
        if not self.topk:
            raise KeyError(f"{self.dir} stores no top-k logits (built without topk)")
        path, _ = self._index[int(record_id)]
        h = self._handle(path)
        return h.get_tensor(f"{int(record_id)}.topv").float(), h.get_tensor(f"{int(record_id)}.topi").long()

    def missing(self, records: Iterable[dict], max_length: int | None) -> list[dict]:
        """Records (dicts with ``record_id``, ``input_ids``, ``response_mask``) whose features must be computed.

        A record is missing when it is not cached, when its stored ids differ from its ``input_ids`` (the data
        changed), or when fewer rows are stored than :func:`feature_length` asks for. Records without any
        response token inside ``max_length`` need nothing.
        """
        out = []
        for rec in records:
            need = feature_length(rec["input_ids"], rec["response_mask"], max_length)
            if need < 2:
                continue
            rid = int(rec["record_id"])
            if rid in self._index:
                have = self._index[rid][1]
                if have >= need and self.get_ids(rid).tolist() == list(rec["input_ids"][:have]):
                    continue
            out.append(rec)
        return out

    # ------------------------------------------------------------------ building
    def _check_meta(self, target: nn.Module, compute_dtype: torch.dtype) -> dict:
        tc = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
        ident = {
            "target_name": self.target_name,
            "model_type": getattr(tc, "model_type", None),
            "hidden_size": tc.hidden_size,
            "num_hidden_layers": tc.num_hidden_layers,
            "vocab_size": tc.vocab_size,
            "layer_ids": self.layer_ids,
            "with_next": self.with_next,
            "topk": self.topk,
        }
        if self.topk > tc.vocab_size:
            raise ValueError(f"topk={self.topk} is more than the target's vocabulary of {tc.vocab_size} tokens")
        defaults = {"with_next": False, "topk": 0}  # caches written before these fields existed
        meta = self.meta
        if meta:
            for k, v in ident.items():
                if meta.get("target", {}).get(k, defaults.get(k)) != v:
                    raise ValueError(
                        f"The feature cache {self.dir} was built for "
                        f"{k}={meta.get('target', {}).get(k, defaults.get(k))!r}, not {v!r}: "
                        "use another --features-dir or delete that folder."
                    )
            wanted, held = str(compute_dtype).replace("torch.", ""), meta.get("compute_dtype")
            if held != wanted:
                raise ValueError(
                    f"The feature cache {self.dir} holds features computed in {held}, not {wanted}: one cache "
                    f"holds one dtype. Pass `--feature-dtype {held}` to use it (`--feature-dtype auto` picks "
                    f"bfloat16 where the CPU computes it natively), or another --features-dir for {wanted} features."
                )
        else:
            import transformers

            meta = {
                "format": "dflash2-target-features",
                "version": 1,
                "target": ident,
                "storage_dtype": str(STORAGE_DTYPE).replace("torch.", ""),
                "compute_dtype": str(compute_dtype).replace("torch.", ""),
                "width": len(self.layer_ids) * tc.hidden_size,
                "torch_version": torch.__version__,
                "transformers_version": transformers.__version__,
                "note": "features[t] = concat(hidden_states[i + 1][t] for i in layer_ids); target in compute_dtype, "
                "stored in storage_dtype",
                "builds": [],
            }
        return meta

    def build(
        self,
        target: nn.Module,
        records: Sequence[dict],
        max_length: int | None = 1024,
        compute_dtype: torch.dtype = torch.float32,
        shard_records: int = 32,
        progress: bool = True,
        time_budget_s: float | None = None,
    ) -> dict:
        """Computes and stores the features of the records :meth:`missing` reports.

        Args:
            target: the frozen target (cast to ``compute_dtype`` for the duration of the build, then back).
            records: dicts with ``record_id`` (int), ``input_ids`` (list of int) and ``response_mask`` (0/1 list).
            max_length: longest context kept per record (``None`` = whole record).
            compute_dtype: dtype of the target forward (see the module docstring).
            shard_records: sequences per shard file (a kill loses at most the shard in flight).
            progress: show a tqdm bar (tokens).
            time_budget_s: stop after the shard that crosses this many seconds (the rest stays missing).

        Returns:
            dict with ``computed`` (records), ``tokens``, ``seconds``, ``tokens_per_s``, ``cached`` (total now).

        Raises:
            ValueError: the cache was built for another target / layer ids / compute dtype.
        """
        from safetensors.torch import save_file
        from tqdm.auto import tqdm

        todo = self.missing(records, max_length)
        meta = self._check_meta(target, compute_dtype)
        self.dir.mkdir(parents=True, exist_ok=True)
        if not (self.dir / _META).is_file():
            _atomic_json(self.dir / _META, meta)
        if not todo:
            return {"computed": 0, "tokens": 0, "seconds": 0.0, "tokens_per_s": 0.0, "cached": len(self)}
        lengths = [feature_length(r["input_ids"], r["response_mask"], max_length) for r in todo]
        orig_dtype = next(target.parameters()).dtype
        was_training = target.training
        target.eval()
        saved = None
        if orig_dtype != compute_dtype:
            # casting back would leave the weights rounded to compute_dtype (the frozen LM head and embeddings of
            # the training loss among them): keep exact copies to restore
            # (parameters AND buffers: rotary frequencies and embedding scales are non-persistent buffers that
            # state_dict() leaves out; named_* also share one copy for tied weights)
            saved = {k: v.detach().to("cpu", copy=True)
                     for k, v in [*target.named_parameters(), *target.named_buffers()]}
            target.to(compute_dtype)
        device = next(target.parameters()).device
        t0 = time.time()
        done_tokens, done_records = 0, 0
        bar = tqdm(total=sum(lengths), unit="tok", desc="target features", disable=not progress, smoothing=0.05)
        pending: dict[str, torch.Tensor] = {}
        try:
            for rec, n in zip(todo, lengths):
                ids = torch.tensor([list(rec["input_ids"][:n])], dtype=torch.long, device=device)
                out = target_features(target, ids, self.layer_ids, with_next=self.with_next, topk=self.topk)
                feats, *extra = out if self.with_next else (out,)
                rid = int(rec["record_id"])
                if self.with_next:
                    pending[f"{rid}.next"] = extra[0][0].to(torch.int32).cpu()
                if self.topk:  # logits within a few units of each other: float16 keeps ~3 decimal digits
                    pending[f"{rid}.topv"] = extra[1][0].to(torch.float16).cpu()
                    pending[f"{rid}.topi"] = extra[2][0].to(torch.int32).cpu()
                pending[str(rid)] = feats[0].to(STORAGE_DTYPE).contiguous().cpu()
                pending[f"{rid}.ids"] = ids[0].to(torch.int32).cpu()
                done_tokens += n
                done_records += 1
                bar.update(n)
                last = done_records == len(todo)
                over = time_budget_s is not None and time.time() - t0 > time_budget_s
                if len(pending) >= (2 + self.with_next + 2 * bool(self.topk)) * shard_records or last or over:
                    batch, pending = pending, {}
                    self._write_shard(batch, save_file)
                    if over and not last:
                        logger.warning("feature build stopped by its time budget after %d records", done_records)
                        break
        finally:
            bar.close()
            if pending:  # interrupted by an exception: keep what is complete
                self._write_shard(pending, save_file)
            if saved is not None:
                target.to(orig_dtype)
                with torch.no_grad():
                    for k, v in [*target.named_parameters(), *target.named_buffers()]:
                        v.copy_(saved[k])
            target.train(was_training)
            seconds = time.time() - t0
            meta = self.meta or meta
            meta.setdefault("builds", []).append({
                "records": done_records, "tokens": done_tokens, "seconds": round(seconds, 1),
                "tokens_per_s": round(done_tokens / max(seconds, 1e-9), 1), "max_length": max_length,
                "threads": torch.get_num_threads(), "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            })
            _atomic_json(self.dir / _META, meta)
            self.refresh()
        return {"computed": done_records, "tokens": done_tokens, "seconds": seconds,
                "tokens_per_s": done_tokens / max(seconds, 1e-9), "cached": len(self)}

    def _write_shard(self, tensors: dict[str, torch.Tensor], save_file) -> Path:
        name = f"feat-{time.time_ns():020d}-{os.getpid()}.safetensors"
        final = self.dir / name
        tmp = self.dir / f".{name}.tmp"
        save_file(tensors, str(tmp), metadata={"format": "dflash2-target-features"})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
        return final


__all__ = ["FeatureCache", "STORAGE_DTYPE", "cache_key", "feature_length"]
