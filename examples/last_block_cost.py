"""What the last block near ``max_new_tokens`` costs: a full drafter block cut to the drafts that fit (ours) or a
shorter block (the reference loop), and one verified target position more or less (docs/DESIGN.md section 6).

Random weights (timing only), a SmolLM2-135M-shaped target (30 layers, width 576, vocabulary 49152) and the shipped
drafter's shape (5 layers, B = 16), fp32, one thread, 300 cached context positions; medians of interleaved runs::

    OMP_NUM_THREADS=1 python examples/last_block_cost.py
"""

from __future__ import annotations

import statistics
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from dflash2_hf import DFlash2DraftModel

CONTEXT = 300
ROUNDS = 40


def median_ms(fns: dict, rounds: int = ROUNDS) -> dict:
    """Median wall time (ms) of each callable, the callables interleaved round by round."""
    times = {k: [] for k in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(rounds):
        for key, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - start)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                          num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                          max_position_embeddings=4096)).eval()
    head = target.get_output_embeddings()
    # one drafter per block length (the convolution needs whole blocks); the same shape otherwise
    drafters = {b: DFlash2DraftModel.from_target(target, num_hidden_layers=5, block_size=b).eval()
                for b in (2, 4, 8, 16)}
    context = torch.randn(1, CONTEXT, drafters[16].fc.in_features)
    with torch.no_grad():
        cache = DynamicCache()
        drafters[16](torch.randn(1, 16, 576), context, cache=cache)
        cache.crop(-16)
        target_cache = DynamicCache()
        target(torch.randint(0, 49152, (1, CONTEXT)), past_key_values=target_cache)

        def draft(width: int, drafts: int):
            model, embeds = drafters[width], torch.randn(1, width, 576)
            positions = torch.arange(CONTEXT, CONTEXT + width)[None]

            def run():
                hidden = model(embeds, None, position_ids=positions, cache=cache).last_hidden_state
                cache.crop(-width)
                model.compute_logits(hidden[:, 1 : 1 + drafts], head)

            return run

        def verify(n: int):
            ids = torch.randint(0, 49152, (1, n))

            def run():
                target(ids, past_key_values=target_cache)
                target_cache.crop(-n)

            return run

        drafting = median_ms({(w, d): draft(w, d) for d in (1, 3, 7) for w in (d + 1, 16)})
        verifying = median_ms({n: verify(n) for n in (1, 2, 4, 8, 16)})
    for drafts in (1, 3, 7):
        print(f"{drafts} drafts: block of {drafts + 1:2d} {drafting[(drafts + 1, drafts)]:6.1f} ms, "
              f"full block of 16 {drafting[(16, drafts)]:6.1f} ms")
    for n, ms in verifying.items():
        print(f"target verification of {n:2d} positions: {ms:6.1f} ms")


if __name__ == "__main__":
    main()
