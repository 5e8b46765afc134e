"""How far bf16 rounding moves the target's top-token margins between a block forward and one token at a time.

This is the measurement behind ``dflash2_hf.bench.fidelity.NEAR_TIE_ULPS`` (docs/bench.md, "Fidelity in bf16"). For
each prompt, plain greedy decoding gives the one-token-at-a-time scores ``a`` of every new position; the same tokens
are then fed in blocks of ``--block`` on a KV cache (as a verification does), giving ``b``. With ``x`` = plain's
top token and ``y`` one of its next ``--top - 1`` tokens, the margin ``a[x] - a[y]`` moves by
``|(a[x] - a[y]) - (b[x] - b[y])|``; the script prints that shift in ulps of ``max |a|`` in the target dtype (the unit
of the near-tie bound), for ``y`` = the runner-up and for the worst of the top ``--top``.

    PYTHONPATH=src python examples/bf16_margin_noise.py --num-prompts 2 --max-new-tokens 32 --num-threads 1
"""

from __future__ import annotations

import argparse
import statistics

import torch
from transformers import DynamicCache

import dflash2_hf  # noqa: F401
from dflash2_hf.bench import load_bench_prompts
from dflash2_hf.bench.fidelity import NEAR_TIE_ULPS, ulp
from dflash2_hf.targets import load_target


@torch.no_grad()
def margin_shifts(target, ids: torch.LongTensor, new: int, block: int, top: int) -> list[tuple[float, float]]:
    """``[(runner-up shift, worst top-`top` shift)]`` in ulps, one per new position of plain greedy."""
    out = target.generate(ids, max_new_tokens=new, do_sample=False, eos_token_id=None, output_logits=True,
                          return_dict_in_generate=True, attention_mask=torch.ones_like(ids))
    step = torch.stack([s[0] for s in out.logits]).float()
    cache, start = DynamicCache(), ids.shape[1] - 1
    target(ids[:, :start], past_key_values=cache, use_cache=True)
    blocks = []
    for pos in range(start, start + step.shape[0], block):  # [anchor, next tokens] as a verification feeds them
        chunk = out.sequences[:, pos:min(pos + block, start + step.shape[0])]
        blocks.append(target(chunk, past_key_values=cache, use_cache=True).logits[0].float())
    blocked = torch.cat(blocks)[: step.shape[0]]
    dtype = next(target.parameters()).dtype
    shifts = []
    for a, b in zip(step, blocked):
        unit = ulp(a.abs().max().item(), dtype)
        idx = a.topk(top).indices
        moved = ((a[idx[0]] - a[idx[1:]]) - (b[idx[0]] - b[idx[1:]])).abs() / unit
        shifts.append((moved[0].item(), moved.max().item()))
    return shifts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    parser.add_argument("--datasets", default="sharegpt,humaneval")
    parser.add_argument("--num-prompts", type=int, default=2, help="per data set")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--block", type=int, default=8, help="verification block length (the drafter's B)")
    parser.add_argument("--top", type=int, default=10, help="margins to the top-1 of this many tokens")
    parser.add_argument("--num-threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    target, tokenizer = load_target(args.target, dtype=dtype)
    prompts, _ = load_bench_prompts(args.datasets.split(","), tokenizer, num_prompts=args.num_prompts)
    shifts = []
    for name, plist in prompts.items():
        for p in plist:
            shifts += margin_shifts(target, torch.tensor([p.input_ids]), args.max_new_tokens, args.block, args.top)
    for label, values in (("runner-up", [s[0] for s in shifts]), (f"worst of top {args.top}", [s[1] for s in shifts])):
        values.sort()
        q = lambda f: values[min(len(values) - 1, int(f * len(values)))]  # noqa: E731
        print(f"margin shift to the {label} ({len(values)} positions, {args.dtype} ulps of max |logit|): median "
              f"{statistics.median(values):.1f}, 90% {q(0.9):.1f}, 99% {q(0.99):.1f}, max {values[-1]:.1f}; "
              f"share <= {NEAR_TIE_ULPS:g}: {sum(v <= NEAR_TIE_ULPS for v in values) / len(values):.3f}")


if __name__ == "__main__":
    main()
