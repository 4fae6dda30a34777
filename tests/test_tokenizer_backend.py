"""The agent loop's decode of a turn and encode of an observation go through a fast tokenizer's
Rust backend (megarl.data.tokenizer.rust_backend) only where that gives exactly what HF's
decode / encode give."""

import pytest

from megarl.data.tokenizer import rust_backend, train_bpe_tokenizer
from megarl.rollout.agent import INVALID_ACTION_MESSAGE, SEARCH_INSTRUCTION, ids_of, text_of

TEXTS = [SEARCH_INSTRUCTION.format(question="who founded the city of 7?"), INVALID_ACTION_MESSAGE,
         "\n\n<information>Doc 1(Title: \"City 7\") river  harbour\ttower</information>\n\n",
         " <search> who , founded ? </search> <|im_end|>", "héllo wörld ☃ , . !", ""]


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe_tokenizer(TEXTS * 3, 400)


@pytest.mark.parametrize("text", TEXTS)
def test_the_backend_encodes_and_decodes_as_hf_does(tokenizer, text):
    assert rust_backend(tokenizer) is not None  # no clean-up of spaces: the backend is used
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids_of(tokenizer, text) == ids
    assert text_of(tokenizer, ids) == tokenizer.decode(ids)


def test_a_tokenizer_whose_decode_cleans_up_spaces_keeps_hf_s_path(tokenizer):
    tokenizer.clean_up_tokenization_spaces = True  # HF's decode may then differ from the backend's
    try:
        assert rust_backend(tokenizer) is None
        ids = tokenizer.encode(" who , founded ?", add_special_tokens=False)
        assert text_of(tokenizer, ids) == tokenizer.decode(ids)
    finally:
        tokenizer.clean_up_tokenization_spaces = False
