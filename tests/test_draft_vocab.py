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
