"""Tiny models and a locally trained tokenizer for tests (nothing is downloaded)."""

from __future__ import annotations

import torch
from transformers import (LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)

from megarl.data.tokenizer import train_bpe_tokenizer

TEXT = [
    "<think> I need to search </think> <search> capital of Zorbia </search> <information> Doc 1 </information>",
    "<answer> Paris </answer> The answer is 42. Answer: 7 Zürich 東京 naïve café",
    "the quick brown fox jumps over the lazy dog 0123456789 + - * / = ( ) { } \\boxed",
] * 20


def tiny_tokenizer(vocab_size: int = 300) -> PreTrainedTokenizerFast:
    return train_bpe_tokenizer(TEXT, vocab_size)


def tiny_model(family: str = "qwen2", vocab_size: int = 300, tie: bool = False, seed: int = 0, eos_token_id=0):
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  tie_word_embeddings=tie, eos_token_id=eos_token_id)
    if family == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common)).eval()
    if family == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common)).eval()
    if family == "llama":
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64}
        return LlamaForCausalLM(LlamaConfig(rope_scaling=scaling, **common)).eval()
    raise ValueError(family)


def reference_log_probs(model, prompt: list[int], output: list[int], temperature: float = 1.0) -> torch.Tensor:
    """Log-probs of `output` after `prompt` from one plain forward pass (the slow reference)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    lp = torch.log_softmax(logits / temperature, -1)[len(prompt) - 1:-1]
    return lp.gather(-1, torch.tensor(output)[:, None]).squeeze(-1)
