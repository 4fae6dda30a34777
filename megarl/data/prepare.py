"""Training and validation parquet files for the recipes, from public data sets.

Rows come out in the format megarl's data loader and reward routing read (verl's): a
`data_source` (which routes the reward), `prompt` as chat messages, `reward_model.ground_truth`,
`extra_info`. Sources are local files (parquet, jsonl) or, where the machine can reach it, a
dataset on the Hugging Face hub. A malformed row stops the work with its file and row number.

- DAPO: `dapo_math_rows` (DAPO-Math-17k, whose published file repeats each prompt about 100
  times: deduplicated by default) and `aime_rows` (AIME-2024, in the same format or as
  problem / answer columns).
- Search-R1: `search_r1_rows` (FlashRAG's QA sets: {id, question, golden_answers}) with the
  Search-R1 instruction and {"target": golden_answers}.

Main entry points: those three, `read_source`, `write_rows`; `megarl data dapo-math` and
`megarl data search-r1` (megarl.data.commands) are their command lines.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

from megarl.data.prompts import CORPUS_METADATA, DataError, read_rows
from megarl.rollout.agent import SEARCH_INSTRUCTION

log = logging.getLogger(__name__)

# DAPO-Math-17k's prompt around a problem, and its data_source (routed to the DAPO math reward)
DAPO_MATH_INSTRUCTION = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
    "Remember to put your answer on its own line after \"Answer:\"."
)
MATH_DATA_SOURCE = "math_dapo"

Row = tuple[str, dict]  # (where it came from, e.g. "train.jsonl row 12", the row)

# Search-R1's data: training on NQ + HotpotQA, testing on seven QA sets (FlashRAG's split names)
SEARCH_R1_TRAIN = {"nq": "train", "hotpotqa": "train"}
SEARCH_R1_TEST = {"nq": "test", "triviaqa": "test", "popqa": "test", "hotpotqa": "dev", "2wikimultihopqa": "dev",
                  "musique": "dev", "bamboogle": "test"}


def read_source(source: str, *, split: str = "train", subset: str | None = None) -> Iterator[Row]:
    """Rows of a local parquet / jsonl file, or of a hub dataset (`name`, with `subset`, `split`)."""
    path = Path(source)
    if path.exists():
        for number, row in enumerate(read_rows(path), 1):  # read_rows: JSON objects, else DataError with the line
            yield f"{path} row {number}", row
        return
    if source.endswith((".parquet", ".jsonl", ".json")) or "/" not in source:
        raise DataError(f"{source}: no such file (and not a hub dataset name such as org/name)")
    try:
        from datasets import load_dataset

        dataset = load_dataset(source, subset, split=split)
    except Exception as e:  # the hub's errors are many (offline, gated, renamed); say which and what to do
        raise DataError(f"could not load {source}{f' ({subset})' if subset else ''} split {split} from the hub: "
                        f"{type(e).__name__}: {e}; download the files and pass their paths instead") from None
    for number, row in enumerate(dataset, 1):
        yield f"{source}:{split} row {number}", dict(row)


def _text(value, where: str, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{where}: {what} must be a non-empty string, got {value!r}")
    return value.strip()


def _prompt_text(row: dict, where: str) -> str:
    prompt = row.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "content" in m for m in prompt):
        return _text(prompt[-1]["content"], where, "the prompt's last message")
    if isinstance(prompt, str):
        return _text(prompt, where, "prompt")
    raise DataError(f"{where}: prompt must be chat messages [{{role, content}}] or a string, got {prompt!r}")


def dapo_math_rows(rows: Iterable[Row], dedupe: bool = True) -> tuple[list[dict], dict[str, int]]:
    """DAPO-Math-17k rows (prompt as chat messages, reward_model.ground_truth) in megarl's
    format, data_source math_dapo (the DAPO math reward); (rows, counts read / kept / duplicates)."""
    out, seen, read = [], set(), 0
    for where, row in rows:
        read += 1
        content = _prompt_text(row, where)
        reward = row.get("reward_model")
        if not isinstance(reward, dict) or reward.get("ground_truth") in (None, ""):
            raise DataError(f"{where}: reward_model.ground_truth is missing")
        if dedupe and content in seen:
            continue
        seen.add(content)
        out.append({"data_source": MATH_DATA_SOURCE, "prompt": [{"role": "user", "content": content}],
                    "ability": "MATH", "reward_model": {"style": "rule", "ground_truth": str(reward["ground_truth"])},
                    "extra_info": {"index": len(out), "source_index": str((row.get("extra_info") or {}).get("index",
                                                                                                        read - 1))}})
    return out, {"read": read, "kept": len(out), "duplicates": read - len(out)}


def aime_rows(rows: Iterable[Row], repeat: int = 1) -> list[dict]:
    """AIME problems with the DAPO-Math instruction, each `repeat` times. Accepts rows already
    in DAPO's format or rows with problem / answer columns (any capitalisation)."""
    if repeat < 1:
        raise ValueError(f"repeat={repeat} must be at least 1")
    problems = []
    for where, row in rows:
        lower = {k.lower(): v for k, v in row.items()}
        if "prompt" in row:
            content = _prompt_text(row, where)
            answer = (row.get("reward_model") or {}).get("ground_truth")
        elif "problem" in lower:
            content = DAPO_MATH_INSTRUCTION.format(problem=_text(lower["problem"], where, "problem"))
            answer = lower.get("answer")
        else:
            raise DataError(f"{where}: neither a prompt nor a problem column (have {sorted(row)})")
        if answer in (None, ""):
            raise DataError(f"{where}: no answer")
        problems.append((content, str(answer).strip()))
    return [{"data_source": "aime2024", "prompt": [{"role": "user", "content": content}], "ability": "MATH",
             "reward_model": {"style": "rule", "ground_truth": answer},
             "extra_info": {"index": i, "problem_index": i % len(problems)}}
            for i, (content, answer) in enumerate(problems * repeat)]


def search_r1_rows(dataset: str, split: str, rows: Iterable[Row]) -> list[dict]:
    """FlashRAG QA rows ({question, golden_answers}) with the Search-R1 instruction; the
    data_source is the data set's name (nq, hotpotqa, ...), which routes to exact match."""
    out = []
    for where, row in rows:
        question = _text(row.get("question"), where, "question")
        if not question.endswith("?"):
            question += "?"
        answers = row.get("golden_answers")
        if isinstance(answers, str):
            answers = [answers]
        if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
            raise DataError(f"{where}: golden_answers must be a non-empty list of strings, got {answers!r}")
        out.append({"data_source": dataset,
                    "prompt": [{"role": "user", "content": SEARCH_INSTRUCTION.format(question=question)}],
                    "ability": "fact-reasoning", "reward_model": {"style": "rule", "ground_truth": {"target": answers}},
                    "extra_info": {"split": split, "index": len(out), "id": str(row.get("id", len(out)))}})
    return out


def write_rows(rows: list[dict], path: str | Path, corpus: dict | None = None) -> Path:
    """Parquet, written to a temporary name and renamed (a reader never sees half a file).
    corpus: the retrieval corpus the questions are answered from (`corpus_info(path)`),
    recorded in the file so that a run warns when its index was built from another."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not rows:
        raise DataError(f"nothing to write to {path}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    table = pa.Table.from_pylist(rows)
    if corpus is not None:
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), CORPUS_METADATA: json.dumps(corpus)})
    pq.write_table(table, tmp)
    tmp.rename(path)
    return path
