"""megarl's embedded engine against transformers' generate, sampling from the same model: the first 32
training prompts of tools/bench/vs_trl.py's work (its warmed-up model), N samples each at the training
rollouts' settings (T=1, top_p=1, 24 new tokens), the response lengths and accuracy of both.

    python tools/bench/engine_vs_generate.py [--n 32]

The engine's samples are seeded per request (as a training step seeds them), generate's by one global
seed; the two should agree within their standard errors (printed).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from megarl.config import load_config
from megarl.data.prompts import load_prompts
from megarl.quickstart.inputs import prepare_math
from megarl.reward.scoring import RewardRequest, score_one
from megarl.rollout.engine import SamplingParams
from megarl.rollout.local import LocalEngine

ROOT = Path(__file__).resolve().parents[2]


def summary(name: str, responses: list[list[int]], records, n: int, cfg, tok) -> None:
    lengths = [len(r) for r in responses]
    acc = [score_one(cfg.reward, RewardRequest(records[i // n].data_source, tok.decode(r, skip_special_tokens=True),
                                               records[i // n].ground_truth, records[i // n].extra_info)).acc
           for i, r in enumerate(responses)]
    ended = sum(bool(r) and r[-1] == tok.eos_token_id for r in responses) / len(responses)
    k = len(responses) ** 0.5
    print(f"{name:<20} {len(responses)} samples: length {statistics.mean(lengths):.3f} (se "
          f"{statistics.pstdev(lengths) / k:.3f}), ended by EOS {ended:.3f}, acc {statistics.mean(acc):.4f} (se "
          f"{statistics.pstdev(acc) / k:.4f}); lengths {dict(sorted((x, lengths.count(x)) for x in set(lengths)))}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=32, help="samples per prompt")
    p.add_argument("--config", default="examples/quickstart/dapo_math_tiny.yaml")
    args = p.parse_args()
    world = prepare_math(ROOT / "outputs" / "bench_vs_trl" / "world")
    cfg = load_config(str(ROOT / args.config), [f"model.path={world / 'model'}",
                                                f"data.train_files=[{world / 'data' / 'train.parquet'}]"])
    tok = AutoTokenizer.from_pretrained(world / "model")
    d, r = cfg.data, cfg.rollout
    train, _ = load_prompts(d.train_files, tok, prompt_key=d.prompt_key, max_prompt_length=d.max_prompt_length,
                            apply_chat_template=d.apply_chat_template)
    records = train[:32]
    prompts = [x.prompt_ids for x in records for _ in range(args.n)]

    engine = LocalEngine(AutoModelForCausalLM.from_pretrained(world / "model", dtype=torch.float32), tok,
                         max_batch_size=64)
    params = [SamplingParams(max_new_tokens=r.max_response_length, temperature=r.temperature, top_p=r.top_p,
                             top_k=r.top_k, seed=1000 + i) for i in range(len(prompts))]

    async def sample():
        outs = await asyncio.gather(*[engine.generate(x, s) for x, s in zip(prompts, params)])
        return [list(o.token_ids) for o in outs]

    summary("embedded engine", asyncio.run(sample()), records, args.n, cfg, tok)

    model = AutoModelForCausalLM.from_pretrained(world / "model", dtype=torch.float32).eval()
    width = max(map(len, prompts))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(x)) + x for x in prompts])
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in prompts])
    torch.manual_seed(1)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=r.temperature,
                             top_p=r.top_p, top_k=max(r.top_k, 0), max_new_tokens=r.max_response_length,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    rows = out[:, width:].tolist()
    summary("transformers generate",
            [row[:row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row for row in rows],
            records, args.n, cfg, tok)


if __name__ == "__main__":
    main()
