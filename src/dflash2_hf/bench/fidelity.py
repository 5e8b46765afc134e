"""Fidelity of greedy outputs to plain greedy decoding: where a non-identical output parts, and whether at a near-tie.

In float32 every method is token-for-token identical to plain greedy decoding (DESIGN.md section 8): any divergence
is a bug. In bfloat16 (or float16) a target forward over several tokens rounds differently from one token at a time,
so where plain decoding's top two scores are closer than that rounding, a block verification may pick the other one.
For every output that is not identical to plain greedy this module finds

* ``position``: the first new token where it differs (both outputs agree before it, so both saw the same context);
* ``plain_token`` ``x`` and ``other_token`` ``y`` there, and the plain run's processed scores ``s`` at that step
  (the logits after ``generate()``'s logits processors, the ones its argmax chose ``x`` from; recomputed by re-running
  plain greedy for ``position + 1`` tokens, which must reproduce plain's tokens);
* ``margin = s[x] - s[y]`` (>= 0; ``margin_top2``: plain's top-1 minus top-2 score, <= ``margin``);

and calls it a **near-tie** iff ``margin <= NEAR_TIE_ULPS * ulp(max |s|)``, ``ulp`` being the spacing of the target
dtype's numbers at the largest score (bf16: ``2**-7 * 2**floor(log2 max|s|)``, 0.125 for scores in [16, 32)).
Anything else is a bug; in float32 every divergence is a bug. Why ``NEAR_TIE_ULPS = 8``: on SmolLM2-135M in bf16
(``examples/bf16_margin_noise.py``, AMD EPYC, 4 prompts x 32 tokens, blocks of 8 and of 16) feeding the same tokens
in a block instead of one at a time moved plain's top-1/runner-up margin by at most 2 such ulps and its margin to
any of its top 10 by at most 3; 8 leaves room for other kernels (AMX, GPUs) and deeper targets, while a verification
that accepts a wrong token parts at margins of many logits (tens to hundreds of ulps). docs/bench.md has the details.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

import torch

NEAR_TIE_ULPS = 8.0


def ulp(value: float, dtype: torch.dtype = torch.bfloat16) -> float:
    """Spacing of ``dtype``'s floating-point numbers at ``|value|``: ``finfo(dtype).eps * 2**floor(log2 |value|)``
    (bf16: eps = 2**-7, so 0.125 for values in [16, 32)); the smallest normal's spacing for 0 or subnormals.

    Raises:
        TypeError: ``dtype`` is not a floating-point dtype.
    """
    info = torch.finfo(dtype)
    magnitude = max(abs(float(value)), info.tiny)
    return info.eps * 2.0 ** math.floor(math.log2(magnitude))


def first_difference(reference: Sequence[int], other: Sequence[int]) -> int | None:
    """First index where the two token sequences differ (the shorter one's length if one is a prefix of the other);
    None when they are identical."""
    for i, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return i
    return None if len(reference) == len(other) else min(len(reference), len(other))


@dataclass
class Divergence:
    """Where an output parts from plain greedy and the plain run's scores there (see the module docstring).

    ``other_token`` / ``plain_token`` is None where that output had already ended (then ``margin`` is None and the
    divergence is not a near-tie). ``other_rank``: rank of ``other_token`` in plain's scores (1 = plain's own top
    token). ``margin_ulps = margin / ulp``. ``near_tie``: ``margin <= bound_ulps * ulp`` in ``dtype`` (never in
    float32 when judged). ``classification``: ``"near-tie"`` or ``"bug"`` (``"beyond rounding"`` when only measured,
    see :func:`classify`); ``reason`` says why in words.
    """

    position: int
    plain_token: int | None
    other_token: int | None
    margin: float | None
    margin_top2: float | None
    ulp: float | None
    margin_ulps: float | None
    other_rank: int | None
    dtype: str
    bound_ulps: float
    near_tie: bool
    classification: str
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)


def classify(scores: torch.Tensor | None, position: int, plain_token: int | None, other_token: int | None,
             dtype: torch.dtype, bound_ulps: float = NEAR_TIE_ULPS, judge: bool = True,
             fp32_identity: bool = True) -> Divergence:
    """Classifies one divergence from plain's processed scores ``scores`` (``(V,)``, any float dtype) at ``position``.

    ``dtype``: the dtype whose rounding may explain it (the target's). ``judge``: True for a lossless method against
    plain greedy: in float32 any divergence is a bug (token identity is the contract there), elsewhere any that is
    not a near-tie; False only measures (the bf16-vs-fp32 calibration: ``"near-tie"`` or ``"beyond rounding"``).
    ``fp32_identity=False``: the method ran on other kernels than plain (``optimize_for_cpu``'s prepacked linears
    round differently from stock ones), so float32 divergences are judged by the near-tie rule in float32 ulps too.
    """
    name = str(dtype).replace("torch.", "")
    if scores is None or plain_token is None or other_token is None:
        ended = "the other output" if other_token is None else "plain greedy"
        return Divergence(position, plain_token, other_token, None, None, None, None, None, name, bound_ulps, False,
                          "bug", f"{ended} ends after {position} tokens while the other goes on")
    s = scores.detach().float().flatten().cpu()
    finite = s[torch.isfinite(s)]
    unit = ulp(finite.abs().max().item() if finite.numel() else 0.0, dtype)
    top2 = s.topk(2).values
    margin = (s[plain_token] - s[other_token]).item()
    rank = int((s > s[other_token]).sum().item()) + 1
    fp32_contract = judge and dtype == torch.float32 and fp32_identity
    near = margin <= bound_ulps * unit and not fp32_contract
    ulps = margin / unit if math.isfinite(margin) else math.inf
    if fp32_contract:
        reason = f"float32: outputs must be identical (plain's margin {margin:.4g})"
    else:
        reason = (f"plain's margin {margin:.4g} = {ulps:.1f} {name} ulps {'<=' if near else '>'} {bound_ulps:g}: "
                  f"{'within' if near else 'beyond'} rounding")
    verdict = "near-tie" if near else ("bug" if judge else "beyond rounding")
    return Divergence(position, plain_token, other_token, margin, (top2[0] - top2[1]).item(), unit, ulps, rank, name,
                      bound_ulps, near, verdict, reason)


@torch.no_grad()
def plain_scores(target, input_ids: torch.LongTensor, plain_ids: Sequence[int], steps: int,
                 generate_kwargs: dict | None = None) -> tuple[torch.Tensor, ...] | None:
    """Re-runs plain greedy ``target.generate()`` for ``steps`` new tokens with ``output_scores=True``.

    Args:
        input_ids: ``(1, T)`` prompt on the target's device.
        plain_ids: plain greedy's new tokens of the same call (the re-run must reproduce its first ``steps``).
        generate_kwargs: the other ``generate()`` arguments of the original call (``do_sample=False`` is forced).

    Returns:
        ``steps`` processed score tensors of shape ``(1, V)`` (float32), or None when the re-run did not reproduce
        ``plain_ids[:steps]`` (plain greedy itself is not deterministic on this device: nothing can be classified).
    """
    kwargs = {**(generate_kwargs or {}), "do_sample": False, "max_new_tokens": steps, "output_scores": True,
              "return_dict_in_generate": True}
    kwargs.setdefault("attention_mask", torch.ones_like(input_ids))
    out = target.generate(input_ids, **kwargs)
    if out.sequences[0, input_ids.shape[1]:].tolist() != list(plain_ids[:steps]):
        return None
    return out.scores


def explain_divergences(target, input_ids: torch.LongTensor, plain_ids: Sequence[int],
                        others: dict[str, Sequence[int]], generate_kwargs: dict | None = None,
                        bound_ulps: float = NEAR_TIE_ULPS, fp32_identity: bool = True) -> dict[str, Divergence]:
    """A :class:`Divergence` for every output in ``others`` (``{name: new token ids}``) not identical to
    ``plain_ids`` (plain greedy's new tokens for ``input_ids``, ``(1, T)``), from ONE re-run of plain greedy up to the
    latest first difference. Identical outputs get no entry. The target's parameter dtype decides the rounding;
    ``fp32_identity``: see :func:`classify`.
    """
    dtype = next(target.parameters()).dtype
    positions = {name: first_difference(plain_ids, ids) for name, ids in others.items()}
    positions = {name: p for name, p in positions.items() if p is not None}
    if not positions:
        return {}
    steps = min(max(positions.values()) + 1, len(plain_ids))
    scores = plain_scores(target, input_ids, plain_ids, steps, generate_kwargs) if steps else None
    result = {}
    for name, j in positions.items():
        ids = others[name]
        plain_token = plain_ids[j] if j < len(plain_ids) else None
        other_token = ids[j] if j < len(ids) else None
        row = scores[j][0] if scores is not None and j < len(scores) else None
        if scores is None and plain_token is not None and other_token is not None:
            result[name] = Divergence(j, plain_token, other_token, None, None, None, None, None,
                                      str(dtype).replace("torch.", ""), bound_ulps, False, "bug",
                                      "plain greedy did not reproduce its own tokens on a re-run: cannot classify")
            continue
        result[name] = classify(row, j, plain_token, other_token, dtype, bound_ulps, fp32_identity=fp32_identity)
    return result


def annotate_records(target, records: list, prompts: dict, generate_kwargs: dict | None = None,
                     bound_ulps: float = NEAR_TIE_ULPS) -> None:
    """Sets ``record.divergence`` (a :meth:`Divergence.to_dict`) on every greedy bench record
    (:class:`~dflash2_hf.bench.RawRecord`) whose output is not identical to plain's on the same prompt; one plain
    re-run per prompt that has any. ``prompts``: ``{data set: [Prompt, ...]}`` of the run.

    Plain ran on stock kernels (:mod:`dflash2_hf.cpu_kernels`), so it is re-run on them; where ``target`` is
    optimized the other methods ran on prepacked kernels, and float32 divergences are judged by the near-tie rule."""
    from ..cpu_kernels import is_optimized, stock_kernels

    fp32_identity = not is_optimized(target)
    with stock_kernels(target):
        _annotate(target, records, prompts, generate_kwargs, bound_ulps, fp32_identity)


def _annotate(target, records, prompts, generate_kwargs, bound_ulps, fp32_identity) -> None:
    device = next(target.parameters()).device
    by_key = {(name, p.prompt_id): p for name, plist in prompts.items() for p in plist}
    groups: dict = {}
    for rec in records:
        groups.setdefault((rec.dataset, rec.prompt_id), []).append(rec)
    for key, recs in groups.items():
        plain = next((r for r in recs if r.method == "plain"), None)
        diverged = [r for r in recs if r.identical_to_plain is False]
        if plain is None or not diverged:
            continue
        ids = torch.tensor([by_key[key].input_ids], device=device)
        found = explain_divergences(target, ids, plain.output_ids, {r.method: r.output_ids for r in diverged},
                                    generate_kwargs, bound_ulps, fp32_identity)
        for rec in diverged:
            rec.divergence = found[rec.method].to_dict()


@torch.no_grad()
def calibrate(reference_target, target, records: list, prompts: dict, max_new_tokens: int,
              generate_kwargs: dict | None = None, bound_ulps: float = NEAR_TIE_ULPS) -> dict:
    """Calibration: plain greedy of ``target`` (e.g. bf16; its ``plain`` records) vs plain greedy of
    ``reference_target`` (the same model in float32) on the same prompts, untimed.

    Each divergence is measured with the reference's scores and the target dtype's ulp (``judge=False``):
    rounding the weights to bf16 moves the logits more than a block verification does, so these are reported, not
    judged. Returns ``{"dtype", "reference_dtype", "num_prompts", "identical", "near_ties", "divergences": [...]}``.
    """
    dtype = next(target.parameters()).dtype
    ref_dtype = next(reference_target.parameters()).dtype
    device = next(reference_target.parameters()).device
    by_key = {(name, p.prompt_id): p for name, plist in prompts.items() for p in plist}
    divergences, identical = [], 0
    plain_records = [r for r in records if r.method == "plain"]
    for rec in plain_records:
        ids = torch.tensor([by_key[(rec.dataset, rec.prompt_id)].input_ids], device=device)
        kwargs = {**(generate_kwargs or {}), "do_sample": False, "max_new_tokens": max_new_tokens,
                  "output_scores": True, "return_dict_in_generate": True, "attention_mask": torch.ones_like(ids)}
        out = reference_target.generate(ids, **kwargs)
        ref = out.sequences[0, ids.shape[1]:].tolist()
        j = first_difference(ref, rec.output_ids)
        if j is None:
            identical += 1
            continue
        row = out.scores[j][0] if j < len(out.scores) else None
        div = classify(row, j, ref[j] if j < len(ref) else None, rec.output_ids[j] if j < len(rec.output_ids) else None,
                       dtype, bound_ulps, judge=False)
        divergences.append({"dataset": rec.dataset, "prompt_id": rec.prompt_id, **div.to_dict()})
    name = (lambda d: str(d).replace("torch.", ""))
    return {"dtype": name(dtype), "reference_dtype": name(ref_dtype), "num_prompts": len(plain_records),
            "identical": identical, "near_ties": sum(d["near_tie"] for d in divergences), "divergences": divergences}


# ------------------------------------------------------------------ report
def divergence_counts(records: list, greedy: bool) -> dict:
    """``near_ties``, ``divergence_bugs`` (non-identical outputs that are not near-ties, unclassified ones included)
    and ``fidelity_ok`` (no bug) of one aggregate row's records; all None when sampling."""
    if not greedy:
        return {"near_ties": None, "divergence_bugs": None, "fidelity_ok": None}
    diverged = [r for r in records if r.identical_to_plain is False]
    near = sum(bool(r.divergence and r.divergence["near_tie"]) for r in diverged)
    return {"near_ties": near, "divergence_bugs": len(diverged) - near, "fidelity_ok": len(diverged) == near}


def identity_cell(row: dict) -> str:
    """The ``identical`` cell of results.md: ``4/4``; ``3/4, 1 near-tie``; ``2/4 **NO: 2 bugs**``; ``n/a`` (sampling)."""
    if row["identical_to_plain"] is None:
        return "n/a"
    cell = f"{row['identical_to_plain']}/{row['num_prompts']}"
    near, bugs = row.get("near_ties"), row.get("divergence_bugs")
    if bugs is None:  # a row aggregated without fidelity counts
        return cell + ("" if row["identical_all"] else " **NO**")
    if near:
        cell += f", {near} near-tie{'s' if near > 1 else ''}"
    if bugs:
        cell += f" **NO: {bugs} bug{'s' if bugs > 1 else ''}**"
    return cell


def describe(divergence: dict | Divergence) -> str:
    """One line for a divergence, e.g. ``"near-tie at new token 37: plain's margin 0.25 = 2.0 bfloat16 ulps <= 16:
    within rounding"`` or ``"BUG at new token 5: float32: outputs must be identical (plain's margin 3.2)"``."""
    d = divergence.to_dict() if isinstance(divergence, Divergence) else divergence
    verdict = d["classification"] if d["classification"] == "near-tie" else d["classification"].upper()
    return f"{verdict} at new token {d['position']}: {d['reason']}"


def _num(x, spec=".3g"):
    return "-" if x is None else format(x, spec)


def divergence_lines(results: dict) -> list[str]:
    """results.md lines: one table row per divergence (data set ``all`` excluded), a loud line for bugs, and the
    bf16-vs-fp32 calibration when the run has one."""
    records = [r for r in results["records"] if r.get("identical_to_plain") is False]
    lines = []
    if records:
        bound = results["settings"].get("near_tie_ulps", NEAR_TIE_ULPS)
        lines += ["", f"Divergences from plain greedy (first differing new token; plain's processed scores there; "
                  f"near-tie = plain's margin to the other token <= {bound:g} ulps of its largest score in the "
                  "target dtype, else a bug; float32: every divergence is a bug; docs/bench.md):", "",
                  "| data set | prompt | method | token | plain / other token (its rank) | margin | top-2 margin | ulp "
                  "| margin / ulp | verdict |", "|---|---|---|---:|---|---:|---:|---:|---:|---|"]
        bugs = 0
        for r in records:
            d = r.get("divergence") or {}
            verdict = d.get("classification", "unclassified")
            bugs += verdict != "near-tie"
            lines.append(
                f"| {r['dataset']} | {r['prompt_id']} | {r['method']} | {d.get('position', '?')} | "
                f"{d.get('plain_token')} / {d.get('other_token')} ({d.get('other_rank') or '-'}) | "
                f"{_num(d.get('margin'))} | {_num(d.get('margin_top2'))} | {_num(d.get('ulp'))} | "
                f"{_num(d.get('margin_ulps'), '.1f')} | {verdict if verdict == 'near-tie' else f'**{verdict.upper()}**'} |")
        if bugs:
            lines += ["", f"**BUG: {bugs} output(s) part from plain greedy where rounding cannot explain it (see "
                      "`divergence` in results.json records).**"]
    cal = results.get("calibration")
    if cal:
        where = ", ".join(f"{d['dataset']}#{d['prompt_id']} at token {d['position']} (margin "
                          f"{_num(d['margin_ulps'], '.1f')} {cal['dtype']} ulps, {d['classification']})"
                          for d in cal["divergences"])
        lines += ["", f"Calibration: plain {cal['dtype']} vs plain {cal['reference_dtype']} greedy on the same prompts: "
                  f"{cal['identical']}/{cal['num_prompts']} identical" + (f"; parted at {where}" if where else "")
                  + f" (margins are the {cal['reference_dtype']} run's, not judged)."]
    return lines


__all__ = ["NEAR_TIE_ULPS", "annotate_records", "calibrate", "describe", "divergence_counts", "divergence_lines",
           "identity_cell", "Divergence", "classify", "explain_divergences", "first_difference", "plain_scores", "ulp"]
