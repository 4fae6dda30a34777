"""`retrieval build` / `retrieval serve` as added to a command line by add_retrieval_commands."""

import argparse

import pytest

from megarl.retrieval import Document, load_index, write_jsonl_corpus
from megarl.retrieval.commands import add_retrieval_commands


def parse(argv):
    parser = argparse.ArgumentParser(prog="megarl")
    add_retrieval_commands(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


@pytest.fixture
def corpus(tmp_path):
    return write_jsonl_corpus(tmp_path / "c.jsonl", [Document("0", '"Cat"\nThe cat sat.'), Document("1", "dog")])


def test_build_then_refuse_to_overwrite(corpus, tmp_path, capsys):
    out = tmp_path / "idx"
    args = parse(["retrieval", "build", "--corpus", str(corpus), "--out", str(out), "--quiet"])
    assert args.func(args) == 0
    assert load_index(out).search(["cat"], 3)[0][0].document.id == "0"
    assert "bm25 index written to" in capsys.readouterr().err

    assert args.func(args) == 2
    assert f"megarl retrieval build: output directory {out} is not empty; pass --overwrite" in capsys.readouterr().err
    args = parse(["retrieval", "build", "--corpus", str(corpus), "--out", str(out), "--quiet", "--overwrite"])
    assert args.func(args) == 0


def test_build_reports_a_bad_corpus_without_a_traceback(tmp_path, capsys):
    (tmp_path / "bad.jsonl").write_text('{"id": "0"}\n')
    args = parse(["retrieval", "build", "--corpus", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "i")])
    assert args.func(args) == 2
    assert "row 1: the row has no 'contents' field" in capsys.readouterr().err


def test_build_options_reach_the_builder():
    args = parse(["retrieval", "build", "--corpus", "c.jsonl", "--out", "o", "--kind", "dense",
                  "--encoder", "e5", "--hnsw"])
    assert (args.kind, args.encoder, args.hnsw, args.hnsw_m) == ("dense", "e5", True, 32)
    with pytest.raises(SystemExit):
        parse(["retrieval", "build", "--corpus", "c.jsonl", "--out", "o", "--kind", "sparse"])


def test_serve_loads_the_index_and_serves_it_on_localhost(corpus, tmp_path, monkeypatch):
    out = tmp_path / "idx"
    args = parse(["retrieval", "build", "--corpus", str(corpus), "--out", str(out), "--quiet"])
    args.func(args)
    served = {}
    monkeypatch.setattr("megarl.retrieval.server.serve", lambda retriever, **kw: served.update(kw, n=len(retriever)))
    monkeypatch.delenv("MEGARL_RETRIEVAL_API_KEY", raising=False)
    args = parse(["retrieval", "serve", "--index", str(out)])
    assert args.func(args) == 0
    assert served == {"host": "127.0.0.1", "port": 8000, "default_topk": 3, "max_topk": 100, "max_queries": 4096,
                      "api_key": None, "allow_unauthenticated": False, "n": 2}


def test_serve_errors(tmp_path, capsys):
    args = parse(["retrieval", "serve", "--index", str(tmp_path / "none")])
    assert args.func(args) == 2
    assert "megarl retrieval serve: index" in capsys.readouterr().err
    args = parse(["retrieval", "serve", "--index", str(tmp_path), "--topk", "0"])
    assert args.func(args) == 2
    assert "--topk 0 must be between 1 and --max-topk 100" in capsys.readouterr().err
