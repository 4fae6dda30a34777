"""Benchmark: embedded engine vs `transformers` model.generate, same model and prompts.

64 prompts x 128 new tokens (sampled, temperature 1, EOS ignored so both produce exactly
the same number of tokens) on a tiny Qwen2-architecture model, one run each, tokens/s and
the ratio printed. The engine's advantage grows with uneven lengths (continuous batching);
this measures the plain equal-length case that `generate` is best at.

    python tools/bench/rollout_engine.py [--prompts 64 --new-tokens 128 --hidden 256 --layers 4]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from megarl.rollout.engine import SamplingParams
from megarl.rollout.local import LocalEngine
from megarl.versions import installed_versions


def build_model(hidden: int, layers: int, vocab: int) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                      num_attention_heads=max(hidden // 64, 2), num_key_value_heads=max(hidden // 128, 1),
                      max_position_embeddings=4096, eos_token_id=0)
    return Qwen2ForCausalLM(cfg).eval()


def bench_engine(model, prompts, new_tokens: int, uneven: bool) -> tuple[float, int]:
    async def go():
        engine = LocalEngine(model, max_batch_size=len(prompts), eos_token_ids=[])
        await engine.generate(prompts[0], SamplingParams(max_new_tokens=2))  # warm-up
        start = time.perf_counter()
        outs = await asyncio.gather(*[
            engine.generate(p, SamplingParams(max_new_tokens=_budget(i, new_tokens, uneven), temperature=1.0, seed=i))
            for i, p in enumerate(prompts)])
        elapsed = time.perf_counter() - start
        await engine.close()
        return elapsed, sum(len(o.token_ids) for o in outs)
    return asyncio.run(go())


def _budget(i: int, new_tokens: int, uneven: bool) -> int:
    # uneven: lengths spread from new_tokens/8 to new_tokens, as sampled responses are
    return max(1, new_tokens * (1 + i % 8) // 8) if uneven else new_tokens


def bench_generate(model, prompts, new_tokens: int, uneven: bool) -> tuple[float, int]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):  # left padding, as generate expects for decoder-only models
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    model.generate(ids[:1, -2:], max_new_tokens=2, do_sample=True, pad_token_id=0)  # warm-up
    torch.manual_seed(0)
    start = time.perf_counter()
    with torch.inference_mode():
        # generate has no per-sequence budget: the batch runs to the longest, so with
        # uneven budgets only the tokens within each budget count as useful
        model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=None)
    elapsed = time.perf_counter() - start
    useful = sum(_budget(i, new_tokens, uneven) for i in range(len(prompts)))
    return elapsed, useful


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--uneven", action="store_true", help="per-prompt budgets from 1/8 to all of --new-tokens")
    args = parser.parse_args()
    print(installed_versions(), flush=True)
    model = build_model(args.hidden, args.layers, args.vocab)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, args.vocab, (args.prompt_len - (i % 16),), generator=g).tolist()
               for i in range(args.prompts)]
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"model: qwen2 {params:.1f}M params, {args.layers} layers, hidden {args.hidden}; "
          f"{args.prompts} prompts x {args.new_tokens} new tokens{' (uneven budgets)' if args.uneven else ''}; "
          f"torch threads {torch.get_num_threads()}")
    t_gen, n_gen = bench_generate(model, prompts, args.new_tokens, args.uneven)
    t_eng, n_eng = bench_engine(model, prompts, args.new_tokens, args.uneven)
    print(f"{'':24}{'tokens':>8}{'seconds':>10}{'tokens/s':>11}")
    print(f"{'transformers generate':24}{n_gen:8d}{t_gen:10.2f}{n_gen / t_gen:11.1f}")
    print(f"{'megarl LocalEngine':24}{n_eng:8d}{t_eng:10.2f}{n_eng / t_eng:11.1f}")
    print(f"ratio engine / generate: {(n_eng / t_eng) / (n_gen / t_gen):.2f}x")


if __name__ == "__main__":
    main()
