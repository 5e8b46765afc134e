"""Hub-style dataset folders of regenerated data: written directly by prepare-data, the committed ones read unchanged
(dflash2_hf.data.prepared / hub_dataset)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from dflash2_hf.data import PreparedDataError, load_prepared, prepare_data, read_meta
from dflash2_hf.data.hub_dataset import dataset_card
from dflash2_hf.data.prepared import done_record_ids, load_dataset_folder, read_dataset_meta, shard_files
from test_data import _good_records, _tiny_llama, _tiny_tokenizer, _write_array

COMMITTED = sorted((Path(__file__).resolve().parents[1] / "dataset_cards").iterdir())


@pytest.fixture(scope="module")
def tiny():
    tok = _tiny_tokenizer()
    return _tiny_llama(len(tok)), tok


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_prepare_data_writes_a_hub_folder_and_extends_it_with_new_files(tmp_path, tiny):
    model, tok = tiny
    src = _write_array(tmp_path / "sg.json", _good_records(6))
    ds = tmp_path / "ds"
    prepare_data(model, tok, ds, stop=3, max_new_tokens=4, batch_size=2, source_path=src, progress=False)
    shard0 = ds / "data" / "train-00000.parquet"
    digest0 = _sha(shard0)
    prepare_data(model, tok, ds, stop=6, max_new_tokens=4, batch_size=2, source_path=src, progress=False)
    assert [p.name for p in shard_files(ds)] == ["train-00000.parquet", "train-00001.parquet"]
    assert _sha(shard0) == digest0  # earlier shards are never rewritten
    assert [r["record_id"] for r in load_prepared(ds)] == list(range(6))
    assert read_meta(ds)["generation"]["max_new_tokens"] == 4
    import datasets

    rows = datasets.load_dataset(str(ds), split="train")
    assert sorted(rows["record_id"]) == list(range(6))
    card = (ds / "README.md").read_text()
    assert "path: data/train-*.parquet" in card and "| `data/train-00001.parquet` |" in card
    # a --source file is named as the prompts' origin; the card does not claim ShareGPT's provenance or license
    assert "prompts from the ShareGPT-format file `sg.json`" in card and "ShareGPT V3" not in card
    assert "export-data" not in card and "dflash2 prepare-data --target" in card


@pytest.mark.parametrize("folder", COMMITTED, ids=lambda p: p.name)
def test_every_committed_folder_still_loads(folder):
    """The folders under dataset_cards/ (written by export-data, shards listed in dflash2_dataset.json) load unchanged:
    every listed shard, every record, the skipped ids counted as done."""
    meta = read_dataset_meta(folder)
    for split in ("train", "dev"):
        want = sum(s["records"] for s in meta["shards"] if s["split"] == split)
        assert len(load_dataset_folder(folder, split=split)) == want
    skipped = {i for s in meta["shards"] for i in s["skipped_record_ids"]}
    assert skipped <= done_record_ids(folder) and len(done_record_ids(folder)) >= len(skipped)


def test_the_committed_dataset_card_is_rendered_from_its_metadata():
    """The shipped ShareGPT set's README: its header (the splits datasets reads) and shard table are what
    dataset_card() writes from its dflash2_dataset.json."""
    folder = COMMITTED[0].parent / "smollm2-135m-instruct-sharegpt-regenerated"
    card = dataset_card(read_dataset_meta(folder))
    committed = (folder / "README.md").read_text()
    assert card.split("\n# ")[0] == committed.split("\n# ")[0]
    assert card.split("## Shards")[1] == committed.split("## Shards")[1]
    assert "prompts from ShareGPT V3" in card and "nothing from 17000 on is ever read" in card


def test_an_evaluation_only_folder_serves_its_dev_split_for_evaluation(tmp_path, tiny, caplog):
    """A --split dev folder (e.g. the code validation set): evaluation reads its dev records, training reads them only
    with a warning (named as --data on purpose), and the card says it is evaluation data."""
    from dflash2_hf.training import load_training_records

    model, tok = tiny
    src = _write_array(tmp_path / "val.json", _good_records(4))
    ds = tmp_path / "ds"
    prepare_data(model, tok, ds, stop=4, max_new_tokens=3, source_path=src, progress=False, split="dev")
    assert [p.name for p in shard_files(ds)] == ["dev-00000.parquet"]
    assert [r["record_id"] for r in load_training_records(ds, train_only=False)] == [0, 1, 2, 3]
    assert [r["record_id"] for r in load_training_records(ds)] == [0, 1, 2, 3] and "no train split" in caplog.text
    card = (ds / "README.md").read_text()
    assert "(drafter evaluation data)" in card and 'split="dev"' in card and "never train on it" in card
    with pytest.raises(ValueError, match="outside the train range"):  # ShareGPT dev records never go to train
        prepare_data(model, tok, tmp_path / "sg", start=16000, stop=16002, progress=False)


def test_another_folder_s_records_count_as_done(tmp_path, tiny):
    model, tok = tiny
    src = _write_array(tmp_path / "sg.json", _good_records(5) + [{"id": "bad", "conversations": []}])
    ds = tmp_path / "ds"
    prepare_data(model, tok, ds, stop=6, max_new_tokens=3, source_path=src, progress=False)
    assert done_record_ids(ds) == set(range(6))  # the skipped record (no human turn) counts as done too
    counts = prepare_data(model, tok, tmp_path / "w2", stop=6, max_new_tokens=3, source_path=src, progress=False,
                          skip_records_in=[ds])
    assert counts["generated_tokens"] == 0 and counts["kept"] == 0
    with pytest.raises(ValueError, match="--max-new-tokens"):
        prepare_data(model, tok, tmp_path / "w3", stop=6, max_new_tokens=5, source_path=src, progress=False,
                     skip_records_in=[ds])


def test_a_missing_or_foreign_shard_is_an_error(tmp_path, tiny):
    model, tok = tiny
    src = _write_array(tmp_path / "sg.json", _good_records(2))
    ds = tmp_path / "ds"
    prepare_data(model, tok, ds, stop=2, max_new_tokens=2, source_path=src, progress=False)
    shard = shard_files(ds)[0]
    foreign = ds / "data" / "train-99999.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"x": [1]}), foreign)
    with pytest.raises(PreparedDataError, match="train-99999.parquet carries no dflash2 metadata"):
        done_record_ids(ds)
    foreign.unlink()
    shard.unlink()
    with pytest.raises(FileNotFoundError, match="missing"):
        load_prepared(ds)


@pytest.mark.parametrize("compact_below", [1.0, 0.75, 0.0])
def test_greedy_continue_matches_generate(compact_below):
    """Dropping finished rows from the batch gives the tokens generate() gives (rows stop at different steps)."""
    import torch
    from transformers import GenerationConfig

    from dflash2_hf.data.greedy import greedy_continue

    tok = _tiny_tokenizer()
    model = _tiny_llama(len(tok), seed=3)
    g = torch.Generator().manual_seed(0)
    contexts = [torch.randint(3, len(tok), (int(n),), generator=g).tolist() for n in (5, 9, 3, 12, 7, 4)]
    free = GenerationConfig(do_sample=False, max_new_tokens=20, eos_token_id=None, pad_token_id=2)
    runs = [model.generate(torch.tensor([c]), generation_config=free)[0, len(c):].tolist() for c in contexts]
    stop = sorted({runs[0][2], runs[1][6], runs[3][11]})  # tokens these rows emit: they stop at different steps
    got = greedy_continue(model, contexts, 20, stop, pad_id=2, compact_below=compact_below)
    cfg = GenerationConfig(do_sample=False, max_new_tokens=20, eos_token_id=stop, pad_token_id=2)
    for ctx, (resp, stopped) in zip(contexts, got):
        ref = model.generate(torch.tensor([ctx]), generation_config=cfg)[0, len(ctx):].tolist()
        assert resp == ref and stopped == (ref[-1] in stop)
    assert len({len(r) for r, _ in got}) > 2  # the case is exercised: rows of several lengths


def test_source_hash_is_read_once_and_follows_a_changed_file(tmp_path):
    """``prepare-data --source F`` asks for F's sha256 before and after loading the target: one read per process,
    and a file rewritten with other bytes gets its new hash."""
    import hashlib
    import os

    from dflash2_hf.data.hub_dataset import _file_sha256, source_sha256

    f = tmp_path / "chats.json"
    f.write_bytes(b"[1, 2, 3]")
    misses = _file_sha256.cache_info().misses
    assert source_sha256(f) == source_sha256(str(f)) == hashlib.sha256(b"[1, 2, 3]").hexdigest()
    assert _file_sha256.cache_info().misses == misses + 1
    f.write_bytes(b"[4, 5, 6, 7]")
    os.utime(f, ns=(1, 1))  # a different modification time even on a coarse clock
    assert source_sha256(f) == hashlib.sha256(b"[4, 5, 6, 7]").hexdigest()
