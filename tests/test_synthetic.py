"""The synthetic search world: real formats, answers only findable by searching."""

from megarl.data.prompts import load_prompts
from megarl.retrieval import build_index, load_index
from megarl.retrieval.corpus import iter_corpus
from megarl.reward import compute_score
from megarl.synthetic import make_facts, write_search_world
from tiny_models import tiny_tokenizer


def test_world_files_and_searchability(tmp_path):
    paths = write_search_world(tmp_path, num_entities=30, seed=4)
    docs = list(iter_corpus(paths["corpus"]))
    assert len(docs) == 30 and docs[0].contents.startswith('"')
    train, _ = load_prompts([str(paths["train"])], tiny_tokenizer(), max_prompt_length=10_000)
    val, _ = load_prompts([str(paths["val"])], tiny_tokenizer(), max_prompt_length=10_000)
    assert len(train) + len(val) == 90 and len(val) == 9
    build_index(paths["corpus"], tmp_path / "index", kind="bm25", show_progress=False)
    index = load_index(tmp_path / "index")
    for record in train[:20]:
        entity = record.extra_info["entity"]
        answer = record.ground_truth["target"][0]
        top = index.search([record.extra_info["question"]], topk=3, return_scores=False)[0]
        assert any(entity in d.contents and answer in d.contents for d in top)  # searching finds the answer
        # the reward routes by data_source to Search-R1 exact match
        assert compute_score(record.data_source, f"<answer> {answer} </answer>", record.ground_truth)["score"] == 1.0


def test_seeded_and_distinct():
    assert make_facts(10, seed=1) == make_facts(10, seed=1)
    facts = make_facts(50, seed=2)
    names = {f.entity for f in facts} | {f.answer for f in facts}
    assert len(names) == 50 + len(facts)  # every entity and answer is a different invented name
