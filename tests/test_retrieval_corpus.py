"""Corpus rows, Search-R1's document rendering and the memory-mapped document store."""

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megarl.retrieval import CorpusError, Document, Hit, format_documents, iter_corpus, split_title_text
from megarl.retrieval.corpus import file_sha256, write_jsonl_corpus
from megarl.retrieval.docstore import DocStore, DocStoreWriter

ROWS = [
    {"id": "0", "contents": '"Paris"\nParis is the capital of France.'},
    {"id": "1", "contents": '"Berlin"\nBerlin is the capital of Germany.\nIt is large.'},
    {"id": "2", "contents": "no title line"},
]
DOCS = [Document(r["id"], r["contents"]) for r in ROWS]


@pytest.mark.parametrize(
    "contents, title, text",
    [
        ('"Paris"\nParis is the capital of France.', "Paris", "Paris is the capital of France."),
        ('"Berlin"\nline one\nline two', "Berlin", "line one\nline two"),  # only the first line is the title
        ("Title without quotes\ntext", "Title without quotes", "text"),
        ('"Empty text"\n', "Empty text", ""),
        ("no newline at all", "", "no newline at all"),
    ],
)
def test_split_title_text(contents, title, text):
    assert split_title_text(contents) == (title, text)
    assert (Document("x", contents).title, Document("x", contents).text) == (title, text)


def test_format_documents_is_search_r1s_rendering():
    # Search-R1: title = contents.split("\n")[0] (quotes kept), text = the rest joined by
    # "\n", f"Doc {i+1}(Title: {title}) {text}\n" per document, concatenated.
    expected = (
        'Doc 1(Title: "Paris") Paris is the capital of France.\n'
        'Doc 2(Title: "Berlin") Berlin is the capital of Germany.\nIt is large.\n'
        "Doc 3(Title: no title line) \n"
    )
    assert format_documents(DOCS) == expected
    # the same from Hits, corpus dicts and the API's scored items
    assert format_documents([Hit(d, 1.0) for d in DOCS]) == expected
    assert format_documents(ROWS) == expected
    assert format_documents([{"document": r, "score": 0.5} for r in ROWS]) == expected
    assert format_documents([]) == ""


def test_format_documents_rejects_what_it_cannot_read():
    with pytest.raises(TypeError, match="cannot read the contents"):
        format_documents([{"id": "0", "text": "no contents"}])


def test_jsonl_parquet_and_gzip_give_the_same_documents(tmp_path):
    write_jsonl_corpus(tmp_path / "c.jsonl", ROWS)
    with gzip.open(tmp_path / "c.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in ROWS))
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "c.parquet")
    for name in ("c.jsonl", "c.jsonl.gz", "c.parquet"):
        assert list(iter_corpus(tmp_path / name)) == DOCS, name


def test_integer_ids_become_strings_and_extra_fields_are_ignored(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"id": 7, "contents": "\\"T\\"\\nx", "title": "T"}\n\n{"id": "8", "contents": ""}\n')
    assert list(iter_corpus(path)) == [Document("7", '"T"\nx'), Document("8", "")]  # blank line skipped
    pq.write_table(pa.table({"id": [7, 8], "contents": ["a", "b"], "extra": [1, 2]}), tmp_path / "c.parquet")
    assert list(iter_corpus(tmp_path / "c.parquet")) == [Document("7", "a"), Document("8", "b")]


GOOD = '{"id": "0", "contents": "ok"}'


@pytest.mark.parametrize(
    "lines, row, problem",
    [
        ([GOOD, '{"id": "1", "contents": "x"'], 2, "is not valid JSON"),
        ([GOOD, "", '["a", "b"]'], 3, "is a JSON list, not an object"),  # the blank line 2 still counts
        (['{"contents": "x"}'], 1, "has no 'id' field"),
        (['{"id": "1"}'], 1, "has no 'contents' field"),
        (['{"id": "1", "title": "T", "text": "x"}'], 1, "'title'/'text' corpus must be converted"),
        (['{"id": "1", "contents": null}'], 1, "'contents' of type null"),
        (['{"id": "1", "contents": ["x"]}'], 1, "'contents' of type list"),
        (['{"id": true, "contents": "x"}'], 1, "'id' of type bool"),
        (['{"id": 1.5, "contents": "x"}'], 1, "'id' of type float"),
    ],
)
def test_malformed_jsonl_rows_are_reported_with_file_and_row(tmp_path, lines, row, problem):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(CorpusError) as err:
        list(iter_corpus(path))
    message = str(err.value)
    assert f"corpus {path}, row {row}: the row " in message
    assert problem in message
    assert '{"id": "0", "contents":' in message  # and what a row should look like


def test_invalid_utf8_is_reported_with_its_row(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(GOOD.encode() + b'\n{"id": "1", "contents": "\xff"}\n')
    with pytest.raises(CorpusError, match="row 2: the row is not valid UTF-8"):
        list(iter_corpus(path))


def test_parquet_problems(tmp_path):
    pq.write_table(pa.table({"id": ["0"], "text": ["x"]}), tmp_path / "cols.parquet")
    with pytest.raises(CorpusError, match=r"missing column\(s\) contents \(has id, text\)"):
        list(iter_corpus(tmp_path / "cols.parquet"))
    pq.write_table(pa.table({"id": ["0", "1", None], "contents": ["a", "b", "c"]}), tmp_path / "null.parquet")
    with pytest.raises(CorpusError, match="row 3: the row has an 'id' of type null"):
        list(iter_corpus(tmp_path / "null.parquet"))
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(CorpusError, match="cannot be read as parquet"):
        list(iter_corpus(tmp_path / "junk.parquet"))


def test_unknown_type_and_missing_file(tmp_path):
    with pytest.raises(CorpusError, match=r"unknown file type; use one of .jsonl, .jsonl.gz, .parquet"):
        list(iter_corpus(tmp_path / "corpus.csv"))
    with pytest.raises(CorpusError, match="no such file"):
        list(iter_corpus(tmp_path / "absent.jsonl"))


def test_file_sha256(tmp_path):
    (tmp_path / "f").write_bytes(b"abc")
    # SHA-256("abc"), the FIPS 180-2 test vector
    assert file_sha256(tmp_path / "f") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


def test_docstore_round_trip_by_position(tmp_path):
    writer = DocStoreWriter(tmp_path)
    assert list(writer.tee(iter(DOCS))) == DOCS
    writer.close()
    store = DocStore.open(tmp_path)
    assert len(store) == 3
    assert [store[i] for i in (2, 0, 1)] == [DOCS[2], DOCS[0], DOCS[1]]
    with pytest.raises(IndexError, match="document 3 out of range"):
        store[3]
    # the stored documents are themselves a corpus
    assert list(iter_corpus(tmp_path / "documents.jsonl")) == DOCS
    # -1 (faiss padding) is dropped; scores become floats
    assert store.collect([[1, -1, 0]], [[2.0, 0.0, 1.0]], True) == [[Hit(DOCS[1], 2.0), Hit(DOCS[0], 1.0)]]
    assert store.collect([[1]], [[2.0]], False) == [[DOCS[1]]]
