"""What a CPU second buys in training, measured interleaved on this machine (medians; the machine may be shared,
so compare the numbers of one run with each other).

``--compare vocab``: one drafter training step (forward + backward + loss) with the LM head over the whole
vocabulary vs the draft vocabulary (float32).
``--compare dtype``: the target's feature pass (``train --feature-dtype``) and one training step (``train --bf16``,
bfloat16 autocast) in float32 vs bfloat16. bfloat16 pays where the CPU computes it (AVX512-BF16 / AMX: check
``lscpu``); on an AVX2-only CPU it is emulated and slower.

Uses the shipped drafter and the real target, one sequence of ``--length`` tokens of random target features with
``--num-blocks`` blocks (64: the release recipe), random labels drawn from the draft vocabulary::

    PYTHONPATH=src .venv/bin/python examples/train_step_cost.py --compare vocab --num-threads 1 --repeats 5
    PYTHONPATH=src .venv/bin/python examples/train_step_cost.py --compare dtype --num-threads 1 --length 512
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time

import torch

from dflash2_hf import DFlash2DraftModel
from dflash2_hf.targets import load_target
from dflash2_hf.training import BlockCollator, drafter_loss


def interleaved_medians(fns: dict, repeats: int) -> dict:
    """Median seconds of each callable, one warm-up call each, then the callables in turn ``repeats`` times."""
    for fn in fns.values():
        fn()
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare", choices=["vocab", "dtype"], default="vocab")
    parser.add_argument("--drafter", default="model_cards/dflash2-smollm2-135m-instruct")
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--num-blocks", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    target, _ = load_target("smollm2")
    draft = DFlash2DraftModel.from_pretrained(args.drafter, dtype=torch.float32).train()
    cfg = draft.config
    g = torch.Generator().manual_seed(0)
    ids = draft.draft_vocab_ids[torch.randint(0, cfg.draft_vocab_size, (args.length,), generator=g)]
    item = {"input_ids": ids, "response_mask": torch.ones(args.length, dtype=torch.bool),
            "context_hidden_states": torch.randn(args.length, len(cfg.target_layer_ids) * cfg.target_hidden_size,
                                                 generator=g)}
    batch = BlockCollator(cfg.block_size, cfg.mask_token_id, num_blocks=args.num_blocks)([item])
    head, embed = target.get_output_embeddings(), target.get_input_embeddings().weight
    labels = int((batch["labels"] != -100).sum())

    def step(model, autocast: bool = False) -> None:
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with ctx:
            out = model(noise_embeds=model.embed_block(batch["block_input_ids"], embed),
                        context_hidden_states=batch["context_hidden_states"], position_ids=batch["position_ids"],
                        attention_mask=batch["attention_mask"])
            loss = drafter_loss(model, out.last_hidden_state, batch["labels"], batch["predecessor_ids"], head,
                                cfg.block_size).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    if args.compare == "vocab":
        full = copy.deepcopy(draft)
        full.set_draft_vocab(torch.arange(target.config.vocab_size))  # every row: the old loss
        med = interleaved_medians({"full vocabulary": lambda: step(full), "draft vocabulary": lambda: step(draft)},
                                  args.repeats)
        for k, v in med.items():
            rows = target.config.vocab_size if k.startswith("full") else cfg.draft_vocab_size
            print(f"{k:17s} (V={rows}): {v:.3f} s/step, {labels / v:.0f} predicted tokens/s")
        print(f"speed-up {med['full vocabulary'] / med['draft vocabulary']:.2f}x")
    else:
        target_bf16 = copy.deepcopy(target).to(torch.bfloat16)
        tokens = torch.randint(0, target.config.vocab_size, (1, args.length), generator=g)

        def features(model) -> None:
            with torch.no_grad():
                model(tokens, output_hidden_states=True)

        med = interleaved_medians({"features float32": lambda: features(target),
                                   "features bfloat16": lambda: features(target_bf16),
                                   "train step float32": lambda: step(draft),
                                   "train step bf16 autocast": lambda: step(draft, autocast=True)}, args.repeats)
        for k, v in med.items():
            unit = (f"{args.length / v:.0f} target tokens/s" if k.startswith("features")
                    else f"{labels / v:.0f} predicted tokens/s")
            print(f"{k:25s}: {v:.3f} s, {unit}")
        print(f"bfloat16 speed-up: features {med['features float32'] / med['features bfloat16']:.2f}x, "
              f"train step {med['train step float32'] / med['train step bf16 autocast']:.2f}x")
    print(f"({args.num_threads} thread(s), {labels} labels per step, median of {args.repeats})")


if __name__ == "__main__":
    main()
