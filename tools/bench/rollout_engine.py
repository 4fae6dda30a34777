"""Benchmark: embedded engine vs `transformers` model.generate, same model and prompts.

64 prompts x 128 new tokens (sampled, temperature 1, EOS ignored so both produce exactly
the same number of tokens) on a tiny Qwen2-architecture model, under the bench protocol
(protocol.py: a warm-up, 3 alternating timed runs, equal tokens checked, the median ratio last). The engine's advantage grows with uneven lengths (continuous batching);
this measures the plain equal-length case that `generate` is best at.

    python tools/bench/rollout_engine.py [--prompts 64 --new-tokens 128 --hidden 256 --layers 4]
    python tools/bench/rollout_engine.py --vs-sglang   # and SGLang's server (`make sglang-env`)
    python tools/bench/rollout_engine.py --model build/real-model/smollm2-135m --vs-sglang   # the real model
                                                     # (`make real-model`: SmolLM2-135M-Instruct, float32)
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from megarl.rollout.engine import SamplingParams
from megarl.rollout.local import LocalEngine
from protocol import compare


def build_model(hidden: int, layers: int, vocab: int) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                      num_attention_heads=max(hidden // 64, 2), num_key_value_heads=max(hidden // 128, 1),
                      max_position_embeddings=4096, eos_token_id=0)
    return Qwen2ForCausalLM(cfg).eval()


class EngineRun:
    """The embedded engine, built and warmed up once on an event loop kept across repeats."""

    def __init__(self, model, prompts, new_tokens: int, uneven: bool):
        self.prompts, self.new_tokens, self.uneven = prompts, new_tokens, uneven
        self.loop = asyncio.new_event_loop()
        self.engine = self.loop.run_until_complete(self._start(model))

    async def _start(self, model) -> LocalEngine:
        engine = LocalEngine(model, max_batch_size=len(self.prompts), eos_token_ids=[])
        await engine.generate(self.prompts[0], SamplingParams(max_new_tokens=2))
        return engine

    def __call__(self) -> int:
        """Generate every prompt's budget; the tokens generated (EOS is ignored: exactly the budgets)."""
        async def every_prompt():
            return await asyncio.gather(*[
                self.engine.generate(p, SamplingParams(max_new_tokens=_budget(i, self.new_tokens, self.uneven),
                                                       temperature=1.0, seed=i))
                for i, p in enumerate(self.prompts)])
        return sum(len(o.token_ids) for o in self.loop.run_until_complete(every_prompt()))

    def close(self) -> None:
        self.loop.run_until_complete(self.engine.close())
        self.loop.close()


class SGLangRun:
    """SGLang 0.5.23's own server on the CPU (from `make sglang-env`) serving the same model,
    started as megarl's fleet starts an engine, sent the same prompts over its API."""

    KEY = "rollout-engine-bench"

    def __init__(self, model, prompts, new_tokens: int, uneven: bool, python: str, workdir: Path,
                 model_dir: Path | None = None):
        """`model_dir`: an HF directory holding `model` and its tokenizer (else one is written)."""
        from megarl.config import load_config
        from megarl.data.tokenizer import train_bpe_tokenizer
        from megarl.rollout.http import HTTPEngine
        from megarl.rollout.sglang_launch import CPU_SERVER_ENV, ServerProcess, server_command

        self.prompts, self.new_tokens, self.uneven = prompts, new_tokens, uneven
        if model_dir is None:
            model_dir = workdir / "model"
            model.save_pretrained(model_dir)
            # the server detokenizes what it generates: a tokenizer with (at most) the model's vocabulary
            words = ("".join(chr(97 + (i * 7 + j * j) % 26) for j in range(3 + i % 6)) for i in range(20000))
            train_bpe_tokenizer([" ".join(words)], vocab_size=model.config.vocab_size).save_pretrained(model_dir)
        longest = max(len(p) for p in prompts) + new_tokens
        cfg = load_config(None, [f"model.path={model_dir}", "model.dtype=float32", "rollout.engine=sglang",
                                 "cluster.gpus_per_node=0", f"rollout.sglang.python={python}",
                                 f"rollout.max_concurrency={len(prompts)}",
                                 f"rollout.sglang.max_total_tokens={max(32768, 2 * len(prompts) * longest)}"])
        self.server = ServerProcess(server_command(cfg, colocated=False), "sglang", log_dir=str(workdir),
                                    api_key=self.KEY, env=dict(CPU_SERVER_ENV))
        self.server.start(timeout_s=600)
        self.client = HTTPEngine(self.server.url, api_key=self.KEY, timeout_s=600)
        self.loop = asyncio.new_event_loop()

    def __call__(self) -> int:
        async def every_prompt():
            return await asyncio.gather(*[
                self.client.generate(p, SamplingParams(max_new_tokens=_budget(i, self.new_tokens, self.uneven),
                                                       temperature=1.0, seed=i, ignore_eos=True))
                for i, p in enumerate(self.prompts)])
        return sum(len(o.token_ids) for o in self.loop.run_until_complete(every_prompt()))

    def close(self) -> None:
        self.loop.run_until_complete(self.client.close())  # its connections, on the loop that opened them
        self.loop.close()
        self.server.stop()


def _budget(i: int, new_tokens: int, uneven: bool) -> int:
    # uneven: lengths spread from new_tokens/8 to new_tokens, as sampled responses are
    return max(1, new_tokens * (1 + i % 8) // 8) if uneven else new_tokens


def generate_run(model, prompts, new_tokens: int, uneven: bool):
    """transformers' generate on the whole batch (left-padded, as decoder-only models need)."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1

    def run() -> int:
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0,
                                 eos_token_id=None)
        assert out.shape == (len(prompts), width + new_tokens), out.shape
        # generate has no per-sequence budget: the batch runs to the longest, so with uneven
        # budgets only the tokens within each budget count as done
        return sum(_budget(i, new_tokens, uneven) for i in range(len(prompts)))
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each (alternating), after a warm-up")
    parser.add_argument("--vs-sglang", action="store_true",
                        help="also SGLang 0.5.23's server on the CPU (built by `make sglang-env`)")
    parser.add_argument("--sglang-python", default=".venv-sglang/bin/python",
                        help="the interpreter of the SGLang environment (--vs-sglang)")
    parser.add_argument("--uneven", action="store_true", help="per-prompt budgets from 1/8 to all of --new-tokens")
    parser.add_argument("--model", type=Path, help="an HF directory to load (float32) instead of the random "
                        "Qwen2 that --hidden/--layers/--vocab shape, e.g. the real model of `make real-model`")
    args = parser.parse_args()
    if args.model is not None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        c = model.config
        args.vocab, args.layers, args.hidden = c.vocab_size, c.num_hidden_layers, c.hidden_size
        name = f"{c.model_type} from {args.model.name}"
    else:
        model = build_model(args.hidden, args.layers, args.vocab)
        name = "qwen2 (random)"
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, args.vocab, (args.prompt_len - (i % 16),), generator=g).tolist()
               for i in range(args.prompts)]
    params = sum(p.numel() for p in model.parameters()) / 1e6
    header = (f"model: {name} {params:.1f}M params, {args.layers} layers, hidden {args.hidden}; {args.prompts} prompts "
              f"x {args.new_tokens} new tokens{' (uneven budgets)' if args.uneven else ''}; "
              f"torch threads {torch.get_num_threads()}")
    contenders = {"generate": generate_run(model, prompts, args.new_tokens, args.uneven),
                  "engine": EngineRun(model, prompts, args.new_tokens, args.uneven)}
    with tempfile.TemporaryDirectory(prefix="rollout-engine-bench-") as workdir:
        try:
            if args.vs_sglang:
                if not Path(args.sglang_python).is_file():
                    raise SystemExit(f"no SGLang environment at {args.sglang_python}: build it with `make sglang-env`")
                contenders["sglang"] = SGLangRun(model, prompts, args.new_tokens, args.uneven,
                                                 str(Path(args.sglang_python).absolute()), Path(workdir),
                                                 model_dir=args.model.absolute() if args.model else None)
            result = compare(contenders, repeats=args.repeats, show=lambda line: print(line, flush=True),
                             header=header)
        finally:
            for contender in contenders.values():
                if hasattr(contender, "close"):
                    contender.close()
    tokens = result.work["engine"][0]
    labels = {"generate": "transformers generate", "engine": "megarl LocalEngine", "sglang": "SGLang server"}
    for name in contenders:
        rates = ", ".join(f"{tokens / s:.0f}" for s in result.seconds[name])
        print(f"{labels[name]}: {tokens:g} tokens per run, tokens/s {rates}")
    if args.vs_sglang:
        print(result.summary("sglang", "engine"))
    print(result.summary("generate", "engine"))


if __name__ == "__main__":
    main()
