"""The synthetic search world and its warm-up demonstrations: real formats, the agent's token
layout, answers only findable by searching."""

import collections
import re

from megarl.data.prompts import load_prompts
from megarl.retrieval import build_index, load_index
from megarl.retrieval.corpus import iter_corpus
from megarl.quickstart.worlds import (RELATIONS, arithmetic_examples, make_facts, question, read_facts,
                                     read_sums, search_query, warmup_examples, write_arithmetic_world,
                                     write_search_world)
from megarl.reward import compute_score
from megarl.rollout.agent import SEARCH_INSTRUCTION, build_search_prompt
from tiny_models import tiny_tokenizer


def test_world_files_and_searchability(tmp_path):
    paths = write_search_world(tmp_path, num_entities=30, seed=4)
    docs = list(iter_corpus(paths["corpus"]))
    assert len(docs) == 30 * len(RELATIONS) and docs[0].contents.startswith('"')
    train, _ = load_prompts([str(paths["train"])], tiny_tokenizer(), max_prompt_length=10_000)
    val, _ = load_prompts([str(paths["val"])], tiny_tokenizer(), max_prompt_length=10_000)
    assert len(train) + len(val) == 90 and len(val) == 9
    build_index(paths["corpus"], tmp_path / "index", kind="bm25", show_progress=False)
    index = load_index(tmp_path / "index")
    for record, fact in zip(train, read_facts(paths["train"])):
        answer = record.ground_truth["target"][0]
        assert answer == fact.answer and record.extra_info["question"] == question(fact)
        (top,) = index.search([search_query(fact)], topk=1, return_scores=False)[0]  # the good query finds the fact
        assert top.contents == f'"{fact.entity}"\n' + RELATIONS[fact.relation][1].format(e=fact.entity, a=answer)
        # the reward routes by data_source to Search-R1 exact match
        assert compute_score(record.data_source, f"<answer> {answer} </answer>", record.ground_truth)["score"] == 1.0


def test_validation_asks_new_facts_about_known_entities(tmp_path):
    paths = write_search_world(tmp_path, num_entities=40, seed=1)
    train, val = read_facts(paths["train"]), read_facts(paths["val"])
    assert not set(train) & set(val)
    assert {f.entity for f in val} <= {f.entity for f in train}


def test_seeded_distinct_names_and_separate_answer_pools():
    assert make_facts(10, seed=1) == make_facts(10, seed=1)
    facts = make_facts(50, seed=2, answers_per_relation=8)
    entities = {f.entity for f in facts}
    pools = {r: {f.answer for f in facts if f.relation == r} for r in RELATIONS}
    assert len(entities) == 50 and all(len(p) <= 8 for p in pools.values())
    assert sum(len(p) for p in pools.values()) == len(set().union(*pools.values()))  # pools are disjoint
    assert not entities & set().union(*pools.values())


def test_demonstrations_use_the_agents_token_layout():
    tok = tiny_tokenizer(600)
    facts = make_facts(6, seed=3)
    demos = warmup_examples(facts, tok, search_fraction=1.0, seed=0, topk=2, repeats=2)
    assert len(demos) == 2 * len(facts)
    for demo, fact in zip(demos, facts + facts):
        # the prompt is what the trainer feeds (build_search_prompt, as load_prompts renders it)
        assert demo.prompt_ids == build_search_prompt(tok, question(fact))
        text = tok.decode(demo.response_ids)
        m = re.fullmatch(r"<search> (.+) </search>\n\n<information>Doc 1\(Title: \"(\w+)\"\) (.+)\n"
                         r"Doc 2\(Title: \"(\w+)\"\) .+</information>\n\n<answer> (\w+) </answer>", text, re.S)
        assert m, text
        assert m[1] == search_query(fact) and m[2] == m[4] == fact.entity
        assert m[3] == RELATIONS[fact.relation][1].format(e=fact.entity, a=m[5])  # the answer is read, not known
        observation = [t for t, keep in zip(demo.response_ids, demo.loss_mask) if not keep]
        assert tok.decode(observation) == text[text.index("\n\n<information>"): text.index("<answer>")]
    # answers are drawn afresh on each repeat, from the relation's pool
    answers = collections.defaultdict(set)
    for demo, fact in zip(demos, facts + facts):
        answers[fact].add(tok.decode(demo.response_ids).rsplit("<answer> ", 1)[1])
    assert any(len(a) > 1 for a in answers.values())


def test_guessing_demonstrations_and_the_bare_prompt():
    tok = tiny_tokenizer(600)
    facts = make_facts(40, seed=5)
    demos = warmup_examples(facts, tok, search_fraction=0.25, seed=1, bare_question=True)
    searched = sum(d.searched for d in demos)
    assert 10 <= searched <= 50  # 120 demonstrations at p = 0.25: 30 expected
    for demo, fact in zip(demos, facts):
        assert tok.decode(demo.prompt_ids) == f"Question: {question(fact)}\n"
        assert SEARCH_INSTRUCTION.format(question=question(fact)).endswith(tok.decode(demo.prompt_ids))
        if not demo.searched:
            guess = re.fullmatch(r"<answer> (\w+) </answer>", tok.decode(demo.response_ids))[1]
            assert guess in {f.answer for f in facts if f.relation == fact.relation}
            assert demo.loss_mask == [1] * len(demo.response_ids)


def test_arithmetic_rows_and_noisy_demonstrations(tmp_path):
    paths = write_arithmetic_world(tmp_path, max_operand=4, num_val=6, seed=2)
    train, val = read_sums(paths["train"]), read_sums(paths["val"])
    assert sorted((x.a, x.b) for x in train) == [(a, b) for a in range(5) for b in range(5)]
    assert len(val) == 6 and set(val) <= set(train)
    records, _ = load_prompts([str(paths["train"])], tiny_tokenizer(), max_prompt_length=10_000)
    for record, item in zip(records, train):
        assert record.data_source == "math_dapo" and record.ground_truth == str(item.a + item.b)
        assert compute_score(record.data_source, f"so\nAnswer: {item.a + item.b}", record.ground_truth)["score"] == 1.0
    tok = tiny_tokenizer(600)
    demos = arithmetic_examples(train, tok, correct_fraction=0.3, seed=0, repeats=8)
    right = 0
    for demo, item in zip(demos, train * 8):
        assert demo.response_ids[-1] == tok.eos_token_id
        m = re.fullmatch(r"(\d+) \+ (\d+) = (\d+)\nAnswer: (\d+)", tok.decode(demo.response_ids[:-1]))
        assert (int(m[1]), int(m[2])) == (item.a, item.b) and m[3] == m[4]
        assert 0 <= int(m[4]) and abs(int(m[4]) - item.answer) <= 3
        right += int(m[4]) == item.answer
    assert 30 <= right <= 90  # 200 demonstrations at p = 0.3: 60 expected
