import pytest

from dflash2_hf.training.draft_vocab import draft_vocab_from_records


def test_draft_vocab_counts_response_tokens_only():
    records = [
        {"input_ids": [1, 1, 1, 1, 7, 7, 8, 2], "response_spans": [[4, 8]]},
        {"input_ids": [1, 9, 7, 2], "response_spans": [[2, 4]]},
    ]
    ids, coverage = draft_vocab_from_records(records, size=2, always=[2])
    assert ids.tolist() == [2, 7]  # 1 and 9 only occur in prompts; 7 is the most frequent response token
    assert coverage == pytest.approx(5 / 6)
    with pytest.raises(ValueError, match="no response tokens"):
        draft_vocab_from_records([{"input_ids": [1], "response_spans": []}], size=4)


def test_draft_vocab_from_training_records_matches_spans():
    from dflash2_hf.training.dataset import normalize_record

    records = [
        {"record_id": 0, "input_ids": [1, 1, 1, 1, 7, 7, 8, 2], "response_spans": [[4, 8]]},
        {"record_id": 1, "input_ids": [1, 9, 7, 2], "response_spans": [[2, 4]]},
    ]
    masked = [normalize_record(r) for r in records]
    assert "response_spans" not in masked[0]
    ids, coverage = draft_vocab_from_records(masked, size=2, always=[2])
    assert (ids.tolist(), coverage) == (draft_vocab_from_records(records, size=2, always=[2])[0].tolist(),
                                        pytest.approx(5 / 6))


def test_draft_vocab_coverage_counts_response_tokens():
    from dflash2_hf.training.draft_vocab import draft_vocab_coverage

    records = [{"input_ids": [1, 1, 7, 7, 8, 2], "response_spans": [[2, 6]]}]
    assert draft_vocab_coverage([7, 2], records) == pytest.approx(3 / 4)
    with pytest.raises(ValueError, match="no response tokens"):
        draft_vocab_coverage([7], [{"input_ids": [1], "response_spans": []}])
