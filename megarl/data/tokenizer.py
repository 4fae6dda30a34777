"""Train a small byte-level BPE tokenizer from text, for runs that cannot download one.

The CPU quickstart, the tests and the benchmarks build their tiny models around a tokenizer
trained here, so nothing comes from a model hub. Byte-level BPE (the Qwen / Llama 3 kind)
encodes any UTF-8 text. Main entry point: `train_bpe_tokenizer`.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

# Qwen2's chat special tokens, so that chat templates written for Qwen render unchanged
DEFAULT_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 1000,
                        special_tokens: tuple[str, ...] = DEFAULT_SPECIAL_TOKENS) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of at most `vocab_size` tokens learnt from `texts`; the first
    special token is EOS and padding (id 0)."""
    if vocab_size < 256 + len(special_tokens):
        raise ValueError(f"vocab_size={vocab_size} is too small: byte-level BPE needs 256 byte tokens "
                         f"+ {len(special_tokens)} special tokens")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    eos = special_tokens[0]
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=eos)


def rust_backend(tokenizer, encoding: bool = False):
    """A fast tokenizer's Rust backend where it decodes (and with `encoding`, encodes) exactly as
    the tokenizer does, else None: HF adds no clean-up of spaces (Qwen's, this module's), and for
    an encode, the backend splits special tokens as HF's encode will (HF sets the backend's flag
    at each encode and leaves it set: one call with split_special_tokens=True changes it). The
    driver decodes every turn and encodes every observation of every trajectory, and on those
    short texts HF's wrapper costs as much as the backend's own work (a turn's decode: 150 us
    against 65)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    if encoding and backend.encode_special_tokens != bool(getattr(tokenizer, "split_special_tokens", False)):
        return None
    return backend
