"""Data sets and target-regenerated training data (dflash2_hf.data), with a tiny offline Llama + tokenizer."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal

import pytest
import torch

from dflash2_hf.data import (
    DEV_RANGE,
    HELDOUT_START,
    TRAIN_RANGE,
    PreparedDataError,
    ShareGPTReader,
    check_range,
    conversation_turns,
    count_sharegpt_records,
    humaneval_prompt,
    iter_sharegpt,
    load_humaneval,
    load_prepared,
    prepare_data,
    read_meta,
    response_mask,
    sharegpt_prompts,
)
from dflash2_hf.data.prepared import read_dataset_meta, shard_files

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a test bot<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
EOS = 2


# ------------------------------------------------------------------------------------------------ fixtures


def _tiny_tokenizer():
    """Character-level tokenizer (vocab 99): <unk>, <|im_start|>, <|im_end|>, printable ASCII + newline."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = {tok: i for i, tok in enumerate(specials + [chr(c) for c in range(32, 127)] + ["\n"])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<|im_start|>",
                                  eos_token="<|im_end|>", pad_token="<|im_end|>")
    tok.chat_template = CHATML
    return tok


def _tiny_llama(vocab_size: int, seed: int = 0, always_eos: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      bos_token_id=1, eos_token_id=EOS, pad_token_id=EOS, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = EOS
    if always_eos:  # the LM head always prefers the end-of-turn token: every response is [EOS]
        with torch.no_grad():
            model.lm_head.weight.zero_()
            model.lm_head.weight[EOS, :] = 0.0
        head = torch.nn.Linear(32, vocab_size, bias=True)
        with torch.no_grad():
            head.weight.zero_()
            head.bias.zero_()
            head.bias[EOS] = 10.0
        model.lm_head = head
    return model


def tiny_chat_target_folder(path) -> str:
    """A tiny random 6-layer Llama + the character-level chat tokenizer saved as a transformers folder (a --target)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = _tiny_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      bos_token_id=1, eos_token_id=EOS, pad_token_id=EOS, tie_word_embeddings=False)
    target = LlamaForCausalLM(cfg).eval()
    target.generation_config.eos_token_id = target.generation_config.pad_token_id = EOS
    target.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tiny():
    tok = _tiny_tokenizer()
    return _tiny_llama(len(tok)), tok


def _conv(*turns):
    return {"id": "x", "conversations": [{"from": r, "value": v} for r, v in turns]}


def _write_array(path, records, cut_at=None):
    text = json.dumps(records, indent=2)
    if cut_at is not None:
        text = text[:cut_at]
    path.write_text(text, encoding="utf-8")
    return path


def _good_records(n):
    return [_conv(("human", f"Question number {i}: what is {i} plus {i}?"), ("gpt", f"It is {2 * i}."),
                  ("human", "Thanks, and times two?"), ("gpt", "Double.")) for i in range(n)]


def regenerated_tiny_chat(tmp_path, monkeypatch) -> str:
    """A tiny chat target folder (returned) whose regeneration of 4 ShareGPT-style conversations (8 new tokens per
    turn) is in ``tmp_path / "regen"``; the package cache goes to ``tmp_path / "cache"``."""
    from dflash2_hf.cli import main

    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path / "cache"))
    t = tiny_chat_target_folder(tmp_path / "target")
    src = str(_write_array(tmp_path / "sg.json", _good_records(4)))
    assert main(["prepare-data", "--target", t, "--source", src, "--output-dir", str(tmp_path / "regen"), "--stop", "4",
                 "--max-new-tokens", "8", "--no-progress"]) == 0
    return t


def assert_greedy_lossless(target, drafter) -> None:
    """10 greedy tokens after a chat "hello" prompt: identical with and without ``drafter``."""
    ids = _tiny_tokenizer().apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True,
                                                return_tensors="pt", return_dict=True)["input_ids"]
    assert torch.equal(target.generate(ids, max_new_tokens=10, do_sample=False),
                       target.generate(ids, assistant_model=drafter, max_new_tokens=10, do_sample=False))


# ------------------------------------------------------------------------------------------------ sharegpt reader


def test_reader_truncated_array(tmp_path):
    records = [{"id": f"r{i}", "conversations": [{"from": "human", "value": "x" * (i * 37) + "\u00e9"}]}
               for i in range(6)]
    full = json.dumps(records, indent=2)
    cut = full.index('"r4"') + 2  # mid-record 4
    path = _write_array(tmp_path / "sg.json", records, cut_at=cut)
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text())
    reader = ShareGPTReader(path, chunk_chars=16)  # tiny chunks: records straddle many refills
    got = list(reader)
    assert [i for i, _ in got] == [0, 1, 2, 3]
    assert [r for _, r in got] == records[:4]
    assert reader.num_records == 4 and reader.truncated and reader.complete

    whole = ShareGPTReader(_write_array(tmp_path / "whole.json", records), chunk_chars=16)
    assert [r for _, r in whole] == records and not whole.truncated and whole.num_records == 6

    assert [i for i, _ in iter_sharegpt(1, 3, path=path)] == [1, 2]
    assert [i for i, _ in iter_sharegpt(2, None, path=path)] == [2, 3]


def test_reader_rejects_garbage_and_reads_json_lines(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('"just a string"')
    with pytest.raises(ValueError, match="not a JSON array nor JSON Lines"):
        list(ShareGPTReader(bad))
    lines = tmp_path / "chats.jsonl"
    lines.write_text('{"id": "a", "conversations": []}\n\n{"id": "b", "conversations": []}\n')
    assert [(i, r["id"]) for i, r in ShareGPTReader(lines)] == [(0, "a"), (1, "b")]
    lines.write_text('{"id": "a"}\n{"id": \n')
    with pytest.raises(ValueError, match="line 2 is no JSON record"):
        list(ShareGPTReader(lines))
    bad.write_text('[{"a": 1} {"b": 2}]')
    with pytest.raises(ValueError, match="expected ','"):
        list(ShareGPTReader(bad))


def test_real_sharegpt_file_is_truncated_after_about_17600_records(caplog):
    with caplog.at_level(logging.INFO, logger="dflash2_hf.data.sharegpt"):
        n = count_sharegpt_records()
    assert 17_500 <= n <= 17_800
    assert any("whole records" in r.getMessage() and "truncated" in r.getMessage() for r in caplog.records)


def test_heldout_guard(tmp_path):
    assert TRAIN_RANGE == (0, 16000) and DEV_RANGE == (16000, 17000) and HELDOUT_START == 17000
    assert check_range(0, None) == 17000
    for start, stop in [(0, 17001), (16990, 17010), (17000, 17500)]:
        with pytest.raises(ValueError, match="held out"):
            iter_sharegpt(start, stop)  # raises eagerly, before any reading
        with pytest.raises(ValueError, match="held out"):
            sharegpt_prompts(start, stop)
    path = _write_array(tmp_path / "sg.json", _good_records(3))
    assert len(list(iter_sharegpt(0, 17001, path=path, allow_heldout=True))) == 3
    with pytest.raises(ValueError, match="held out"):
        prepare_data(None, None, tmp_path / "out", start=0, stop=17001, source_path=path)


def test_sharegpt_prompts(tmp_path):
    recs = [_conv(("gpt", "hi"), ("human", "first q")), _conv(("gpt", "only gpt")), _conv(("human", "  ")),
            _conv(("system", "s"), ("human", "q3"))]
    path = _write_array(tmp_path / "sg.json", recs)
    assert sharegpt_prompts(0, 4, path=path) == [(0, "first q"), (3, "q3")]


# ------------------------------------------------------------------------------------------------ humaneval


def test_humaneval():
    problems = load_humaneval()
    assert len(problems) == 164 and problems[0]["task_id"] == "HumanEval/0"
    assert {"prompt", "entry_point", "test", "canonical_solution"} <= set(problems[0])
    text = humaneval_prompt(problems[0], _tiny_tokenizer())
    assert "Complete the following Python function" in text and "```python" in text
    assert problems[0]["prompt"] in text and text.endswith("<|im_start|>assistant\n")


# ------------------------------------------------------------------------------------------------ regeneration


def test_conversation_turns_rules():
    sys_conv = _conv(("system", "be nice"), ("gpt", "dangling"), ("human", "a"), ("gpt", "b"), ("human", "c"),
                     ("human", "d"))
    assert conversation_turns(sys_conv, 5) == ("be nice", ["a", "c"])  # stops where alternation breaks
    assert conversation_turns(sys_conv, 1) == ("be nice", ["a"])
    for rec, reason in [(_conv(("bing", "x"), ("human", "a")), "unknown_role"),
                        (_conv(("gpt", "x")), "no_human_turn"), (_conv(), "no_human_turn"),
                        (_conv(("human", " \n")), "empty_turn"), ({"id": "x"}, "malformed"),
                        ({"conversations": [{"from": "human", "value": 3}]}, "malformed"),
                        ({"conversations": [{"from": ["human"], "value": "a"}]}, "unknown_role")]:
        with pytest.raises(Exception) as info:
            conversation_turns(rec, 1)
        assert info.value.reason == reason


def test_skips_are_counted_never_crash(tmp_path, tiny):
    model, tok = tiny
    recs = [
        _conv(("human", "good one"), ("gpt", "a")),                       # 0 kept
        _conv(("bing", "hello"), ("human", "x")),                         # 1 unknown_role
        _conv(("human", "   "), ("gpt", "a")),                            # 2 empty_turn
        _conv(("gpt", "only the model speaks")),                          # 3 no_human_turn
        {"id": "m", "conversations": "not a list"},                       # 4 malformed
        _conv(("human", "long " * 200)),                                  # 5 prompt_too_long
        _conv(("gpt", "continued"), ("human", "kept after gpt")),         # 6 kept
        _conv(("system", "Be brief."), ("human", "with system")),         # 7 kept
        "not even a dict",                                                # 8 malformed
    ]
    path = _write_array(tmp_path / "sg.json", recs)
    counts = prepare_data(model, tok, tmp_path / "out", start=0, stop=len(recs), max_prompt_tokens=300,
                          max_new_tokens=4, batch_size=2, source_path=path, progress=False)
    assert counts["kept"] == 3 and counts["complete"]
    assert counts["skipped"] == {"unknown_role": 1, "empty_turn": 1, "no_human_turn": 1, "malformed": 2,
                                 "prompt_too_long": 1}
    loaded = load_prepared(tmp_path / "out")
    assert [r["record_id"] for r in loaded] == [0, 6, 7]
    assert "Be brief." in tok.decode(loaded[2]["input_ids"])
    folder = read_dataset_meta(tmp_path / "out")
    assert folder["counts"]["skipped"]["malformed"] == 2 and folder["status"] == "complete"
    assert folder["runs"][0]["record_range"] == [0, len(recs)] and folder["runs"][0]["world_size"] == 1
    meta = read_meta(tmp_path / "out")
    assert meta["chat_template"]["text"] == CHATML and len(meta["chat_template"]["sha256"]) == 64
    assert meta["generation"]["max_new_tokens"] == 4 and meta["generation"]["do_sample"] is False


def test_chat_style_records_are_accepted():
    system, humans = conversation_turns({"messages": [{"role": "system", "content": "Be brief."},
                                                      {"role": "user", "content": "hi"},
                                                      {"role": "assistant", "content": "hello"},
                                                      {"role": "user", "content": "more"}]}, 2)
    assert system == "Be brief." and humans == ["hi", "more"]


def test_code_filter_keeps_code_conversations_only(tmp_path, tiny):
    from dflash2_hf.data.sharegpt import has_code_block

    model, tok = tiny
    recs = [
        _conv(("human", "write a loop"), ("gpt", "Sure:\n```python\nfor i in range(3): pass\n```")),  # 0 code
        _conv(("human", "hello"), ("gpt", "hi")),                                                       # 1 no code
        _conv(("human", "fix this\n```js\nlet x\n```"), ("gpt", "done")),                               # 2 code
        _conv(("human", "hi"), ("gpt", "hi"), ("human", "```late```")),                                 # 3 too late
    ]
    assert [has_code_block(r) for r in recs] == [True, False, True, False]
    path = _write_array(tmp_path / "sg.json", recs)
    counts = prepare_data(model, tok, tmp_path / "out", stop=len(recs), max_prompt_tokens=300, max_new_tokens=2,
                          source_path=path, progress=False, record_filter="code")
    assert counts["kept"] == 2 and counts["skipped"] == {"filtered_out": 2}
    assert [r["record_id"] for r in load_prepared(tmp_path / "out")] == [0, 2]
    assert read_meta(tmp_path / "out")["source"]["filter"] == "code"
    with pytest.raises(ValueError, match="other settings: --only-code"):  # a resume keeps the filter
        prepare_data(model, tok, tmp_path / "out", stop=len(recs), max_prompt_tokens=300, max_new_tokens=2,
                     source_path=path, progress=False)
    with pytest.raises(ValueError, match="unknown record_filter"):
        prepare_data(model, tok, tmp_path / "out2", stop=1, source_path=path, record_filter="poetry")


def test_record_layout_single_turn(tmp_path, tiny):
    model, tok = tiny
    path = _write_array(tmp_path / "sg.json", _good_records(3))
    prepare_data(model, tok, tmp_path / "out", stop=3, max_new_tokens=5, batch_size=3, source_path=path,
                 progress=False)
    for rec in load_prepared(tmp_path / "out"):
        prompt = tok.apply_chat_template([{"role": "user", "content": _good_records(3)[rec["record_id"]][
            "conversations"][0]["value"]}], tokenize=False, add_generation_prompt=True)
        prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        (s, e), = rec["response_spans"]
        assert rec["input_ids"][:s] == prompt_ids and e == len(rec["input_ids"])
        assert rec["num_response_tokens"] == e - s == sum(response_mask(rec))
        # the response is the tiny target's own greedy continuation of the prompt
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=5, do_sample=False, eos_token_id=EOS,
                             pad_token_id=EOS)
        assert rec["input_ids"][s:] == out[0, len(prompt_ids):len(prompt_ids) + (e - s)].tolist()
        assert rec["truncated"] == (rec["input_ids"][-1] != EOS)


def test_multi_turn_layout_matches_template(tmp_path):
    tok = _tiny_tokenizer()
    model = _tiny_llama(len(tok), always_eos=True)  # every response is just the end-of-turn token
    recs = _good_records(2)
    path = _write_array(tmp_path / "sg.json", recs)
    prepare_data(model, tok, tmp_path / "out", stop=2, max_turns=2, max_new_tokens=4, batch_size=2,
                 source_path=path, progress=False)
    for rec in load_prepared(tmp_path / "out"):
        turns = recs[rec["record_id"]]["conversations"]
        msgs = [{"role": "user", "content": turns[0]["value"]}, {"role": "assistant", "content": ""},
                {"role": "user", "content": turns[2]["value"]}, {"role": "assistant", "content": ""}]
        text = tok.apply_chat_template(msgs, tokenize=False)
        assert text.endswith("<|im_end|>\n")
        assert rec["input_ids"] == tok(text[:-1], add_special_tokens=False)["input_ids"]
        assert rec["num_turns"] == 2 and not rec["truncated"]
        assert [rec["input_ids"][s:e] for s, e in rec["response_spans"]] == [[EOS], [EOS]]


def test_resume_after_a_kill_equals_an_uninterrupted_run(tmp_path, tiny, monkeypatch):
    """Shards appear complete or not at all: a kill while the second shard is written leaves the first, a temporary
    file that readers and the restart ignore; the restart continues after the first shard and ends with the same
    records as a run that was never interrupted; a third run has nothing to do."""
    from dflash2_hf.data.shards import ShardWriter

    model, tok = tiny
    path = _write_array(tmp_path / "sg.json", _good_records(10) + [_conv(("bing", "x"))])
    kw = dict(stop=11, max_new_tokens=3, batch_size=2, sort_window=1, shard_size=4, source_path=path,
              progress=False)
    whole, out = tmp_path / "whole", tmp_path / "out"
    prepare_data(model, tok, whole, **kw)
    write = ShardWriter._write

    def killed_at_second_shard(self):
        if self.next_index == 1:
            (self.data_dir / ".train-00001.parquet.tmp99999").write_bytes(b"PAR1 cut short")
            raise KeyboardInterrupt  # the kill, in the middle of writing the second shard
        write(self)

    monkeypatch.setattr(ShardWriter, "_write", killed_at_second_shard)
    with pytest.raises(KeyboardInterrupt):
        prepare_data(model, tok, out, **kw)
    monkeypatch.undo()
    assert read_dataset_meta(out)["status"] == "interrupted"
    assert [p.name for p in shard_files(out)] == ["train-00000.parquet"]
    assert [r["record_id"] for r in load_prepared(out)] == [0, 1, 2, 3]  # the temporary file is not read

    second = prepare_data(model, tok, out, **kw)
    assert second["complete"] and second["kept"] == 10 and second["skipped"] == {"unknown_role": 1}
    assert load_prepared(out) == load_prepared(whole)
    assert not list((out / "data").glob(".*")), "the temporary file of the killed run is left"
    meta = read_dataset_meta(out)
    assert meta["counts"]["kept"] == 10 and meta["status"] == "complete"
    assert len(meta["runs"]) == 2 and meta["runs"][1]["resumed_with"] == 4
    names = [p.name for p in shard_files(out)]
    third = prepare_data(model, tok, out, **kw)  # nothing left to do: no duplicates, no new shard
    assert third["generated_tokens"] == 0 and [p.name for p in shard_files(out)] == names


def test_cli_ctrl_c_says_what_is_kept_and_the_rerun_resumes_or_has_nothing_to_do(tmp_path, monkeypatch, capsys, caplog):
    import dflash2_hf.targets
    from dflash2_hf.cli import main
    from dflash2_hf.data.shards import ShardWriter

    out = tmp_path / "out"
    argv = ["prepare-data", "--target", tiny_chat_target_folder(tmp_path / "target"), "--output-dir", str(out),
            "--source", str(_write_array(tmp_path / "sg.json", _good_records(6))), "--stop", "6", "--max-new-tokens",
            "2", "--batch-size", "2", "--sort-window", "1", "--shard-size", "2", "--no-progress"]
    write = ShardWriter._write

    def ctrl_c_at_second_shard(self):
        if self.next_index == 1:
            raise KeyboardInterrupt
        write(self)

    def kill_at_second_shard(self):  # `kill PID` of a background run: SIGTERM, handled like Ctrl-C
        if self.next_index == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        write(self)

    with monkeypatch.context() as patch:
        patch.setattr(ShardWriter, "_write", kill_at_second_shard)
        assert main(argv) == 130
    assert read_dataset_meta(out)["status"] == "interrupted"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, "the SIGTERM handler outlived the command"
    shutil.rmtree(out)
    with monkeypatch.context() as patch:
        patch.setattr(ShardWriter, "_write", ctrl_c_at_second_shard)
        assert main(argv) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"interrupted: 1 complete shard(s) (2 records) kept in {out}; rerun the same command to continue")
    assert read_dataset_meta(out)["status"] == "interrupted"
    with caplog.at_level(logging.INFO):
        assert main(argv) == 0
    assert "resuming: 2 records already in 1 shards" in caplog.text and read_dataset_meta(out)["status"] == "complete"
    monkeypatch.setattr(dflash2_hf.targets, "load_target", lambda *a, **k: pytest.fail("the target was loaded"))
    capsys.readouterr()
    assert main(argv) == 0
    assert capsys.readouterr().err.startswith(f"nothing left to do: {out} already holds every record of [0, 6)")


def test_max_batches_writes_the_last_partial_shard(tmp_path, tiny):
    model, tok = tiny
    path = _write_array(tmp_path / "sg.json", _good_records(6))
    kw = dict(stop=6, max_new_tokens=2, batch_size=2, sort_window=1, shard_size=4, source_path=path, progress=False)
    first = prepare_data(model, tok, tmp_path / "out", max_batches=1, **kw)
    assert first["kept"] == 2 and not first["complete"]
    assert read_dataset_meta(tmp_path / "out")["status"] == "incomplete"
    assert prepare_data(model, tok, tmp_path / "out", **kw)["kept"] == 6


def test_ranks_write_their_own_shards_and_read_back_the_union(tmp_path, tiny, monkeypatch):
    """Two torchrun ranks (RANK / WORLD_SIZE, run one after the other here): each regenerates its own records into
    its own shard files, without locks; the folder reads back as the union, as one process would have written it."""
    model, tok = tiny
    path = _write_array(tmp_path / "sg.json", _good_records(6))
    kw = dict(stop=6, max_new_tokens=3, batch_size=2, shard_size=2, source_path=path, progress=False)
    one, out = tmp_path / "one", tmp_path / "out"
    prepare_data(model, tok, one, **kw)
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        prepare_data(model, tok, out, **kw)
    assert [p.name for p in shard_files(out)] == ["train-r0-00000.parquet", "train-r0-00001.parquet",
                                                  "train-r1-00000.parquet", "train-r1-00001.parquet"]
    got = load_prepared(out)
    assert [r["record_id"] for r in got] == list(range(6)) and got == load_prepared(one)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    again = prepare_data(model, tok, out, **kw)  # one process afterwards: nothing left, the card counts all shards
    assert again["generated_tokens"] == 0 and read_dataset_meta(out)["counts"]["kept"] == 6
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ValueError, match="RANK=2"):
        prepare_data(model, tok, out, **kw)


def test_corrupt_shard_is_an_error(tmp_path, tiny):
    import pyarrow.parquet as pq

    model, tok = tiny
    path = _write_array(tmp_path / "sg.json", _good_records(3))
    out = tmp_path / "out"
    prepare_data(model, tok, out, stop=3, max_new_tokens=2, batch_size=3, source_path=path, progress=False)
    shard = shard_files(out)[0]
    table = pq.read_table(shard)
    rows = table.to_pylist()
    rows[1]["record_id"] = rows[0]["record_id"]  # a duplicated record
    pq.write_table(table.from_pylist(rows, schema=table.schema), shard)
    with pytest.raises(PreparedDataError, match=r"train-00000\.parquet, row 1: record_id 0 is already in"):
        load_prepared(out)
    shard.write_bytes(shard.read_bytes()[:100])  # truncated
    with pytest.raises(PreparedDataError, match="not a readable Parquet file"):
        load_prepared(out)


def test_resume_refuses_other_settings(tmp_path, tiny):
    model, tok = tiny
    path = _write_array(tmp_path / "sg.json", _good_records(2))
    prepare_data(model, tok, tmp_path / "out", stop=2, max_new_tokens=2, source_path=path, progress=False)
    with pytest.raises(ValueError, match=r"other settings: --max-new-tokens \(generation.max_new_tokens\): folder 2, "
                                         "now 3"):
        prepare_data(model, tok, tmp_path / "out", stop=2, max_new_tokens=3, source_path=path, progress=False)


def test_load_prepared_as_dataset(tmp_path, tiny):
    model, tok = tiny
    path = _write_array(tmp_path / "sg.json", _good_records(3))
    prepare_data(model, tok, tmp_path / "out", stop=3, max_new_tokens=2, source_path=path, progress=False)
    ds = load_prepared(tmp_path / "out", as_dataset=True)
    assert len(ds) == 3 and ds[0]["record_id"] == 0 and isinstance(ds[0]["input_ids"], list)
    with pytest.raises(FileNotFoundError, match="dflash2_dataset.json not found.*dflash2 prepare-data"):
        load_prepared(tmp_path / "nothing")


def test_an_old_jsonl_folder_is_refused_and_converted_once(tmp_path, tiny):
    """A folder of an older prepare-data (meta.json + shard-*.jsonl): reading or resuming it names the converter;
    `export-data` turns it into a dataset folder (a torn last line is left out)."""
    from dflash2_hf.cli import main
    from dflash2_hf.data.hub_dataset import provenance

    model, tok = tiny
    path = _write_array(tmp_path / "sg.json", _good_records(3))
    new = tmp_path / "new"
    prepare_data(model, tok, new, stop=3, max_new_tokens=2, source_path=path, progress=False)
    old = tmp_path / "old"
    old.mkdir()
    meta = dict(read_meta(new), counts={}, status="complete", runs=[])
    meta["source"] = dict(meta["source"], record_range=[0, 3])
    (old / "meta.json").write_text(json.dumps(meta))
    lines = [json.dumps(r) + "\n" for r in load_prepared(new)]
    (old / "shard-00000.jsonl").write_text("".join(lines) + '{"record_id": 3, "inp')
    (old / "skipped.jsonl").write_text('{"record_id": 7, "reason": "malformed"}\n')
    for call in (lambda: load_prepared(old), lambda: prepare_data(model, tok, old, stop=3, max_new_tokens=2,
                                                                  source_path=path, progress=False)):
        with pytest.raises(PreparedDataError, match="older `dflash2 prepare-data`.*dflash2 export-data --data"):
            call()
    assert main(["export-data", "--data", str(old), "--output-dir", str(tmp_path / "conv")]) == 0
    assert load_prepared(tmp_path / "conv") == load_prepared(new)
    assert provenance(meta) == read_meta(tmp_path / "conv")
    assert 7 in __import__("dflash2_hf.data.prepared", fromlist=["x"]).done_record_ids(tmp_path / "conv")
