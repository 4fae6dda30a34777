"""`megarl data dapo-math` and `megarl data search-r1` on small local files they are
given (no hub access): the rows megarl's loader and reward routing read, deduplication
counts, and malformed rows stopped with their file and row number."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from megarl.data.prepare import DAPO_MATH_INSTRUCTION
from megarl.data.prompts import load_prompts
from megarl.reward import compute_score
from megarl.rollout.agent import SEARCH_INSTRUCTION
from tiny_models import tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def tool(name: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megarl.cli", "data", name, *map(str, args)], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)


def write_jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def dapo_row(i: int, answer: str) -> dict:
    # DAPO-Math-17k's published format
    return {"data_source": "math_dapo", "ability": "MATH", "extra_info": {"index": f"uuid-{i}"},
            "prompt": [{"role": "user", "content": DAPO_MATH_INSTRUCTION.format(problem=f"Problem {i}")}],
            "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"}}


def test_dapo_math_is_deduplicated_and_routed_to_the_math_reward(tmp_path):
    rows = [dapo_row(i % 3, str(i % 3 + 10)) for i in range(12)]  # 3 prompts, each 4 times
    train = write_jsonl(tmp_path / "dapo.jsonl", rows)
    aime = write_jsonl(tmp_path / "aime.jsonl", [{"ID": "2024-I-1", "Problem": "Find x.", "Answer": 204},
                                                  {"ID": "2024-I-2", "Problem": "Find y.", "Answer": 25}])
    result = tool("dapo-math", "--out", tmp_path / "out", "--train", train, "--val", aime,
                  "--val-repeat", 2)
    assert result.returncode == 0, result.stderr
    assert "3 prompts (12 rows read, 9 duplicates dropped)" in result.stdout
    out = pq.read_table(tmp_path / "out" / "dapo-math-17k.parquet").to_pylist()
    assert [r["reward_model"]["ground_truth"] for r in out] == ["10", "11", "12"]
    assert out[1]["prompt"] == rows[1]["prompt"] and out[1]["extra_info"]["source_index"] == "uuid-1"
    val = pq.read_table(tmp_path / "out" / "aime-2024.parquet").to_pylist()
    assert [r["reward_model"]["ground_truth"] for r in val] == ["204", "25", "204", "25"]
    assert val[0]["prompt"][0]["content"] == DAPO_MATH_INSTRUCTION.format(problem="Find x.")
    # the loader reads them and the reward routes them (right and wrong answers score +1 / -1)
    records, _ = load_prompts([str(tmp_path / "out" / "aime-2024.parquet")], tiny_tokenizer(), max_prompt_length=4096)
    assert len(records) == 4 and records[0].data_source == "aime2024"
    assert compute_score("aime2024", "so x is 204.\nAnswer: 204", "204")["score"] == 1.0
    assert compute_score("math_dapo", "Answer: 13", out[0]["reward_model"]["ground_truth"])["score"] == -1.0


def test_keep_duplicates(tmp_path):
    train = write_jsonl(tmp_path / "dapo.jsonl", [dapo_row(0, "1")] * 3)
    aime = write_jsonl(tmp_path / "aime.jsonl", [{"problem": "p", "answer": "1"}])
    assert tool("dapo-math", "--out", tmp_path, "--train", train, "--val", aime,
                "--keep-duplicates").returncode == 0
    assert pq.read_table(tmp_path / "dapo-math-17k.parquet").num_rows == 3


@pytest.mark.parametrize("bad, words", [
    ({"prompt": [{"role": "user", "content": "x"}]}, "row 2: reward_model.ground_truth is missing"),
    ({"prompt": 7, "reward_model": {"ground_truth": "1"}}, "row 2: prompt must be chat messages"),
])
def test_malformed_dapo_rows_name_their_row(tmp_path, bad, words):
    train = write_jsonl(tmp_path / "dapo.jsonl", [dapo_row(0, "1"), bad])
    result = tool("dapo-math", "--out", tmp_path / "out", "--train", train, "--val", train)
    assert result.returncode == 1 and words in result.stderr and str(train) in result.stderr
    assert not (tmp_path / "out" / "dapo-math-17k.parquet").exists()


def test_a_broken_jsonl_line_names_its_line(tmp_path):
    train = tmp_path / "dapo.jsonl"
    train.write_text(json.dumps(dapo_row(0, "1")) + "\n{not json\n")
    result = tool("dapo-math", "--out", tmp_path / "out", "--train", train, "--val", train)
    assert result.returncode == 1 and f"{train}:2: not valid JSON" in result.stderr


def test_a_missing_source_says_what_to_do(tmp_path):
    result = tool("dapo-math", "--out", tmp_path, "--train", tmp_path / "nope.parquet")
    assert result.returncode == 1 and "no such file" in result.stderr


def flashrag(root: Path) -> Path:
    questions = {("nq", "train"): [("who wrote hamlet", ["Shakespeare", "William Shakespeare"])],
                 ("hotpotqa", "train"): [("which is older, x or y?", ["x"]), ("capital of france", ["Paris"])]}
    for (dataset, split), items in questions.items():
        write_jsonl(root / dataset / f"{split}.jsonl", [{"id": f"{dataset}_{i}", "question": q, "golden_answers": a}
                                                        for i, (q, a) in enumerate(items)])
    write_jsonl(root / "nq" / "test.jsonl", [{"id": "t0", "question": "where is the eiffel tower",
                                              "golden_answers": ["Paris"]}])
    write_jsonl(root / "bamboogle" / "test.jsonl", [{"id": "b0", "question": "q?", "golden_answers": ["a"]}])
    return root


def test_search_r1_rows(tmp_path):
    source = flashrag(tmp_path / "flashrag")
    result = tool("search-r1", "--out", tmp_path / "out", "--source", source,
                  "--test-sets", "nq:test,bamboogle:test")
    assert result.returncode == 0, result.stderr
    assert "3 questions (nq 1, hotpotqa 2)" in result.stdout
    train = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    assert [r["data_source"] for r in train] == ["nq", "hotpotqa", "hotpotqa"]
    assert train[0]["prompt"] == [{"role": "user", "content": SEARCH_INSTRUCTION.format(question="who wrote hamlet?")}]
    assert train[0]["reward_model"]["ground_truth"] == {"target": ["Shakespeare", "William Shakespeare"]}
    assert train[1]["prompt"][0]["content"].endswith("Question: which is older, x or y?\n")  # no second "?"
    test = pq.read_table(tmp_path / "out" / "test.parquet").to_pylist()
    assert [r["data_source"] for r in test] == ["nq", "bamboogle"]
    # exact match after SQuAD normalisation, routed by data_source
    gt = train[0]["reward_model"]["ground_truth"]
    assert compute_score("nq", "<answer> william shakespeare </answer>", gt)["score"] == 1.0
    assert compute_score("nq", "<answer> Marlowe </answer>", gt)["score"] == 0.0


def test_search_r1_default_test_sets_need_every_file(tmp_path):
    source = flashrag(tmp_path / "flashrag")
    result = tool("search-r1", "--out", tmp_path / "out", "--source", source)
    assert result.returncode == 1 and "no test.jsonl or test.parquet in" in result.stderr and "triviaqa" in result.stderr


@pytest.mark.parametrize("bad, words", [
    ({"id": "x", "golden_answers": ["a"]}, "row 2: question must be a non-empty string"),
    ({"id": "x", "question": "q", "golden_answers": []}, "row 2: golden_answers must be a non-empty list"),
    ({"id": "x", "question": "q", "golden_answers": [3]}, "row 2: golden_answers must be a non-empty list"),
])
def test_malformed_qa_rows_name_their_row(tmp_path, bad, words):
    source = flashrag(tmp_path / "flashrag")
    path = source / "nq" / "train.jsonl"
    path.write_text(path.read_text() + json.dumps(bad) + "\n")
    result = tool("search-r1", "--out", tmp_path / "out", "--source", source, "--test-sets", "nq:test")
    assert result.returncode == 1 and words in result.stderr and str(path) in result.stderr
