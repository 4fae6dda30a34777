"""The world of the tool-use quickstart: products of two-digit numbers, which a tiny model
cannot work out in its head, and a tool that can.

Questions "What is 37 * 48?" with the product as the golden answer, scored by exact match of
the `<answer>` (data_source `calculator_world`, routed to search_r1_em by the run's
reward.data_sources). The warm-up demonstrations lay out the agent's tokens exactly: with
probability `call_fraction` the model calls the tool with the question's expression, reads
the observation (masked) and answers with it; otherwise it guesses a number of the product's
size, almost never right. RL then has something to discover: calling pays.

The tool is the calculator (`<calculator> 37 * 48 </calculator>` -> `<result>1776</result>`)
or, as the Python variant, the sandboxed interpreter (`<python> print(37 * 48) </python>` ->
`<output>1776\\n</output>`); each demonstration's observation is the one the tool returns.
Main entry points: `write_tool_world`, `tool_examples`.
"""

from __future__ import annotations

import asyncio
import functools
import random
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from megarl.data.prepare import write_rows
from megarl.quickstart.worlds import Demonstration

DATA_SOURCE = "calculator_world"
TOOL_INSTRUCTIONS = {
    "calculator": "calculate by <calculator> expression </calculator> and it will return the result between "
                  "<result> and </result>",
    "python": "run Python code by <python> code </python> and it will return what the code prints between "
              "<output> and </output>",
}
INSTRUCTION = ("Answer the given question. If you need to compute something, you can {tool}. Give the final answer "
               "inside <answer> and </answer>. Question: {question}\n")


@dataclass(frozen=True)
class Product:
    a: int
    b: int

    @property
    def question(self) -> str:
        return f"What is {self.a} * {self.b}?"

    @property
    def answer(self) -> int:
        return self.a * self.b

    def call(self, tool: str) -> str:
        """The argument a good caller writes for this tool."""
        return f"print({self.a} * {self.b})" if tool == "python" else f"{self.a} * {self.b}"


def prompt_text(item: Product, tool: str) -> str:
    return INSTRUCTION.format(tool=TOOL_INSTRUCTIONS[tool], question=item.question)


def question_row(item: Product, index: int, split: str, tool: str) -> dict:
    return {"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": prompt_text(item, tool)}],
            "ability": "arithmetic", "reward_model": {"style": "rule", "ground_truth": {"target": [str(item.answer)]}},
            "extra_info": {"split": split, "index": index, "a": item.a, "b": item.b}}


def make_products(count: int, seed: int, low: int = 10, high: int = 99) -> list[Product]:
    """`count` distinct products a * b with low <= a, b <= high, in a seeded order."""
    pairs = [Product(a, b) for a in range(low, high + 1) for b in range(low, high + 1)]
    return random.Random(seed).sample(pairs, count)


def write_tool_world(out_dir: str | Path, tool: str, num_train: int = 400, num_val: int = 40,
                     seed: int = 0) -> dict[str, Path]:
    """train.parquet and val.parquet under out_dir (validation asks products training never does)."""
    if tool not in TOOL_INSTRUCTIONS:
        raise ValueError(f"the tool quickstart has a world for {sorted(TOOL_INSTRUCTIONS)}, not {tool!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    items = make_products(num_train + num_val, seed)
    paths = {"train": out / "train.parquet", "val": out / "val.parquet"}
    write_rows([question_row(x, i, "train", tool) for i, x in enumerate(items[:num_train])], paths["train"])
    write_rows([question_row(x, i, "test", tool) for i, x in enumerate(items[num_train:])], paths["val"])
    return paths


def read_products(parquet_path: str | Path) -> list[Product]:
    return [Product(r["extra_info"]["a"], r["extra_info"]["b"]) for r in pq.read_table(parquet_path).to_pylist()]


def observation_text(item: Product, tool: str) -> str:
    """The observation the tool itself returns for the call a good caller writes (the python
    tool's written as its sandbox prints it, without running it: the warm-up needs no sandbox)."""
    from megarl.tools.base import ToolSet
    from megarl.tools.calculator import Calculator

    if tool == "calculator":
        tools = ToolSet([Calculator()])
        return asyncio.run(tools.run(tools.parse(f"<calculator> {item.call(tool)} </calculator>"))).text
    from megarl.tools.base import tagged_observation
    from megarl.tools.python import PythonTool

    return tagged_observation(PythonTool.observation_tag, f"{item.answer}\n")  # what print() writes


@functools.cache
def call_pieces(item: Product, tool: str) -> list[tuple[str, int]]:
    """(text, loss mask) of a response that calls the tool and answers from its observation."""
    return [(f"<{tool}> {item.call(tool)} </{tool}>", 1), (observation_text(item, tool), 0),
            (f"<answer> {item.answer} </answer>", 1)]


def tool_examples(items: list[Product], tokenizer, tool: str, call_fraction: float, seed: int,
                  repeats: int = 1, bare_question: bool = False) -> list[Demonstration]:
    """`repeats` demonstrations per product: with probability call_fraction a call, its
    observation (loss mask 0) and the answer read from it; otherwise a guessed answer of as
    many digits as the product. bare_question: the prompt is only "Question: ...\\n" (short
    sequences, for the first phase of the warm-up)."""
    rng = random.Random(seed)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    out = []
    for item in [x for _ in range(repeats) for x in items]:
        prompt = encode(f"Question: {item.question}\n" if bare_question else prompt_text(item, tool))
        called = rng.random() < call_fraction
        if called:
            pieces = call_pieces(item, tool)
        else:
            digits = len(str(item.answer))
            pieces = [(f"<answer> {rng.randrange(10 ** (digits - 1), 10 ** digits)} </answer>", 1)]
        response, mask = [], []
        for text, m in pieces:
            ids = encode(text)
            response += ids
            mask += [m] * len(ids)
        out.append(Demonstration(prompt, response, mask, called))
    return out
