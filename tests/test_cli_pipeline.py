"""The whole user pipeline through the `dflash2` command on a tiny offline target:
prepare-data -> train -> train --lora -> generate with the drafter and its adapter."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from dflash2_hf import DFlash2DraftModel
from dflash2_hf.cli import main
from dflash2_hf.lora import load_adapter
from dflash2_hf.training import load_training_records
from dflash2_hf.training.draft_vocab import draft_vocab_from_records, eos_ids
from test_data import _tiny_tokenizer, tiny_chat_target_folder


def test_prepare_train_lora_generate(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path / "cache"))
    tok = _tiny_tokenizer()
    t = tiny_chat_target_folder(tmp_path / "target")
    target = AutoModelForCausalLM.from_pretrained(t).eval()

    assert main(["prepare-data", "--target", t, "--output-dir", str(tmp_path / "data"), "--start", "0", "--stop", "12",
                 "--batch-size", "4", "--max-new-tokens", "24", "--max-prompt-tokens", "4000", "--no-progress"]) == 0
    meta = json.load(open(tmp_path / "data" / "dflash2_dataset.json"))
    assert meta["counts"]["kept"] > 0

    common = ["--target", t, "--data", str(tmp_path / "data"), "--num-blocks", "4", "--save-steps", "1000",
              "--logging-steps", "5", "--disable-tqdm", "true", "--max-length", "2048"]
    assert main(["train", *common, "--output-dir", str(tmp_path / "drafter"), "--num-layers", "2", "--block-size", "4",
                 "--max-steps", "6"]) == 0
    drafter = DFlash2DraftModel.from_pretrained(tmp_path / "drafter")
    assert drafter.config.block_size == 4 and drafter.config.num_hidden_layers == 2

    assert main(["train", *common, "--output-dir", str(tmp_path / "adapter"), "--init", str(tmp_path / "drafter"),
                 "--lora", "--lora-r", "4", "--max-steps", "6"]) == 0
    files = {p.name for p in (tmp_path / "adapter").iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "dflash2_adapter.json"} <= files
    assert "model.safetensors" not in files  # only the adapter is saved

    # --draft-vocab re-chooses the draft vocabulary of an --init drafter from the training data (most frequent first)
    assert main(["train", *common, "--output-dir", str(tmp_path / "vocab"), "--init", str(tmp_path / "drafter"),
                 "--draft-vocab", "6", "--max-steps", "2"]) == 0
    revocab = DFlash2DraftModel.from_pretrained(tmp_path / "vocab")
    expected, _ = draft_vocab_from_records(load_training_records(str(tmp_path / "data")), 6,
                                           always=eos_ids(revocab.config))
    assert revocab.config.draft_vocab_size == 6 and revocab.draft_vocab_ids.tolist() == expected.tolist()
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    assert torch.equal(target.generate(ids, max_new_tokens=10, do_sample=False),
                       target.generate(ids, assistant_model=revocab, max_new_tokens=10, do_sample=False))
    for bad in (["--lora"], []):  # an adapter cannot change its base's vocabulary; a size past the vocabulary
        size = "20" if bad else str(revocab.config.vocab_size + 1)
        assert main(["train", *common, "--output-dir", str(tmp_path / "bad"), "--init", str(tmp_path / "drafter"),
                     "--draft-vocab", size, "--max-steps", "1", *bad]) == 2
    assert not (tmp_path / "bad").exists()  # refused before any work

    adapted = load_adapter(DFlash2DraftModel.from_pretrained(tmp_path / "drafter"), tmp_path / "adapter")
    ids = tok.apply_chat_template([{"role": "user", "content": "hello there"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    ref = target.generate(ids, max_new_tokens=12, do_sample=False)
    for assistant in (drafter, adapted, adapted.merge_and_unload()):
        assert torch.equal(ref, target.generate(ids, assistant_model=assistant, max_new_tokens=12, do_sample=False))

    # generate with the adapter merged (load_drafter(..., adapter=...)), from the command line
    capsys.readouterr()
    assert main(["generate", "--target", t, "--drafter", str(tmp_path / "drafter"), "--adapter",
                 str(tmp_path / "adapter"), "--prompt", "hello there", "--max-new-tokens", "8", "--compare"]) == 0
    assert "greedy outputs identical: True" in capsys.readouterr().out

    # the side-by-side benchmark of base vs adapted drafter, through the command line
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("hello there", "how are you")))
    out = tmp_path / "bench"
    assert main(["bench", "--target", t, "--drafter", str(tmp_path / "drafter"), "--adapter", str(tmp_path / "adapter"),
                 "--datasets", str(prompts), "--num-prompts", "2", "--max-new-tokens", "8", "--methods",
                 "plain,dflash2", "--output-dir", str(out), "--no-plots", "--no-progress", "--no-warmup"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["methods"] == ["plain", "dflash2", "dflash2_adapter"]
    assert results["meta"]["adapter_bytes"] > 0 and results["meta"]["drafter_bytes"] > results["meta"]["adapter_bytes"]
    assert all(r["identical_to_plain"] for r in results["records"])
    assert "LoRA adapter (method `dflash2_adapter`)" in (out / "results.md").read_text()
    with pytest.raises(SystemExit) as refused:  # a missing adapter folder: refused while parsing
        main(["bench", "--target", t, "--drafter", str(tmp_path / "drafter"), "--adapter", str(tmp_path / "nope"),
              "--datasets", str(prompts), "--output-dir", str(tmp_path / "bench2"), "--no-progress"])
    assert refused.value.code == 2 and not (tmp_path / "bench2").exists()
    # a new drafter against the previous one (here: the adapter merged, saved as a drafter of its own)
    adapted.merge_and_unload().save_pretrained(tmp_path / "merged")
    bench = ["bench", "--target", t, "--drafter", str(tmp_path / "merged"), "--datasets", str(prompts),
             "--num-prompts", "2", "--max-new-tokens", "8", "--no-plots", "--no-progress", "--no-warmup"]
    assert main([*bench, "--previous-drafter", str(tmp_path / "drafter"), "--methods", "plain,dflash2",
                 "--output-dir", str(tmp_path / "bench3")]) == 0
    results = json.loads((tmp_path / "bench3" / "results.json").read_text())
    assert results["settings"]["methods"] == ["plain", "dflash2", "dflash2_previous"]
    assert results["meta"]["previous_drafter"] == str(tmp_path / "drafter")
    assert all(r["identical_to_plain"] for r in results["records"])
    assert main([*bench, "--methods", "plain,dflash2_previous", "--output-dir", str(tmp_path / "bench4")]) == 2
    # one drafter in two drafting precisions side by side (where this torch has int8 kernels)
    from dflash2_hf.quantization import int8_support

    if int8_support("cpu")[0]:
        assert main([*bench, "--previous-drafter", str(tmp_path / "merged"), "--drafter-dtype", "int8",
                     "--previous-drafter-dtype", "fp32", "--methods", "plain,dflash2", "--output-dir", str(tmp_path / "bench5")]) == 0
        results = json.loads((tmp_path / "bench5" / "results.json").read_text())
        assert (results["meta"]["drafter_dtype"], results["meta"]["previous_drafter_dtype"]) == ("int8", "fp32")
        assert all(r["identical_to_plain"] for r in results["records"])
        assert "`dflash2_previous`): `" + str(tmp_path / "merged") + "` in fp32" in (tmp_path / "bench5" / "results.md").read_text()

    # a code-domain set: prepare-data --only-code, then a LoRA run on all of it (--only-code keeps such a folder whole)
    assert main(["prepare-data", "--target", t, "--output-dir", str(tmp_path / "code"), "--start", "0", "--stop", "20",
                 "--only-code", "--batch-size", "4", "--max-new-tokens", "8", "--max-prompt-tokens", "4000",
                 "--no-progress"]) == 0
    code_meta = json.load(open(tmp_path / "code" / "dflash2_dataset.json"))
    assert code_meta["provenance"]["source"]["filter"] == "code" and code_meta["counts"]["skipped"]["filtered_out"] >= 10
    kept = code_meta["counts"]["kept"]
    assert kept >= 2
    code_common = [*common[:2], "--data", str(tmp_path / "code"), *common[4:6], *common[8:]]
    assert main(["train", *code_common, "--output-dir", str(tmp_path / "code-lora"), "--init", str(tmp_path / "drafter"),
                 "--lora", "--only-code", "--max-steps", "2", "--save-steps", "1",
                 "--lora-modules-to-save", "attention_conv,mlp_conv", "--lora-modules-lr", "1e-5"]) == 0
    assert json.load(open(tmp_path / "code-lora" / "training_summary.json"))["sequences"] == kept
    # the convolutions are trained in full, at their own rate, and saved with the adapter
    assert any(k.endswith("mlp_conv.base_kernel") for k in load_file(tmp_path / "code-lora" / "adapter_model.safetensors"))
    groups = torch.load(tmp_path / "code-lora" / "checkpoint-1" / "optimizer.pt", weights_only=False)["param_groups"]
    assert sorted({g["initial_lr"] for g in groups if g["params"]}) == [1e-5, 6e-4]
    # --lora-init goes on training that adapter (its modules to save included) instead of a fresh one
    assert main(["train", *code_common, "--output-dir", str(tmp_path / "code-lora2"), "--init", str(tmp_path / "drafter"),
                 "--lora", "--lora-init", str(tmp_path / "code-lora"), "--only-code", "--max-steps", "3", "--warmup-steps", "0",
                 "--lora-save-dtype", "bf16"]) == 0
    first = load_file(tmp_path / "code-lora" / "adapter_model.safetensors")
    second = load_file(tmp_path / "code-lora2" / "adapter_model.safetensors")
    assert first.keys() == second.keys() and any(not torch.equal(first[k], second[k].float()) for k in first)
    assert {v.dtype for v in first.values()} == {torch.float32} and {v.dtype for v in second.values()} == {torch.bfloat16}
    capsys.readouterr()
    assert main(["train", *code_common, "--output-dir", str(tmp_path / "bad"), "--lora-init",  # without --lora
                 str(tmp_path / "code-lora"), "--max-steps", "1"]) == 2
    assert "add --lora" in capsys.readouterr().err
    assert main(["train", *code_common, "--output-dir", str(tmp_path / "bad"), "--init", str(tmp_path / "drafter"),
                 "--lora", "--lora-init", str(tmp_path / "nothing"), "--max-steps", "1"]) == 2  # no such adapter
    assert "--lora-init: adapter folder" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()  # both refused before any work
    assert (tmp_path / "code-lora" / "checkpoint-1" / "dflash2_adapter.json").is_file()  # checkpoints load checked

    # --eval-only --lora evaluates base + adapter; --only-code keeps a code folder whole for evaluation too
    import dflash2_hf.training as training
    from peft import PeftModel

    seen = {}
    real = training.evaluate_blocks

    def spy(drafter, *a, **k):
        seen["drafter"] = drafter
        out = real(drafter, *a, **k)
        seen["sequences"] = out["sequences"]
        return out

    monkeypatch.setattr(training, "evaluate_blocks", spy)
    assert main(["train", *code_common, "--output-dir", str(tmp_path / "code-lora"), "--init", str(tmp_path / "drafter"),
                 "--lora", "--only-code", "--eval-only", "--eval-data", str(tmp_path / "code")]) == 0
    assert isinstance(seen["drafter"], PeftModel) and seen["sequences"] == kept
    assert main(["train", *code_common, "--output-dir", str(tmp_path / "nothing"), "--init", str(tmp_path / "drafter"),
                 "--lora", "--eval-only", "--eval-data", str(tmp_path / "code")]) == 2  # no adapter there: refused

    # the user's own conversations (a ShareGPT-format file) instead of the packaged ShareGPT
    own = tmp_path / "own.json"
    own.write_text(json.dumps([{"id": f"c{i}", "conversations": [{"from": "human", "value": f"question {i}"}]}
                               for i in range(3)]))
    assert main(["prepare-data", "--target", t, "--source", str(own), "--output-dir", str(tmp_path / "own"), "--stop", "3",
                 "--batch-size", "2", "--max-new-tokens", "4", "--no-progress"]) == 0
    own_meta = json.load(open(tmp_path / "own" / "dflash2_dataset.json"))
    assert own_meta["counts"]["kept"] == 3 and own_meta["provenance"]["source"]["path"] == str(own)
    assert own_meta["provenance"]["source"]["dataset"] == "own.json"
    other = tmp_path / "other.json"  # chat-template role names are accepted too
    other.write_text(json.dumps([{"conversations": [{"from": "user", "value": "hi"}, {"from": "assistant",
                                                                                    "value": "hello"}]}]))
    args = ["--target", t, "--stop", "3", "--batch-size", "2", "--max-new-tokens", "4", "--no-progress"]
    assert main(["prepare-data", *args, "--source", str(other), "--output-dir", str(tmp_path / "own")]) == 2  # other file
    assert main(["prepare-data", *args, "--source", str(other), "--output-dir", str(tmp_path / "other")]) == 0
    assert json.load(open(tmp_path / "other" / "dflash2_dataset.json"))["counts"]["kept"] == 1
    bad = tmp_path / "bad.json"
    bad.write_text('"not an array"')
    assert main(["prepare-data", *args, "--source", str(bad), "--output-dir", str(tmp_path / "bad-out")]) == 2
    assert main(["prepare-data", *args, "--source", str(tmp_path / "nope.json"), "--output-dir", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "bad-out").exists() and not (tmp_path / "x").exists()  # nothing written
    roles = tmp_path / "roles.json"
    roles.write_text(json.dumps([{"conversations": [{"from": "bot", "value": "hi"}]}]))
    assert main(["prepare-data", *args, "--source", str(roles), "--output-dir", str(tmp_path / "roles")]) == 1  # 0 kept
    assert not (tmp_path / "roles").exists()  # no folder left behind that a rerun with fixed input would find "done"
    own.write_text(json.dumps([{"id": f"c{i}", "conversations": [{"from": "human", "value": f"new question {i}"}]}
                               for i in range(3)]))  # the same file name with other conversations: refused
    assert main(["prepare-data", *args, "--source", str(own), "--output-dir", str(tmp_path / "own")]) == 2
    assert "the file's contents changed" in capsys.readouterr().err
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("mine")  # a folder of other files: refused, nothing added
    assert main(["prepare-data", *args, "--source", str(other), "--output-dir", str(tmp_path / "notes")]) == 2
    assert "holds files that are no dflash2 dataset (keep.txt)" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "notes").iterdir()) == ["keep.txt"]
