"""Retrieval for Search-R1 style agents: corpora, BM25 / dense indexes, HTTP server and client.

    build_index("wiki-18.jsonl", "indexes/wiki18-bm25")        # or `megarl retrieval build`
    retriever = load_index("indexes/wiki18-bm25")               # memory-mapped
    retriever.search(["who wrote hamlet"], topk=3)              # [[Hit(document, score), ...]]
    serve(retriever, port=8000)                                 # or `megarl retrieval serve`
    results = await RetrievalClient("http://127.0.0.1:8000").search(queries, topk=3)
    format_documents(results[0].docs)                           # "Doc 1(Title: ...) ...\\n..."

Dense indexes (E5 encoder + faiss) need the `dense` extra; everything else is core.
"""

from megarl.retrieval.client import ClientStats, RetrievalClient, SearchResult
from megarl.retrieval.corpus import iter_corpus, write_jsonl_corpus
from megarl.retrieval.documents import Document, Hit, format_documents, split_title_text
from megarl.retrieval.errors import CorpusError, IndexExistsError, IndexFormatError, RetrievalError
from megarl.retrieval.index import build_index, load_index, read_manifest
from megarl.retrieval.retriever import Retriever
from megarl.retrieval.server import BackgroundServer, create_app, serve

__all__ = [
    "BackgroundServer",
    "ClientStats",
    "CorpusError",
    "Document",
    "Hit",
    "IndexExistsError",
    "IndexFormatError",
    "RetrievalClient",
    "RetrievalError",
    "Retriever",
    "SearchResult",
    "build_index",
    "create_app",
    "format_documents",
    "iter_corpus",
    "load_index",
    "read_manifest",
    "serve",
    "split_title_text",
    "write_jsonl_corpus",
]
