import pytest

from megarl.data.tokenizer import train_bpe_tokenizer


def test_round_trip_and_special_tokens():
    tok = train_bpe_tokenizer(["<search> capital of Zorbia </search> Zürich 東京"] * 10, vocab_size=300)
    for text in ["<answer> 東京 </answer>", "naïve ☃ text never seen", ""]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.eos_token_id == 0 and tok.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]
    assert len(tok) <= 300


def test_too_small_vocabulary_is_refused():
    with pytest.raises(ValueError, match="256 byte tokens"):
        train_bpe_tokenizer(["x"], vocab_size=100)
