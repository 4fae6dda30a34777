"""BM25 index: build → save → memory-mapped load → batched search, with scores worked out by hand.

bm25s' "lucene" BM25 (Pyserini's, which Search-R1 used), k1 = 1.5, b = 0.75:
    score(q, d) = Σ_{t ∈ q} idf(t) · tf / (tf + k1 · (1 − b + b · |d| / avgdl))
    idf(t) = ln(1 + (N − df + 0.5) / (df + 0.5))
The corpus below has N = 3 documents of 4 indexed tokens each once stopwords ("is", "the",
"of", "on") are gone: avgdl = 4, so the length factor is 1 and tf = 1 gives 1 / 2.5 = 0.4.
    idf(df=1) = ln(8/3) = 0.980829      idf(df=2) = ln(1.6) = 0.470004
"""

import json
import math

import numpy as np
import pytest

from megarl.retrieval import (
    CorpusError,
    Document,
    Hit,
    IndexExistsError,
    IndexFormatError,
    RetrievalError,
    build_index,
    load_index,
    write_jsonl_corpus,
)
from megarl.retrieval.corpus import file_sha256

PARIS = Document("0", '"Paris"\nParis is the capital of France.')  # paris ×2, capital, france
BERLIN = Document("1", '"Berlin"\nBerlin is the capital of Germany.')  # berlin ×2, capital, germany
CAT = Document("2", '"Cat"\nThe cat sat on the mat.')  # cat ×2, sat, mat
IDF1, IDF2 = math.log(8 / 3), math.log(1.6)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_jsonl_corpus(tmp_path_factory.mktemp("corpus") / "corpus.jsonl", [PARIS, BERLIN, CAT])


@pytest.fixture(scope="module")
def index_dir(corpus, tmp_path_factory):
    return build_index(corpus, tmp_path_factory.mktemp("indexes") / "bm25", show_progress=False)


@pytest.fixture(scope="module")
def retriever(index_dir):
    return load_index(index_dir)


@pytest.mark.parametrize(
    "query, expected",
    [
        ("mat", [(CAT, IDF1 * 0.4)]),  # the only document with "mat"
        ("Germany", [(BERLIN, IDF1 * 0.4)]),  # case-insensitive
        ("cat", [(CAT, IDF1 * 2 / 3.5)]),  # tf = 2: 2 / (2 + 1.5)
        ("capital of germany", [(BERLIN, (IDF2 + IDF1) * 0.4), (PARIS, IDF2 * 0.4)]),
        ("capital", [(PARIS, IDF2 * 0.4), (BERLIN, IDF2 * 0.4)]),  # a tie: both, topk 3 > 2 matches
        ("the of is on", []),  # only stopwords: no document shares a term, none is returned
        ("zebra", []),  # a term the corpus does not have
        ("", []),
    ],
)
def test_search_scores_are_bm25_by_hand(retriever, query, expected):
    [hits] = retriever.search([query], topk=3)
    assert all(isinstance(hit, Hit) for hit in hits)
    if query == "capital":  # equal scores: either order is right
        hits = sorted(hits, key=lambda hit: hit.document.id)
    assert [doc for doc, _ in hits] == [doc for doc, _ in expected]
    assert [score for _, score in hits] == pytest.approx([score for _, score in expected], rel=1e-5)


def test_a_batch_keeps_query_order_and_topk_cuts(retriever):
    results = retriever.search(["mat", "capital of germany", "zebra"], topk=1)
    assert [[hit.document.id for hit in row] for row in results] == [["2"], ["1"], []]
    assert retriever.search([], topk=3) == []


def test_without_scores_documents_come_back(retriever):
    assert retriever.search(["capital of germany"], topk=2, return_scores=False) == [[BERLIN, PARIS]]


def test_topk_larger_than_the_corpus_is_fine(retriever):
    [hits] = retriever.search(["capital paris"], topk=50)
    assert [hit.document for hit in hits] == [PARIS, BERLIN]


@pytest.mark.parametrize(
    "queries, topk, message",
    [("mat", 3, "list of strings"), (["mat", 3], 3, r"queries\[1\] must be a string"), (["mat"], 0, "topk")],
)
def test_bad_search_arguments(retriever, queries, topk, message):
    with pytest.raises(ValueError, match=message):
        retriever.search(queries, topk)


def test_queries_are_tokenised_like_the_corpus(retriever):
    assert retriever.tokenize(["The CATS sat on a mat-2!"]) == [["cats", "sat", "mat"]]


def test_index_directory_and_manifest(index_dir, corpus, retriever):
    names = {p.relative_to(index_dir).as_posix() for p in index_dir.rglob("*")}
    assert {"manifest.json", "documents.jsonl", "documents.offsets.npy", "bm25/data.csc.index.npy"} <= names
    manifest = json.loads((index_dir / "manifest.json").read_text())
    assert manifest["format"] == "megarl-retrieval-index" and manifest["format_version"] == 1
    assert manifest["kind"] == "bm25" and manifest["num_docs"] == 3
    assert manifest["corpus"] == {
        "path": str(corpus.resolve()),
        "bytes": corpus.stat().st_size,
        "sha256": file_sha256(corpus),
    }
    # "" (the empty-query token) + paris capital france berlin germany cat sat mat
    assert manifest["bm25"] | {"bm25s_version": None} == {
        "k1": 1.5, "b": 0.75, "method": "lucene", "stopwords": "en", "stemmer": None,
        "vocab_size": 9, "bm25s_version": None,
    }
    # opened memory-mapped: the score arrays are views of the files, not copies
    assert isinstance(retriever.model.scores["data"], np.memmap)
    assert len(retriever) == 3 and retriever.kind == "bm25"


def test_in_memory_load_gives_the_same_results(index_dir, retriever):
    in_memory = load_index(index_dir, mmap=False)
    assert not isinstance(in_memory.model.scores["data"], np.memmap)
    queries = ["capital of germany", "cat", "paris france"]
    assert in_memory.search(queries, 3) == retriever.search(queries, 3)


def test_a_word_found_in_one_document_ranks_it_first(tmp_path):
    # 200 filler documents sharing common words; the rare word is in document 137 only
    rows = [Document(str(i), f'"Doc {i}"\nalpha beta gamma delta number{i % 7}') for i in range(200)]
    rows[137] = Document("137", '"Doc 137"\nalpha beta gamma delta xylophone')
    write_jsonl_corpus(tmp_path / "c.jsonl", rows)
    retriever = load_index(build_index(tmp_path / "c.jsonl", tmp_path / "idx", show_progress=False))
    [hits] = retriever.search(["alpha xylophone beta"], topk=3)
    assert hits[0].document == rows[137]
    assert hits[0].score > hits[1].score


def test_an_existing_index_is_kept_unless_overwrite(corpus, tmp_path):
    out = tmp_path / "idx"
    out.mkdir()  # an empty directory is fine to build into
    build_index(corpus, out, show_progress=False)
    with pytest.raises(IndexExistsError, match="is not empty; pass --overwrite"):
        build_index(corpus, out, show_progress=False)
    write_jsonl_corpus(tmp_path / "one.jsonl", [CAT])
    build_index(tmp_path / "one.jsonl", out, overwrite=True, show_progress=False)
    assert len(load_index(out)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["idx", "one.jsonl"]  # no temporary leftovers


def test_a_failed_build_leaves_nothing_behind(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"id": "0", "contents": "ok"}\n{"id": "1", "contents": "ok"}\n{"id": "2"}\n')
    with pytest.raises(CorpusError, match="row 3"):
        build_index(path, tmp_path / "idx", show_progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]


def test_build_refuses_bad_input_before_any_work(corpus, tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(CorpusError, match="no rows"):
        build_index(tmp_path / "empty.jsonl", tmp_path / "a", show_progress=False)
    with pytest.raises(RetrievalError, match="unknown index kind 'sparse'"):
        build_index(corpus, tmp_path / "b", kind="sparse")
    with pytest.raises(RetrievalError, match=r"unknown option\(s\) hnsw for a bm25 index; it takes stemmer"):
        build_index(corpus, tmp_path / "c", hnsw=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(IndexExistsError, match="is a file"):
        build_index(corpus, tmp_path / "file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.jsonl", "file"]


def test_stemming_needs_pystemmer(corpus, tmp_path):
    try:
        import Stemmer  # noqa: F401
    except ImportError:
        with pytest.raises(RetrievalError, match="pip install PyStemmer"):
            build_index(corpus, tmp_path / "idx", stemmer="english")
    else:
        retriever = load_index(build_index(corpus, tmp_path / "idx", stemmer="english", show_progress=False))
        assert retriever.search(["capitals"], 3)[0][0].document in (PARIS, BERLIN)


def test_load_errors_say_what_is_wrong(index_dir, tmp_path):
    with pytest.raises(IndexFormatError, match="no such directory"):
        load_index(tmp_path / "absent")
    with pytest.raises(IndexFormatError, match="no manifest.json"):
        load_index(tmp_path)
    manifest = json.loads((index_dir / "manifest.json").read_text())
    changes = [({"format_version": 99}, "format version 99"), ({"kind": "sparse"}, "unknown or incomplete")]
    for change, message in changes:
        (tmp_path / "manifest.json").write_text(json.dumps(manifest | change))
        with pytest.raises(IndexFormatError, match=message):
            load_index(tmp_path)
