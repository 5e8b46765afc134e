"""Committed, append-only Parquet dataset folders of regenerated data (dflash2_hf.data.hub_dataset)."""

from __future__ import annotations

import hashlib

import pytest

from dflash2_hf.data import PreparedDataError, load_prepared, prepare_data, read_meta
from dflash2_hf.data.hub_dataset import done_record_ids, export_prepared, read_dataset_meta
from test_data import _good_records, _tiny_llama, _tiny_tokenizer, _write_array


@pytest.fixture(scope="module")
def tiny():
    tok = _tiny_tokenizer()
    return _tiny_llama(len(tok)), tok


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_export_appends_shards_and_reads_back(tmp_path, tiny):
    model, tok = tiny
    src = _write_array(tmp_path / "sg.json", _good_records(6))
    work, ds = tmp_path / "work", tmp_path / "ds"
    prepare_data(model, tok, work, stop=3, max_new_tokens=4, batch_size=2, source_path=src, progress=False)
    first = export_prepared(work, ds)
    assert first["shard"] == "data/train-00000.parquet" and first["new_records"] == 3
    shard0 = ds / first["shard"]
    digest0 = _sha(shard0)
    assert export_prepared(work, ds)["shard"] is None  # nothing new: nothing written

    prepare_data(model, tok, work, stop=6, max_new_tokens=4, batch_size=2, source_path=src, progress=False)
    second = export_prepared(work, ds)
    assert second["shard"] == "data/train-00001.parquet" and second["new_records"] == 3
    assert _sha(shard0) == digest0  # earlier shards are never rewritten
    assert load_prepared(ds) == load_prepared(work)
    assert read_meta(ds)["generation"]["max_new_tokens"] == 4
    import datasets

    rows = datasets.load_dataset(str(ds), split="train")
    assert sorted(rows["record_id"]) == list(range(6))
    card = (ds / "README.md").read_text()
    assert "path: data/train-*.parquet" in card and "| `data/train-00001.parquet` |" in card
    # a --source file is named as the prompts' origin; the card does not claim ShareGPT's provenance or license
    assert "prompts from the ShareGPT-format file `sg.json`" in card and "ShareGPT V3" not in card


def test_the_committed_dataset_card_is_rendered_from_its_metadata():
    """The shipped ShareGPT set's README is exactly what dataset_card() writes from its dflash2_dataset.json."""
    from pathlib import Path

    from dflash2_hf.data.hub_dataset import dataset_card

    folder = Path(__file__).resolve().parents[1] / "dataset_cards" / "smollm2-135m-instruct-sharegpt-regenerated"
    card = dataset_card(read_dataset_meta(folder))
    assert card == (folder / "README.md").read_text()
    assert "prompts from ShareGPT V3" in card and "nothing from 17000 on is ever read" in card


def test_an_evaluation_only_folder_serves_its_dev_split_for_evaluation(tmp_path, tiny, caplog):
    """A --split dev folder (e.g. the code validation set): evaluation reads its dev records, training reads them only
    with a warning (named as --data on purpose), and the card says it is evaluation data."""
    from dflash2_hf.training import load_training_records

    model, tok = tiny
    src = _write_array(tmp_path / "val.json", _good_records(4))
    work, ds = tmp_path / "work", tmp_path / "ds"
    prepare_data(model, tok, work, stop=4, max_new_tokens=3, source_path=src, progress=False)
    export_prepared(work, ds, split="dev")
    assert [r["record_id"] for r in load_training_records(ds, train_only=False)] == [0, 1, 2, 3]
    assert [r["record_id"] for r in load_training_records(ds)] == [0, 1, 2, 3] and "no train split" in caplog.text
    card = (ds / "README.md").read_text()
    assert "(drafter evaluation data)" in card and 'split="dev"' in card and "never train on it" in card


def test_fresh_machine_resumes_from_the_dataset(tmp_path, tiny):
    model, tok = tiny
    src = _write_array(tmp_path / "sg.json", _good_records(5) + [{"id": "bad", "conversations": []}])
    first_work, ds = tmp_path / "w1", tmp_path / "ds"
    prepare_data(model, tok, first_work, stop=6, max_new_tokens=3, source_path=src, progress=False)
    export_prepared(first_work, ds)
    assert done_record_ids(ds) == set(range(6))  # the skipped record (no human turn) counts as done too
    # a new machine: empty working folder, only the dataset folder survived
    counts = prepare_data(model, tok, tmp_path / "w2", stop=6, max_new_tokens=3, source_path=src, progress=False,
                          skip_records_in=[ds])
    assert counts["generated_tokens"] == 0 and counts["kept"] == 0
    with pytest.raises(ValueError, match="max_new_tokens"):
        prepare_data(model, tok, tmp_path / "w3", stop=6, max_new_tokens=5, source_path=src, progress=False,
                     skip_records_in=[ds])


def test_other_settings_and_corrupt_shards_are_refused(tmp_path, tiny):
    model, tok = tiny
    src = _write_array(tmp_path / "sg.json", _good_records(2))
    ds = tmp_path / "ds"
    prepare_data(model, tok, tmp_path / "a", stop=2, max_new_tokens=2, source_path=src, progress=False)
    export_prepared(tmp_path / "a", ds)
    prepare_data(model, tok, tmp_path / "b", stop=2, max_new_tokens=3, source_path=src, progress=False)
    with pytest.raises(ValueError, match="other settings"):
        export_prepared(tmp_path / "b", ds)
    with pytest.raises(ValueError, match="split"):
        export_prepared(tmp_path / "a", ds, split="test")
    shard = ds / read_dataset_meta(ds)["shards"][0]["file"]
    shard.write_bytes(shard.read_bytes()[:100])  # truncated
    with pytest.raises(PreparedDataError, match="train-00000.parquet.*restore it from git"):
        load_prepared(ds)
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
