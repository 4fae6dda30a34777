"""The code quickstart's synthetic task: programs that read integers and print one number.

Each problem asks for a Python program that reads whitespace-separated integers from stdin
and prints their sum, maximum, minimum or count, plus a constant k (0..9): 40 problems. Its
rows are open-r1's code rows (data_source "code", verification_info as the ground truth with
random test cases), so the code reward runs each sampled program on them in the sandbox.
Demonstrations write the right program some of the time and a program with the wrong
operation or constant otherwise: a noisy policy for RL to sharpen.

Main entry points: `write_code_world`, `read_code_problems`, `code_examples`.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

OPERATIONS = {"sum": "sum(nums)", "maximum": "max(nums)", "minimum": "min(nums)", "count": "len(nums)"}
INSTRUCTION = ("Write a Python program that reads whitespace-separated integers from standard input and "
               "prints their {operation} plus {k}. Put the program in a ```python block.")


@dataclass(frozen=True)
class CodeProblem:
    operation: str  # a key of OPERATIONS
    k: int

    @property
    def prompt(self) -> str:
        return INSTRUCTION.format(operation=self.operation, k=self.k)

    def program(self, operation: str | None = None, k: int | None = None) -> str:
        op = OPERATIONS[operation or self.operation]
        return f"nums = list(map(int, open(0).read().split()))\nprint({op} + {self.k if k is None else k})"

    def answer(self, nums: list[int]) -> int:
        return {"sum": sum, "maximum": max, "minimum": min, "count": len}[self.operation](nums) + self.k


def code_row(problem: CodeProblem, index: int, split: str, rng: random.Random, cases: int = 4) -> dict:
    tests = []
    for _ in range(cases):
        nums = [rng.randint(-50, 50) for _ in range(rng.randint(1, 8))]
        tests.append({"input": " ".join(map(str, nums)) + "\n", "output": str(problem.answer(nums)),
                      "type": "stdin_stdout"})
    return {"data_source": "code", "prompt": [{"role": "user", "content": problem.prompt}], "ability": "CODE",
            "reward_model": {"style": "rule", "ground_truth": json.dumps({"language": "python", "test_cases": tests})},
            "extra_info": {"split": split, "index": index, "operation": problem.operation, "k": problem.k}}


def write_code_world(out_dir: str | Path, num_val: int = 8, seed: int = 0) -> dict[str, Path]:
    """train.parquet with all 40 problems, val.parquet with num_val of them (new test cases)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    problems = [CodeProblem(op, k) for op in OPERATIONS for k in range(10)]
    val = rng.sample(problems, min(num_val, len(problems)))
    paths = {"train": out / "train.parquet", "val": out / "val.parquet"}
    pq.write_table(pa.Table.from_pylist([code_row(p, i, "train", rng) for i, p in enumerate(problems)]), paths["train"])
    pq.write_table(pa.Table.from_pylist([code_row(p, i, "test", rng) for i, p in enumerate(val)]), paths["val"])
    return paths


def read_code_problems(parquet_path: str | Path) -> list[CodeProblem]:
    import pyarrow.parquet as pq

    return [CodeProblem(r["extra_info"]["operation"], r["extra_info"]["k"])
            for r in pq.read_table(parquet_path).to_pylist()]


def response_text(program: str) -> str:
    return f"```python\n{program}\n```"


def code_examples(problems: list[CodeProblem], tokenizer, correct_fraction: float, seed: int, repeats: int = 1):
    """Demonstrations (EOS-terminated): the right program with probability correct_fraction,
    otherwise one with another operation or constant."""
    from megarl.data.prompts import render_prompt
    from megarl.quickstart.worlds import Demonstration

    rng = random.Random(seed)
    out = []
    for problem in [p for _ in range(repeats) for p in problems]:
        if rng.random() < correct_fraction:
            program = problem.program()
        elif rng.random() < 0.5:
            program = problem.program(operation=rng.choice([o for o in OPERATIONS if o != problem.operation]))
        else:
            program = problem.program(k=rng.choice([k for k in range(10) if k != problem.k]))
        prompt = render_prompt(tokenizer, [{"role": "user", "content": problem.prompt}], True)  # as the trainer
        response = tokenizer.encode(response_text(program), add_special_tokens=False) + [tokenizer.eos_token_id]
        out.append(Demonstration(list(prompt), response, [1] * len(response)))
    return out
