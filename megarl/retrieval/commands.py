"""`megarl retrieval build`, `serve` and `check`: `add_retrieval_commands(subparsers)`.

    megarl retrieval build --corpus wiki-18.jsonl --out indexes/wiki18-bm25
    megarl retrieval build --corpus wiki-18.jsonl --out indexes/wiki18-e5 --kind dense --encoder e5-base-v2 [--hnsw]
    megarl retrieval serve --index indexes/wiki18-bm25 [--host 127.0.0.1 --port 8000 --topk 3]
    megarl retrieval check --index indexes/wiki18-bm25   (its manifest read, nothing loaded: a recipe's dry run)
    MEGARL_RETRIEVAL_API_KEY=... megarl retrieval serve --index ... --host 10.0.0.5   (a key beyond loopback)

Each sub-command sets `func(args) -> exit status`. Problems with the user's input (corpus,
index directory, options) print one message and return 2, without a traceback.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from megarl.http_auth import RETRIEVAL_KEY_ENV
from megarl.retrieval.errors import RetrievalError

EXIT_USAGE_ERROR = 2


def add_retrieval_commands(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `retrieval {build,serve,check}` to an argparse subparsers object; returns the `retrieval` parser."""
    retrieval = subparsers.add_parser("retrieval", help="build and serve retrieval indexes (BM25 or dense)")
    commands = retrieval.add_subparsers(dest="retrieval_command", metavar="{build,serve,check}", required=True)

    build = commands.add_parser("build", help="index a corpus ({id, contents} rows in .jsonl[.gz] or .parquet)")
    build.add_argument("--corpus", required=True, help="corpus file: JSONL rows {\"id\", \"contents\"} or parquet")
    build.add_argument("--out", required=True, help="index directory to create")
    build.add_argument("--kind", choices=["bm25", "dense"], default="bm25", help="index kind (default: bm25)")
    build.add_argument("--overwrite", action="store_true", help="replace --out if it already holds files")
    build.add_argument("--no-checksum", action="store_true", help="skip the corpus SHA-256 in the manifest")
    build.add_argument("--quiet", action="store_true", help="no progress bars")
    bm25 = build.add_argument_group("bm25")
    bm25.add_argument("--stemmer", default=None, help="Snowball stemmer language, e.g. english (needs PyStemmer)")
    bm25.add_argument("--k1", type=float, default=1.5, help="BM25 k1 (default 1.5)")
    bm25.add_argument("--b", type=float, default=0.75, help="BM25 b (default 0.75)")
    dense = build.add_argument_group("dense")
    dense.add_argument("--encoder", help="local directory of a Hugging Face encoder, e.g. e5-base-v2")
    dense.add_argument("--hnsw", action="store_true", help="approximate HNSW index instead of exact flat search")
    dense.add_argument("--hnsw-m", type=int, default=32, help="HNSW links per node (default 32)")
    dense.add_argument("--batch-size", type=int, default=64, help="passages per encoder forward pass (default 64)")
    dense.add_argument("--max-length", type=int, default=256, help="encoder tokens per passage (default 256)")
    dense.add_argument("--device", default=None, help="encoder device (default: cuda if available, else cpu)")
    dense.add_argument("--fp16", action="store_true", help="run the encoder in half precision (GPU)")
    dense.add_argument("--work-dir", help="keep the embeddings here, so an interrupted build resumes from its last "
                       "whole shard (default: OUT.embeddings beside --out)")
    dense.add_argument("--shard-docs", type=int, default=100_000, help="documents per embedding shard (default 100000)")
    dense.add_argument("--shard", help="I/N: embed only shards k with k %% N == I (one job per GPU), then run once "
                       "more without --shard to build the index from all of them")
    build.set_defaults(func=run_build)

    serve = commands.add_parser("serve", help="serve an index over HTTP (Search-R1's POST /retrieve API)")
    serve.add_argument("--index", required=True, help="index directory made by `megarl retrieval build`")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 = all)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    serve.add_argument("--topk", type=int, default=3, help="documents per query when a request has no topk (default 3)")
    serve.add_argument("--max-topk", type=int, default=100, help="largest topk a request may ask for (default 100)")
    serve.add_argument("--max-queries", type=int, default=4096, help="most queries in one request (default 4096)")
    serve.add_argument("--no-mmap", action="store_true", help="bm25: load the score arrays into memory")
    serve.add_argument("--search-threads", type=int, default=0, help="bm25: threads per batch of queries (default 0)")
    serve.add_argument("--encoder", default=None, help="dense: encoder directory, if moved since the build")
    serve.add_argument("--device", default=None, help="dense: encoder device")
    serve.add_argument("--ef-search", type=int, default=None, help="dense HNSW: candidates per query")
    serve.add_argument("--api-key", default=None,
                       help=f"require 'Authorization: Bearer KEY' on /retrieve (default ${RETRIEVAL_KEY_ENV}, which "
                       "keeps it off the command line); needed to bind beyond loopback")
    serve.add_argument("--allow-unauthenticated", action="store_true",
                       help="bind beyond loopback without a key: anyone who reaches the port may search (Search-R1's "
                       "own client sends no key)")
    serve.set_defaults(func=run_serve)

    check = commands.add_parser("check", help="check an index directory as serve will open it, loading nothing "
                                "(its manifest: format, version, kind, documents)")
    check.add_argument("--index", required=True, help="index directory made by `megarl retrieval build`")
    check.set_defaults(func=run_check)
    return retrieval


def run_check(args: argparse.Namespace) -> int:
    """Print what the index holds; exit 2 naming what is wrong (no directory, no manifest, another
    format version), as `serve` would after its job started."""
    from megarl.retrieval.index import read_manifest

    try:
        manifest = read_manifest(args.index)
    except RetrievalError as e:
        print(f"megarl retrieval check: {e}", file=sys.stderr)
        return EXIT_USAGE_ERROR
    corpus = manifest.get("corpus") or {}
    source = f" of {corpus['path']}" if isinstance(corpus, dict) and corpus.get("path") else ""
    print(f"index {args.index}: {manifest['kind']}, {manifest.get('num_docs', '?')} documents{source}")
    return 0


def run_build(args: argparse.Namespace) -> int:
    from megarl.retrieval.index import build_index

    if args.kind == "bm25":
        options = {"stemmer": args.stemmer, "k1": args.k1, "b": args.b}
    else:
        shard = None
        if args.shard:
            try:
                i, n = (int(x) for x in args.shard.split("/"))
                assert 0 <= i < n
            except (ValueError, AssertionError):
                print(f"megarl retrieval build: --shard {args.shard!r}: use I/N with 0 <= I < N", file=sys.stderr)
                return EXIT_USAGE_ERROR
            shard = (i, n)
        out_path = Path(args.out)
        options = {
            "encoder": args.encoder, "hnsw": args.hnsw, "hnsw_m": args.hnsw_m, "batch_size": args.batch_size,
            "max_length": args.max_length, "device": args.device, "fp16": args.fp16,
            "work_dir": args.work_dir or str(out_path.parent / f"{out_path.name}.embeddings"),
            "shard_docs": args.shard_docs, "shard": shard,
        }
    try:
        out = build_index(
            args.corpus, args.out, args.kind, overwrite=args.overwrite,
            show_progress=not args.quiet, checksum=not args.no_checksum, **options,
        )
    except (RetrievalError, FileNotFoundError) as e:
        print(f"megarl retrieval build: {e}", file=sys.stderr)
        return EXIT_USAGE_ERROR
    if out is None:
        print(f"megarl retrieval build: shard {args.shard} embedded into {options['work_dir']}; once every shard is, "
              "run the same command without --shard to build the index", file=sys.stderr)
        return 0
    print(f"megarl retrieval build: {args.kind} index written to {out}", file=sys.stderr)
    if args.kind == "dense" and not args.work_dir:  # the embeddings were only kept for resuming
        shutil.rmtree(options["work_dir"], ignore_errors=True)
    return 0


def run_serve(args: argparse.Namespace) -> int:
    from megarl.retrieval.index import load_index
    from megarl.retrieval.server import check_bind, serve

    if not 1 <= args.topk <= args.max_topk:
        print(f"megarl retrieval serve: --topk {args.topk} must be between 1 and --max-topk {args.max_topk}",
              file=sys.stderr)
        return EXIT_USAGE_ERROR
    api_key = args.api_key or os.environ.get(RETRIEVAL_KEY_ENV) or None
    try:
        check_bind(args.host, api_key, args.allow_unauthenticated)  # before minutes of loading an index
        retriever = load_index(
            args.index, mmap=not args.no_mmap, search_threads=args.search_threads,
            encoder=args.encoder, device=args.device, ef_search=args.ef_search,
        )
    except (RetrievalError, FileNotFoundError) as e:
        print(f"megarl retrieval serve: {e}", file=sys.stderr)
        return EXIT_USAGE_ERROR
    print(
        f"megarl retrieval serve: {retriever.kind} index of {len(retriever)} documents on "
        f"http://{args.host}:{args.port}/retrieve{' (API key required)' if api_key else ''}",
        file=sys.stderr,
    )
    serve(
        retriever, host=args.host, port=args.port, default_topk=args.topk,
        max_topk=args.max_topk, max_queries=args.max_queries, api_key=api_key,
        allow_unauthenticated=args.allow_unauthenticated,
    )
    return 0
