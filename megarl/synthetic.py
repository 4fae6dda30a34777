"""A synthetic "search world" for the CPU quickstart and tests.

Invented entities with invented facts, so answers cannot be guessed without searching:
a corpus in the wiki-18 format (`{"id", "contents": '"Title"\\ntext'}`, one passage per fact),
and questions with golden answers written as Search-R1 prepares its data (`data_source`,
chat `prompt`, `reward_model.ground_truth.target`, `extra_info`). Each relation draws its
answers from its own small pool of invented names, so a guess is right 1 time in
`answers_per_relation`. Validation asks about entities the training questions also
mention, through a relation the training set never asks for that entity: the entity is
familiar, the fact is not.

`warmup_examples` writes demonstrations for a short supervised warm-up in the exact token
layout the agent produces (observations from the real index, masked), in which only a
fraction of the trajectories search; the rest answer with a guess. Everything is seeded.
Main entry points: `write_search_world`, `warmup_examples`.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from megarl.rollout.agent import SEARCH_INSTRUCTION, format_observation

SYLLABLES = ["zor", "bia", "qua", "lin", "mex", "tor", "vel", "dra", "pon", "kis", "ru", "ta", "nel", "fim", "gar",
             "sol", "ube", "wex", "yal", "cor"]
RELATIONS = {  # relation keyword -> (question template, passage sentence template)
    # the keyword appears in both, so a search for "{entity} {keyword}" ranks the fact first;
    # the answer ends the sentence
    "capital": ("What is the capital of {e}?", "The capital of {e} is {a}."),
    "founded": ("Who founded {e}?", "{e} was founded by {a}."),
    "river": ("Which river flows through {e}?", "{e} lies on the river {a}."),
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


def make_facts(num_entities: int, seed: int, answers_per_relation: int = 16) -> list[Fact]:
    """Every entity gets one fact per relation; each relation's answers come from its own pool."""
    rng, used = random.Random(seed), set()
    entities = [_name(rng, used) for _ in range(num_entities)]
    pools = {relation: [_name(rng, used) for _ in range(answers_per_relation)] for relation in RELATIONS}
    return [Fact(e, relation, rng.choice(pools[relation])) for e in entities for relation in RELATIONS]


def corpus_rows(facts: list[Fact]) -> list[dict]:
    """One passage per fact, titled by its entity."""
    return [{"id": str(i), "contents": f'"{f.entity}"\n' + RELATIONS[f.relation][1].format(e=f.entity, a=f.answer)}
            for i, f in enumerate(facts)]


def question(fact: Fact) -> str:
    return RELATIONS[fact.relation][0].format(e=fact.entity)


def search_query(fact: Fact) -> str:
    """The query a good searcher writes for the fact."""
    return f"{fact.entity} {fact.relation}"


def answer_pools(facts: list[Fact]) -> dict[str, list[str]]:
    pools: dict[str, list[str]] = {}
    for f in facts:
        pools.setdefault(f.relation, [])
        if f.answer not in pools[f.relation]:
            pools[f.relation].append(f.answer)
    return pools


def question_row(fact: Fact, index: int, split: str) -> dict:
    return {"data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": SEARCH_INSTRUCTION.format(question=question(fact))}],
            "ability": "fact-reasoning",
            "reward_model": {"style": "rule", "ground_truth": {"target": [fact.answer]}},
            "extra_info": {"split": split, "index": index, "question": question(fact), "entity": fact.entity,
                           "relation": fact.relation}}


def split_facts(facts: list[Fact], val_fraction: float, seed: int) -> tuple[list[Fact], list[Fact]]:
    """(train, val): val facts are drawn so that every val entity keeps a training fact."""
    rng = random.Random(seed)
    order = list(range(len(facts)))
    rng.shuffle(order)
    num_val = max(1, int(len(facts) * val_fraction))
    left = {}  # entity -> facts of it still in train
    for f in facts:
        left[f.entity] = left.get(f.entity, 0) + 1
    val_idx = []
    for i in order:
        if len(val_idx) == num_val:
            break
        if left[facts[i].entity] > 1:
            left[facts[i].entity] -= 1
            val_idx.append(i)
    chosen = set(val_idx)
    return [f for i, f in enumerate(facts) if i not in chosen], [facts[i] for i in val_idx]


def write_search_world(out_dir: str | Path, num_entities: int = 200, val_fraction: float = 0.1,
                       seed: int = 0, answers_per_relation: int = 16) -> dict[str, Path]:
    """corpus.jsonl, train.parquet and val.parquet under out_dir; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    facts = make_facts(num_entities, seed, answers_per_relation)
    train, val = split_facts(facts, val_fraction, seed + 1)
    paths = {"corpus": out / "corpus.jsonl", "train": out / "train.parquet", "val": out / "val.parquet"}
    with open(paths["corpus"], "w", encoding="utf-8") as fh:
        for row in corpus_rows(facts):
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    pq.write_table(pa.Table.from_pylist([question_row(f, k, "train") for k, f in enumerate(train)]), paths["train"])
    pq.write_table(pa.Table.from_pylist([question_row(f, k, "test") for k, f in enumerate(val)]), paths["val"])
    return paths


def read_facts(parquet_path: str | Path) -> list[Fact]:
    """The facts behind a question file written by `write_search_world`."""
    rows = pq.read_table(parquet_path).to_pylist()
    return [Fact(r["extra_info"]["entity"], r["extra_info"]["relation"], r["reward_model"]["ground_truth"]["target"][0])
            for r in rows]


@dataclass
class Demonstration:
    """Prompt and response token ids as the agent lays them out; loss_mask 0 on observations."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    searched: bool


def warmup_examples(facts: list[Fact], tokenizer, search_fraction: float, seed: int, topk: int = 1,
                    bare_question: bool = False, repeats: int = 1) -> list[Demonstration]:
    """`repeats` demonstrations per (entity, relation) of `facts`, each with answers drawn afresh from
    the relation's pool, so the warm-up teaches reading the observation, not memorising the
    world. With probability search_fraction it searches for "{entity} {keyword}", reads the
    passages the index returns for that query (the fact first, then the entity's other
    facts, topk in all) and answers from them; otherwise it answers at once with a guess.
    bare_question: the prompt is only the instruction's last line, "Question: ...\\n" (short
    sequences, for the first phase of a warm-up curriculum)."""
    from megarl.retrieval.client import SearchResult
    from megarl.retrieval.documents import Document

    rng = random.Random(seed)
    pools = answer_pools(facts)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    out = []
    for f in [f for _ in range(repeats) for f in facts]:
        prompt = encode(f"Question: {question(f)}\n" if bare_question
                        else SEARCH_INSTRUCTION.format(question=question(f)))
        searched = rng.random() < search_fraction
        if searched:
            drawn = {r: rng.choice(pools[r]) for r in RELATIONS}
            order = [f.relation] + [r for r in RELATIONS if r != f.relation]
            docs = [Document(str(i), corpus_rows([Fact(f.entity, r, drawn[r])])[0]["contents"])
                    for i, r in enumerate(order[:topk])]
            query = search_query(f)
            pieces = [(f"<search> {query} </search>", 1),
                      (format_observation(SearchResult(docs=docs)), 0),
                      (f"<answer> {drawn[f.relation]} </answer>", 1)]
        else:
            pieces = [(f"<answer> {rng.choice(pools[f.relation])} </answer>", 1)]
        response, mask = [], []
        for text, m in pieces:
            ids = encode(text)
            response += ids
            mask += [m] * len(ids)
        out.append(Demonstration(prompt, response, mask, searched))
    return out
