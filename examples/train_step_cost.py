"""One drafter training step (forward + backward + loss), with the LM head over the whole vocabulary vs the draft
vocabulary, measured interleaved on this machine.

Uses the shipped drafter and the real target's frozen LM head, one 1024-token sequence of random target features
and 64 blocks (the release recipe's --num-blocks), random labels drawn from the draft vocabulary.

    PYTHONPATH=src .venv/bin/python examples/train_step_cost.py --num-threads 1 --repeats 5
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from dflash2_hf import DFlash2DraftModel
from dflash2_hf.targets import load_target
from dflash2_hf.training import BlockCollator, drafter_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default="model_cards/dflash2-smollm2-135m-instruct")
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--num-blocks", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    target, _ = load_target("smollm2")
    draft = DFlash2DraftModel.from_pretrained(args.drafter, dtype=torch.float32).train()
    full = copy.deepcopy(draft)
    full.set_draft_vocab(torch.arange(target.config.vocab_size))  # every row: the old loss
    cfg = draft.config
    g = torch.Generator().manual_seed(0)
    ids = draft.draft_vocab_ids[torch.randint(0, cfg.draft_vocab_size, (args.length,), generator=g)]
    item = {"input_ids": ids, "response_mask": torch.ones(args.length, dtype=torch.bool),
            "context_hidden_states": torch.randn(args.length, len(cfg.target_layer_ids) * cfg.target_hidden_size,
                                                 generator=g)}
    batch = BlockCollator(cfg.block_size, cfg.mask_token_id, num_blocks=args.num_blocks)([item])
    head, embed = target.get_output_embeddings(), target.get_input_embeddings().weight

    def step(model) -> float:
        t0 = time.perf_counter()
        out = model(noise_embeds=model.embed_block(batch["block_input_ids"], embed),
                    context_hidden_states=batch["context_hidden_states"], position_ids=batch["position_ids"],
                    attention_mask=batch["attention_mask"])
        loss = drafter_loss(model, out.last_hidden_state, batch["labels"], batch["predecessor_ids"], head,
                            cfg.block_size).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    times = {"full vocabulary": [], "draft vocabulary": []}
    step(full), step(draft)  # warm-up
    for _ in range(args.repeats):
        times["full vocabulary"].append(step(full))
        times["draft vocabulary"].append(step(draft))
    labels = int((batch["labels"] != -100).sum())
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in med.items():
        print(f"{k:17s} (V={target.config.vocab_size if k.startswith('full') else cfg.draft_vocab_size}): "
              f"{v:.3f} s/step, {labels / v:.0f} predicted tokens/s")
    print(f"speed-up {med['full vocabulary'] / med['draft vocabulary']:.2f}x ({args.num_threads} thread(s), "
          f"{labels} labels per step, median of {args.repeats})")


if __name__ == "__main__":
    main()
