"""The task of the real-model quickstart (`make quickstart-real`): single-digit additions asked
of SmolLM2-135M-Instruct in its chat template, scored by the response's last number.

Measured first (T = 1, 24 new tokens, 24 problems x 3 samples): greedy, the model answers
79% of them right, sampled at T = 1 only about 13%: it knows the sums but rambles. The gap is
what RL can close in a few steps on two cores (sharpening what the model already knows), so a
held-out gain shows in minutes. The 81 pairs (a, b) of 1-9 are split: the held-out problems'
pairs never appear in training, in either order.

`final_number_score` is the reward (reward.custom_function): 1 when the last integer of the
response is the sum, else 0 (the last-number rule of GSM8K-style graders).
Main entry points: `write_addition_data`, `final_number_score`.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

PROMPT = "What is {a} + {b}? Reply with the number only."
DATA_SOURCE = "addition"
_INTEGER = re.compile(r"-?\d+")


def addition_rows(pairs: list[tuple[int, int]], split: str) -> list[dict]:
    return [{"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": PROMPT.format(a=a, b=b)}],
             "reward_model": {"ground_truth": str(a + b)}, "extra_info": {"split": split, "index": i}}
            for i, (a, b) in enumerate(pairs)]


def write_addition_data(out: str | Path, num_val: int = 20, seed: int = 0) -> dict[str, Path]:
    """train.parquet and val.parquet under `out`: the unordered pairs {a, b} of 1-9 shuffled by
    `seed`, `num_val` of them held out (both orders of a held-out pair are held out)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    unordered = [(a, b) for a in range(1, 10) for b in range(a, 10)]  # 45 pairs
    if not 0 < num_val < len(unordered):
        raise ValueError(f"num_val={num_val}: hold out between 1 and {len(unordered) - 1} of the {len(unordered)} pairs")
    random.Random(seed).shuffle(unordered)
    held, kept = unordered[:num_val], unordered[num_val:]
    both = lambda pairs: sorted({p for a, b in pairs for p in ((a, b), (b, a))})  # noqa: E731
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"train": out / "train.parquet", "val": out / "val.parquet"}
    pq.write_table(pa.Table.from_pylist(addition_rows(both(kept), "train")), paths["train"])
    pq.write_table(pa.Table.from_pylist(addition_rows(both(held), "val")), paths["val"])
    return paths


def final_number_score(data_source: str, solution_str: str, ground_truth, extra_info=None) -> dict:
    """{"score": 1.0 or 0.0, "acc": bool, "pred": the last integer or ""}."""
    numbers = _INTEGER.findall(solution_str)
    prediction = numbers[-1] if numbers else ""
    correct = prediction != "" and int(prediction) == int(str(ground_truth).strip())
    return {"score": 1.0 if correct else 0.0, "acc": correct, "pred": prediction}
