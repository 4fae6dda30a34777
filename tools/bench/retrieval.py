"""Benchmark: batched top-k BM25 with megarl's index (bm25s) against rank_bm25's BM25Okapi.

    python tools/bench/retrieval.py [--docs 100000 --queries 1000 --topk 3 --baseline-queries 100]

Runs offline on a seeded synthetic corpus: a Zipf-distributed vocabulary of made-up words,
passages of about 100 words (wiki-18's length) with a two-word title line, and queries of
3-6 words taken from a random passage. megarl's index is built, saved and loaded
(memory-mapped) through the public API, then searched in batches; rank_bm25, the common
pure-Python alternative, scores every document per query in Python, so by default it is
timed on a subset of the queries (said in the output), the same for both, under the bench
protocol (protocol.py), each with its query tokenisation. Both see the same tokens. Top-1
agreement is reported, not asserted: the two implement slightly different BM25 variants
(Lucene's idf vs Okapi's idf with an epsilon floor for common words).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from megarl.versions import installed_versions

sys.path.insert(0, str(Path(__file__).resolve().parent))
from protocol import compare  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=100_000, help="synthetic passages (default 100,000)")
    parser.add_argument("--queries", type=int, default=1_000, help="queries for megarl (default 1,000)")
    parser.add_argument("--topk", type=int, default=3, help="documents per query (default 3)")
    parser.add_argument("--batch-size", type=int, default=256, help="queries per megarl search call (default 256)")
    parser.add_argument(
        "--baseline-queries", type=int, default=100,
        help="queries timed on both, the first N of the queries (default 100; 0 = all)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each (alternating), after a warm-up")
    parser.add_argument("--vocab", type=int, default=50_000, help="distinct synthetic words (default 50,000)")
    parser.add_argument("--doc-words", type=int, default=100, help="mean words per passage (default 100)")
    parser.add_argument("--search-threads", type=int, default=0, help="bm25s threads per batch (default 0)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="where to write the corpus and index (default: a temp dir)")
    return parser.parse_args(argv)


def synthetic_words(n: int, rng: np.random.Generator) -> list[str]:
    """n distinct lower-case words of 3-10 letters (so bm25s' tokenizer keeps them whole)."""
    words: set[str] = set()
    while len(words) < n:
        letters = rng.integers(ord("a"), ord("z") + 1, size=(n, 10), dtype=np.uint8)
        for row, length in zip(letters, rng.integers(3, 11, size=n)):
            words.add(row[:length].tobytes().decode())
    return sorted(words)[:n]


def synthetic_corpus(args: argparse.Namespace, rng: np.random.Generator) -> tuple[list[dict], list[str]]:
    words = np.array(synthetic_words(args.vocab, rng))
    zipf = 1.0 / np.arange(1, len(words) + 1) ** 1.07  # word frequencies fall off like English's
    zipf /= zipf.sum()
    lengths = rng.integers(args.doc_words // 2, args.doc_words * 3 // 2 + 1, size=args.docs)
    tokens = words[rng.choice(len(words), size=int(lengths.sum()), p=zipf)]
    rows, start = [], 0
    for i, length in enumerate(lengths):
        passage = tokens[start : start + length]
        start += length
        rows.append({"id": str(i), "contents": f'"{passage[0].title()} {passage[1]}"\n' + " ".join(passage)})
    queries = []
    for doc in rng.integers(0, args.docs, size=args.queries):
        text = rows[doc]["contents"].split("\n", 1)[1].split()
        queries.append(" ".join(rng.choice(text, size=int(rng.integers(3, 7)), replace=False)))
    return rows, queries


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Positions of the k highest scores, best first."""
    top = np.argpartition(-scores, k)[:k] if k < len(scores) else np.arange(len(scores))
    return top[np.argsort(-scores[top], kind="stable")]


def top1_agreement(ours: list, theirs: list[np.ndarray]) -> float:
    """Percentage of queries whose best passage is the same (megarl returns no hit for no match)."""
    same = sum(1 for hits, top in zip(ours, theirs) if hits and hits[0].document.id == str(top[0]))
    return 100 * same / len(theirs)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(installed_versions(), flush=True)  # first, before the corpus is built
    from megarl.retrieval import build_index, load_index

    try:
        from rank_bm25 import BM25Okapi
    except ImportError:
        print("rank_bm25 is not installed: pip install rank-bm25 (it is in megarl's dev extra)", file=sys.stderr)
        return 2

    class OkapiKeepingDocFreqs(BM25Okapi):
        """BM25Okapi, unchanged, that also keeps its document frequencies (for the idf swap below)."""

        def _calc_idf(self, nd):
            self.nd = nd
            super()._calc_idf(nd)

    rng = np.random.default_rng(args.seed)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="megarl-bench-retrieval-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        rows, queries = synthetic_corpus(args, rng)
        corpus = workdir / "corpus.jsonl"
        with open(corpus, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        print(f"machine: {os.cpu_count()} CPUs; both timings include query tokenisation (megarl's: also document lookup)")
        print(f"corpus: {args.docs:,} passages, {corpus.stat().st_size / 2**20:.0f} MiB, "
              f"{args.vocab:,}-word Zipf vocabulary; {args.queries:,} queries ({time.perf_counter() - t0:.1f} s)")

        # megarl: build + save, load memory-mapped, batched search
        t0 = time.perf_counter()
        index_dir = build_index(corpus, workdir / "index", overwrite=True, show_progress=False, checksum=False)
        build_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        retriever = load_index(index_dir, search_threads=args.search_threads)
        load_s = time.perf_counter() - t0
        size_mib = sum(p.stat().st_size for p in index_dir.rglob("*") if p.is_file()) / 2**20
        print(f"megarl (bm25s): build+save {build_s:.1f} s, load {load_s:.2f} s, index {size_mib:.0f} MiB")
        t0 = time.perf_counter()
        doc_tokens = retriever.tokenize([row["contents"] for row in rows])
        baseline = OkapiKeepingDocFreqs(doc_tokens)
        print(f"rank_bm25 (BM25Okapi): build {time.perf_counter() - t0:.1f} s (in memory, from megarl's tokens)")
        del doc_tokens

        # both answer the same queries from their text: tokenisation, scoring, top-k
        n_base = len(queries) if args.baseline_queries <= 0 else min(args.baseline_queries, len(queries))
        subset = queries[:n_base]
        ours, base_top = [], []

        def megarl_queries() -> int:
            ours.clear()
            for start in range(0, n_base, args.batch_size):
                ours.extend(retriever.search(subset[start : start + args.batch_size], args.topk))
            return len(ours)  # queries answered

        def rank_bm25_queries() -> int:
            base_top.clear()
            base_top.extend(top_k(baseline.get_scores(tokens), args.topk) for tokens in retriever.tokenize(subset))
            return len(base_top)

        scope = ("all queries" if n_base == len(queries) else
                 f"the first {n_base:,} of {len(queries):,} queries (rank_bm25 is too slow for all; --baseline-queries)")
        result = compare({"rank_bm25": rank_bm25_queries, "megarl": megarl_queries}, repeats=args.repeats,
                         show=lambda line: print(line, flush=True), versions=False,
                         header=f"timed on {scope}, each with its tokenisation, in batches of {args.batch_size} "
                                f"for megarl, top-{args.topk}")
        for name in result.seconds:
            rates = ", ".join(f"{n_base / s:,.1f}" for s in result.seconds[name])
            print(f"{name}: {n_base:,} queries, queries/s {rates}")
        t0 = time.perf_counter()
        for start in range(0, len(queries), args.batch_size):
            retriever.search(queries[start : start + args.batch_size], args.topk)
        ours_s = time.perf_counter() - t0
        print(f"megarl on all {len(queries):,} queries: {ours_s:.2f} s = {len(queries) / ours_s:,.0f} queries/s")
        print(f"top-1 agreement on the {n_base:,} shared queries: {top1_agreement(ours, base_top):.1f}% "
              "(Lucene vs Okapi BM25 variants; not expected to be 100%)")

        # Okapi's idf is ln((N - n + 0.5) / (n + 0.5)), floored for words in over half the
        # passages; Lucene's is ln(1 + (N - n + 0.5) / (n + 0.5)). The rest differs only by
        # Okapi's constant (k1 + 1) factor, so with Lucene's idf the rankings should agree.
        n_docs = baseline.corpus_size
        baseline.idf = {w: float(np.log(1 + (n_docs - n + 0.5) / (n + 0.5))) for w, n in baseline.nd.items()}
        lucene_top = [top_k(baseline.get_scores(tokens), args.topk) for tokens in retriever.tokenize(subset)]
        print(f"top-1 agreement with rank_bm25 given Lucene's idf (untimed): {top1_agreement(ours, lucene_top):.1f}%")
        print(result.summary("rank_bm25", "megarl"))
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
