"""A synthetic "search world" for the CPU quickstart and tests.

Invented entities with invented facts, so answers cannot be guessed without searching:
a corpus in the wiki-18 format (`{"id", "contents": '"Title"\\ntext'}`), and questions with
golden answers written as Search-R1 prepares its data (`data_source`, chat `prompt`,
`reward_model.ground_truth.target`, `extra_info`). Everything is seeded. Main entry point:
`write_search_world`.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from megarl.rollout.agent import SEARCH_INSTRUCTION

SYLLABLES = ["zor", "bia", "qua", "lin", "mex", "tor", "vel", "dra", "pon", "kis", "ru", "ta", "nel", "fim", "gar",
             "sol", "ube", "wex", "yal", "cor"]
RELATIONS = {  # relation -> (question template, sentence template)
    "capital": ("What is the capital of {e}?", "The capital of {e} is {a}."),
    "founder": ("Who founded {e}?", "{e} was founded by {a}."),
    "river": ("Which river flows through {e}?", "The river {a} flows through {e}."),
}
DATA_SOURCE = "search_world"


@dataclass(frozen=True)
class Fact:
    entity: str
    relation: str
    answer: str


def _name(rng: random.Random, used: set[str]) -> str:
    while True:
        name = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()
        if name not in used:
            used.add(name)
            return name


def make_facts(num_entities: int, seed: int) -> list[Fact]:
    rng, used = random.Random(seed), set()
    entities = [_name(rng, used) for _ in range(num_entities)]
    return [Fact(e, relation, _name(rng, used)) for e in entities for relation in RELATIONS]


def corpus_rows(facts: list[Fact]) -> list[dict]:
    """One passage per entity holding its facts, so a search for the entity finds them."""
    by_entity: dict[str, list[Fact]] = {}
    for f in facts:
        by_entity.setdefault(f.entity, []).append(f)
    rows = []
    for i, (entity, items) in enumerate(by_entity.items()):
        text = " ".join(RELATIONS[f.relation][1].format(e=entity, a=f.answer) for f in items)
        rows.append({"id": str(i), "contents": f'"{entity}"\n{text}'})
    return rows


def question_row(fact: Fact, index: int, split: str) -> dict:
    question = RELATIONS[fact.relation][0].format(e=fact.entity)
    return {"data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": SEARCH_INSTRUCTION.format(question=question)}],
            "ability": "fact-reasoning",
            "reward_model": {"style": "rule", "ground_truth": {"target": [fact.answer]}},
            "extra_info": {"split": split, "index": index, "question": question, "entity": fact.entity}}


def write_search_world(out_dir: str | Path, num_entities: int = 200, val_fraction: float = 0.1,
                       seed: int = 0) -> dict[str, Path]:
    """corpus.jsonl, train.parquet and val.parquet under out_dir; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    facts = make_facts(num_entities, seed)
    rng = random.Random(seed + 1)
    order = list(range(len(facts)))
    rng.shuffle(order)
    num_val = max(1, int(len(facts) * val_fraction))
    val, train = order[:num_val], order[num_val:]
    paths = {"corpus": out / "corpus.jsonl", "train": out / "train.parquet", "val": out / "val.parquet"}
    with open(paths["corpus"], "w", encoding="utf-8") as fh:
        for row in corpus_rows(facts):
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    pq.write_table(pa.Table.from_pylist([question_row(facts[i], k, "train") for k, i in enumerate(train)]),
                   paths["train"])
    pq.write_table(pa.Table.from_pylist([question_row(facts[i], k, "test") for k, i in enumerate(val)]), paths["val"])
    return paths
