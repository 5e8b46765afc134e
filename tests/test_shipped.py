"""The shipped folders under model_cards/ as a user loads them: the SmolLM2 drafter and its code LoRA adapter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from peft import PeftModel

from dflash2_hf import DFlash2DraftModel, GenerationStats
from dflash2_hf.lora import adapter_size_bytes, checkpoint_size_bytes, load_adapter

ROOT = Path(__file__).resolve().parents[1] / "model_cards"
DRAFTER = ROOT / "dflash2-smollm2-135m-instruct"
ADAPTER = ROOT / "dflash2-smollm2-135m-instruct-code-lora"
CODE_PROMPT = "Complete the following Python function:\n```python\ndef add(a: int, b: int) -> int:\n" \
              "    \"\"\"Return the sum of a and b.\"\"\"\n```"


@pytest.fixture(scope="module")
def smollm2():
    from dflash2_hf.targets import load_target

    target, tokenizer = load_target("smollm2")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": CODE_PROMPT}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    return target, ids, target.generate(ids, max_new_tokens=40, do_sample=False)


def _card_meta(folder: Path) -> dict:
    return yaml.safe_load((folder / "README.md").read_text().split("---")[1])


def test_shipped_drafter_loads_and_is_lossless(smollm2):
    target, ids, ref = smollm2
    drafter = DFlash2DraftModel.from_pretrained(DRAFTER)
    drafter.check_target(target)
    assert drafter.dtype == torch.bfloat16 and drafter.config.block_size == 8
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=40, do_sample=False)
    assert torch.equal(ref, out)
    assert sum(drafter.generation_stats.accepted_drafts) > 0  # a trained drafter gets some drafts accepted
    meta = _card_meta(DRAFTER)
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and meta["license"] and meta["datasets"]


def test_shipped_code_adapter_unmerged_merged_and_peft(smollm2):
    target, ids, ref = smollm2
    assert adapter_size_bytes(ADAPTER) < 0.15 * checkpoint_size_bytes(DRAFTER)
    meta = _card_meta(ADAPTER)
    assert meta["library_name"] == "peft" and "lora" in meta["tags"]

    stats = {}
    adapted = load_adapter(DFlash2DraftModel.from_pretrained(DRAFTER), ADAPTER)
    via_peft = PeftModel.from_pretrained(DFlash2DraftModel.from_pretrained(DRAFTER), str(ADAPTER))
    base = DFlash2DraftModel.from_pretrained(DRAFTER)
    for name, assistant in (("unmerged", adapted), ("peft", via_peft), ("merged", adapted.merge_and_unload()),
                            ("base", base)):
        out = target.generate(ids, assistant_model=assistant, max_new_tokens=40, do_sample=False)
        assert torch.equal(ref, out), name
        stats[name] = getattr(assistant, "generation_stats", None) or assistant.get_base_model().generation_stats
    assert isinstance(stats["merged"], GenerationStats)
    # the adapter changes the drafts (it is not an identity adapter); merged == unmerged up to bf16 rounding
    assert stats["merged"].accepted_drafts != stats["base"].accepted_drafts
