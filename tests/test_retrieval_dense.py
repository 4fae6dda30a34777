"""Dense retrieval: E5 pooling, flat faiss = brute-force inner product, HNSW recall, save/load.

The encoder is a tiny randomly initialised BERT with a WordPiece tokenizer trained here on
the test corpus, saved to a temporary directory: no download. Random weights make the
rankings meaningless as search, but every check below compares the index with numpy on the
very same vectors, which is what the index is responsible for.
"""

import json
import random
import sys

import faiss as _faiss  # noqa: F401  (the dev extra installs it: missing, this module fails, not skips)
import numpy as np
import pytest
import torch

from megarl.retrieval import Document, RetrievalError, build_index, load_index, write_jsonl_corpus
from megarl.retrieval.dense import import_faiss
from megarl.retrieval.encoder import E5Encoder, mean_pool_normalize

WORDS = (
    "river mountain city music science history ocean forest planet energy computer language "
    "football novel painter bridge island desert volcano garden market castle engine winter"
).split()


def make_corpus(n, seed=0):
    rng = random.Random(seed)
    return [
        Document(str(i), f'"{rng.choice(WORDS).title()} {i}"\n' + " ".join(rng.choices(WORDS, k=12)))
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-e5")
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(
        [d.contents for d in make_corpus(50)] + ["query: passage:"],
        trainers.WordPieceTrainer(vocab_size=300, special_tokens=specials),
    )
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)]
    )
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
        mask_token="[MASK]", model_max_length=64,
    ).save_pretrained(path)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64,
    )
    BertModel(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def encoder(encoder_dir):
    return E5Encoder(encoder_dir, max_length=64, batch_size=16, device="cpu")


def brute_force_topk(encoder, docs, queries, k):
    """Reference: every passage embedded, scores = Q · Pᵀ, top k by sorting."""
    scores = encoder.encode_queries(queries) @ encoder.encode_passages([d.contents for d in docs]).T
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return order, np.take_along_axis(scores, order, axis=1)


def test_mean_pooling_ignores_padding_and_normalises():
    hidden = torch.tensor([[[1.0, 0.0], [3.0, 0.0], [100.0, 100.0]], [[0.0, 3.0], [4.0, 0.0], [9.0, 9.0]]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    # row 0: mean of (1,0),(3,0) = (2,0) → (1,0); row 1: mean (2,1.5), norm 2.5 → (0.8,0.6)
    expected = torch.tensor([[1.0, 0.0], [0.8, 0.6]])
    torch.testing.assert_close(mean_pool_normalize(hidden, mask), expected)


def test_encoder_uses_e5_prefixes_and_unit_vectors(encoder):
    texts = ["river city", "ocean forest music science history"]
    queries = encoder.encode_queries(texts)
    np.testing.assert_allclose(queries, encoder.encode(["query: " + t for t in texts]), atol=1e-6)
    np.testing.assert_allclose(encoder.encode_passages(texts), encoder.encode(["passage: " + t for t in texts]))
    assert queries.dtype == np.float32 and queries.shape == (2, 32)
    np.testing.assert_allclose(np.linalg.norm(queries, axis=1), [1.0, 1.0], rtol=1e-5)
    # the short text embeds the same alone as next to a longer one (padding is masked out)
    np.testing.assert_allclose(encoder.encode_queries(texts[:1])[0], queries[0], atol=1e-5)


def test_flat_index_equals_brute_force_inner_product(encoder, encoder_dir, tmp_path):
    docs = make_corpus(80, seed=1)
    write_jsonl_corpus(tmp_path / "c.jsonl", docs)
    out = build_index(tmp_path / "c.jsonl", tmp_path / "idx", kind="dense", encoder=encoder_dir, max_length=64,
                      device="cpu", show_progress=False)
    retriever = load_index(out, device="cpu")
    queries = ["river mountain", "castle engine winter", "planet", "garden market island desert"]
    order, scores = brute_force_topk(encoder, docs, queries, k=5)
    results = retriever.search(queries, topk=5)
    for row, expected_positions, expected_scores in zip(results, order, scores):
        assert [hit.document for hit in row] == [docs[i] for i in expected_positions]
        np.testing.assert_allclose([hit.score for hit in row], expected_scores, rtol=1e-4, atol=1e-5)
    assert retriever.search(queries[:1], topk=2, return_scores=False) == [[docs[i] for i in order[0][:2]]]
    assert len(retriever.search(["river"], topk=500)[0]) == 80  # topk above the corpus size: all of it

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["kind"] == "dense" and manifest["num_docs"] == 80
    assert {k: manifest["dense"][k] for k in ("encoder", "dim", "index_type", "metric", "pooling")} == {
        "encoder": str(encoder_dir.resolve()), "dim": 32, "index_type": "flat", "metric": "inner_product",
        "pooling": "mean",
    }


def test_hnsw_recall_is_high(encoder, encoder_dir, tmp_path):
    docs = make_corpus(400, seed=2)
    write_jsonl_corpus(tmp_path / "c.jsonl", docs)
    out = build_index(tmp_path / "c.jsonl", tmp_path / "idx", kind="dense", encoder=encoder_dir, hnsw=True,
                      hnsw_m=16, max_length=64, device="cpu", show_progress=False)
    # the encoder override: an index can be served after its encoder moved
    retriever = load_index(out, encoder=encoder_dir, device="cpu")
    assert json.loads((out / "manifest.json").read_text())["dense"]["index_type"] == "hnsw"
    rng = random.Random(3)
    queries = [" ".join(rng.choices(WORDS, k=3)) for _ in range(30)]
    k = 10
    order, _ = brute_force_topk(encoder, docs, queries, k)
    found = retriever.search(queries, topk=k)
    recall = np.mean([
        len({hit.document.id for hit in row} & {docs[i].id for i in exact}) / k for row, exact in zip(found, order)
    ])
    assert recall >= 0.9


def test_dense_build_errors(encoder_dir, tmp_path):
    write_jsonl_corpus(tmp_path / "c.jsonl", make_corpus(3))
    with pytest.raises(RetrievalError, match="a dense index needs an encoder"):
        build_index(tmp_path / "c.jsonl", tmp_path / "a", kind="dense")
    with pytest.raises(FileNotFoundError, match="no config.json there"):
        build_index(tmp_path / "c.jsonl", tmp_path / "b", kind="dense", encoder=tmp_path)
    with pytest.raises(RetrievalError, match=r"unknown option\(s\) stemmer for a dense index"):
        build_index(tmp_path / "c.jsonl", tmp_path / "c", kind="dense", encoder=encoder_dir, stemmer="english")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]


def test_missing_faiss_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "faiss", None)  # makes `import faiss` fail
    with pytest.raises(RetrievalError, match=r"pip install 'megarl\[dense\]'"):
        import_faiss()


def flat_vectors(index_dir):
    faiss = import_faiss()
    index = faiss.read_index(str(index_dir / "dense" / "index.faiss"))
    return index.reconstruct_n(0, index.ntotal)


def test_sharded_build_equals_one_build(encoder, encoder_dir, tmp_path):
    docs = make_corpus(50, seed=3)
    write_jsonl_corpus(tmp_path / "c.jsonl", docs)
    common = dict(kind="dense", encoder=encoder_dir, max_length=64, device="cpu", show_progress=False)
    whole = build_index(tmp_path / "c.jsonl", tmp_path / "whole", **common)
    work = tmp_path / "work"
    for i in range(3):  # three jobs, each embedding every third shard of 8 documents
        assert build_index(tmp_path / "c.jsonl", tmp_path / "idx", work_dir=work, shard_docs=8, shard=(i, 3),
                           **common) is None
        assert not (tmp_path / "idx").exists()
    assert sorted(p.name for p in work.glob("shard-*.npy")) == [f"shard-{k:06d}.npy" for k in range(7)]
    merged = build_index(tmp_path / "c.jsonl", tmp_path / "idx", work_dir=work, shard_docs=8, **common)
    np.testing.assert_allclose(flat_vectors(merged), flat_vectors(whole), atol=1e-6)
    np.testing.assert_allclose(flat_vectors(merged)[9], encoder.encode_passages([docs[9].contents])[0], atol=1e-6)
    queries = ["river mountain", "castle"]
    assert load_index(merged, device="cpu").search(queries, topk=3) == load_index(whole, device="cpu").search(
        queries, topk=3)


def test_an_interrupted_build_resumes_from_its_last_whole_shard(encoder_dir, tmp_path, monkeypatch):
    docs = make_corpus(40, seed=4)
    write_jsonl_corpus(tmp_path / "c.jsonl", docs)
    common = dict(kind="dense", encoder=encoder_dir, max_length=64, device="cpu", show_progress=False,
                  work_dir=tmp_path / "work", shard_docs=10)
    calls = []
    original = E5Encoder.encode_passages

    def failing(self, texts):
        calls.append(len(texts))
        if len(calls) == 3:
            raise KeyboardInterrupt  # the job is stopped while embedding the third shard
        return original(self, texts)

    monkeypatch.setattr(E5Encoder, "encode_passages", failing)
    with pytest.raises(KeyboardInterrupt):
        build_index(tmp_path / "c.jsonl", tmp_path / "idx", **common)
    assert sorted(p.name for p in (tmp_path / "work").glob("shard-*")) == ["shard-000000.npy", "shard-000001.npy"]
    assert not (tmp_path / "idx").exists()
    calls.clear()
    monkeypatch.setattr(E5Encoder, "encode_passages", lambda self, texts: calls.append(len(texts)) or
                        original(self, texts))
    out = build_index(tmp_path / "c.jsonl", tmp_path / "idx", **common)
    assert calls == [10, 10]  # only shards 2 and 3 were embedded again
    reference = E5Encoder(encoder_dir, max_length=64, device="cpu").encode_passages([d.contents for d in docs])
    np.testing.assert_allclose(flat_vectors(out), reference, atol=1e-6)


def test_a_work_dir_of_another_build_is_refused(encoder_dir, tmp_path):
    write_jsonl_corpus(tmp_path / "c.jsonl", make_corpus(12))
    common = dict(kind="dense", encoder=encoder_dir, device="cpu", show_progress=False, work_dir=tmp_path / "w")
    build_index(tmp_path / "c.jsonl", tmp_path / "a", max_length=64, shard_docs=5, **common)
    with pytest.raises(RetrievalError, match="holds embeddings made with"):
        build_index(tmp_path / "c.jsonl", tmp_path / "b", max_length=32, shard_docs=5, **common)
    with pytest.raises(RetrievalError, match="needs a work_dir"):
        build_index(tmp_path / "c.jsonl", tmp_path / "c", kind="dense", encoder=encoder_dir, device="cpu",
                    show_progress=False, shard=(0, 2))


def test_memory_needed_for_wiki18():
    from megarl.retrieval.dense import memory_needed

    assert memory_needed(21_015_324, 768) == 21_015_324 * 768 * 4  # 64.6 GB of float32 vectors
    assert memory_needed(21_015_324, 768, hnsw=True, hnsw_m=32) == 21_015_324 * (768 * 4 + 64 * 4)


def test_sharded_build_from_the_command_line(encoder_dir, tmp_path, capsys):
    from megarl.cli import main

    write_jsonl_corpus(tmp_path / "c.jsonl", make_corpus(30))
    base = ["retrieval", "build", "--corpus", str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "idx"), "--kind",
            "dense", "--encoder", str(encoder_dir), "--device", "cpu", "--max-length", "64", "--shard-docs", "10",
            "--quiet"]
    assert main(base + ["--shard", "2/1"]) == 2 and "use I/N" in capsys.readouterr().err
    for i in (0, 1):
        assert main(base + ["--shard", f"{i}/2"]) == 0
        assert "run the same command without --shard" in capsys.readouterr().err
    assert len(list((tmp_path / "idx.embeddings").glob("shard-*.npy"))) == 3
    assert main(base) == 0 and "index written" in capsys.readouterr().err
    assert load_index(tmp_path / "idx", device="cpu").search(["river"], topk=2)
    assert not (tmp_path / "idx.embeddings").exists()  # kept only for resuming, removed once the index is whole
