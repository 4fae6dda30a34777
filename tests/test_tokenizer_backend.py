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


@pytest.fixture(scope="module")
def with_added_tokens():
    from tokenizers import AddedToken

    tok = train_bpe_tokenizer(TEXTS * 3, 400)
    tok.add_tokens(["<search>", "</search>", AddedToken("<answer>", lstrip=True, rstrip=True)])
    tok.add_special_tokens({"additional_special_tokens": ["<tool>"]})
    return tok


@pytest.mark.parametrize("text", [
    "<search> who founded it? </search>",  # added tokens
    "x  <answer>  Paris </answer>",  # one that takes the spaces around it
    "<|im_end|> <tool>call</tool><|endoftext|>",  # special tokens, kept by decode
    " <search>a</search><search>b</search> , . ?",
])
def test_special_and_added_tokens_encode_and_decode_as_hf_does(with_added_tokens, text):
    tok = with_added_tokens
    ids = tok.encode(text, add_special_tokens=False)
    assert set(ids) & set(tok.added_tokens_decoder)  # the text does hold added or special tokens
    assert ids_of(tok, text) == ids
    assert text_of(tok, ids) == tok.decode(ids)


def test_a_decode_whose_clean_up_changes_the_text_keeps_hf_s_path():
    # HF cleans up spaces after a WordPiece decode (" ," -> ","): the backend alone would not
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "who", "founded", "it", ",", "?", "'", "s"])}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(cleanup=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", clean_up_tokenization_spaces=True)
    ids = tok.encode("who , founded it ' s ?", add_special_tokens=False)
    assert tok.backend_tokenizer.decode(ids) != tok.decode(ids)  # the rule matters here
    assert rust_backend(tok) is None
    assert text_of(tok, ids) == tok.decode(ids) == "who, founded it's?"


def test_an_encode_after_another_caller_split_special_tokens_is_hf_s():
    # HF sets the backend's encode_special_tokens at each encode and leaves it set: a call with
    # split_special_tokens=True elsewhere must not make the agent's encode split "<|im_end|>"
    tok = train_bpe_tokenizer(TEXTS * 3, 400)
    text = "a <|im_end|> b"
    tok(text, split_special_tokens=True)
    ids = ids_of(tok, text)
    assert ids == tok.encode(text, add_special_tokens=False)
    assert tok.convert_tokens_to_ids("<|im_end|>") in ids
