"""The synthetic worlds of the CPU quickstarts and tests: a "search world" and sums to answer.

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
fraction of the trajectories search; the rest answer with a guess. The arithmetic world
(`write_arithmetic_world`, `arithmetic_examples`) is every sum a + b up to max_operand in the
DAPO-Math prompt and "Answer:" format, with demonstrations right only some of the time.
Everything is seeded. Main entry points: `write_search_world`, `warmup_examples`.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from megarl.data.prepare import DAPO_MATH_INSTRUCTION, MATH_DATA_SOURCE, write_rows
from megarl.retrieval.corpus import corpus_info
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
    corpus = corpus_info(paths["corpus"])  # recorded in the questions' files: a run checks its index against it
    write_rows([question_row(f, k, "train") for k, f in enumerate(train)], paths["train"], corpus=corpus)
    write_rows([question_row(f, k, "test") for k, f in enumerate(val)], paths["val"], corpus=corpus)
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
    searched: bool = False


THINKING = ("so the question asks about this one and that one let me check what is known first then answer "
            "it well").split()


def thinking(rng: random.Random, median: int, sigma: float, most: int) -> str:
    """A reasoning section of log-normally many words (median `median`, at most `most`): the
    long tail of reasoning lengths that RL runs see, for a model to learn."""
    words = min(most, max(1, round(median * math.exp(sigma * rng.gauss(0, 1)))))
    return "<think> " + " ".join(rng.choice(THINKING) for _ in range(words)) + " </think> "


def warmup_examples(facts: list[Fact], tokenizer, search_fraction: float, seed: int, topk: int = 1,
                    bare_question: bool = False, repeats: int = 1,
                    think: tuple[int, float, int] = (0, 1.0, 0)) -> list[Demonstration]:
    """`repeats` demonstrations per (entity, relation) of `facts`, each with answers drawn afresh from
    the relation's pool, so the warm-up teaches reading the observation, not memorising the
    world. With probability search_fraction it searches for "{entity} {keyword}", reads the
    passages the index returns for that query (the fact first, then the entity's other
    facts, topk in all) and answers from them; otherwise it answers at once with a guess.
    bare_question: the prompt is only the instruction's last line, "Question: ...\\n" (short
    sequences, for the first phase of a warm-up curriculum). think = (median, sigma, most): each
    turn starts with a `thinking` section of that many words (median 0: none)."""
    from megarl.retrieval.client import SearchResult
    from megarl.retrieval.documents import Document

    rng = random.Random(seed)
    pools = answer_pools(facts)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    thinker = random.Random(f"think {seed}")  # its own draws: the actions and answers stay as without it

    def thought() -> str:
        return thinking(thinker, *think) if think[0] else ""

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
            pieces = [(f"{thought()}<search> {query} </search>", 1),
                      (format_observation(SearchResult(docs=docs)), 0),
                      (f"{thought()}<answer> {drawn[f.relation]} </answer>", 1)]
        else:
            pieces = [(f"{thought()}<answer> {rng.choice(pools[f.relation])} </answer>", 1)]
        response, mask = [], []
        for text, m in pieces:
            ids = encode(text)
            response += ids
            mask += [m] * len(ids)
        out.append(Demonstration(prompt, response, mask, searched))
    return out


# ---- single-turn arithmetic for DAPO (the DAPO-Math prompt and "Answer:" format) ----
@dataclass(frozen=True)
class Sum:
    a: int
    b: int

    @property
    def problem(self) -> str:
        return f"What is {self.a} + {self.b}?"

    @property
    def answer(self) -> int:
        return self.a + self.b


def math_row(item: Sum, index: int, split: str) -> dict:
    """A row as DAPO-Math-17k stores it: chat prompt, data_source routed to the DAPO math reward."""
    return {"data_source": MATH_DATA_SOURCE,
            "prompt": [{"role": "user", "content": DAPO_MATH_INSTRUCTION.format(problem=item.problem)}],
            "ability": "MATH",
            "reward_model": {"style": "rule", "ground_truth": str(item.answer)},
            "extra_info": {"split": split, "index": index, "a": item.a, "b": item.b}}


def write_arithmetic_world(out_dir: str | Path, max_operand: int = 9, num_val: int = 30,
                           seed: int = 0) -> dict[str, Path]:
    """train.parquet with every sum a + b for 0 <= a, b <= max_operand, and val.parquet with
    num_val of them (validation measures how reliably the policy answers problems it was
    trained on: the run shows DAPO sharpening a noisy policy, not generalisation)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    items = [Sum(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    val = random.Random(seed).sample(items, min(num_val, len(items)))
    paths = {"train": out / "train.parquet", "val": out / "val.parquet"}
    pq.write_table(pa.Table.from_pylist([math_row(x, i, "train") for i, x in enumerate(items)]), paths["train"])
    pq.write_table(pa.Table.from_pylist([math_row(x, i, "test") for i, x in enumerate(val)]), paths["val"])
    return paths


def read_sums(parquet_path: str | Path) -> list[Sum]:
    return [Sum(r["extra_info"]["a"], r["extra_info"]["b"]) for r in pq.read_table(parquet_path).to_pylist()]


def arithmetic_examples(items: list[Sum], tokenizer, correct_fraction: float, seed: int,
                        repeats: int = 1, bare_problem: bool = False) -> list[Demonstration]:
    """Demonstrations "a + b = c\\nAnswer: c" (EOS-terminated) in which c is right with
    probability correct_fraction and otherwise off by 1 to 3: a noisy policy for DAPO to sharpen.
    bare_problem: the prompt is only the problem (first phase of a warm-up curriculum)."""
    rng = random.Random(seed)
    out = []
    for item in [x for _ in range(repeats) for x in items]:
        right = rng.random() < correct_fraction
        c = item.answer if right else item.answer + rng.choice([o for o in (-3, -2, -1, 1, 2, 3) if item.answer + o >= 0])
        text = item.problem if bare_problem else DAPO_MATH_INSTRUCTION.format(problem=item.problem)
        prompt = tokenizer.encode(text, add_special_tokens=False)
        response = tokenizer.encode(f"{item.a} + {item.b} = {c}\nAnswer: {c}", add_special_tokens=False)
        response.append(tokenizer.eos_token_id)
        out.append(Demonstration(prompt, response, [1] * len(response)))
    return out
