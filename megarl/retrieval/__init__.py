"""Retrieval for Search-R1 style agents: corpora, BM25 / dense indexes, HTTP server and client.

    build_index("wiki-18.jsonl", "indexes/wiki18-bm25")        # or `megarl retrieval build`
    retriever = load_index("indexes/wiki18-bm25")               # memory-mapped
    retriever.search(["who wrote hamlet"], topk=3)              # [[Hit(document, score), ...]]
    serve(retriever, port=8000)                                 # or `megarl retrieval serve`
    results = await RetrievalClient("http://127.0.0.1:8000").search(queries, topk=3)
    format_documents(results[0].docs)                           # "Doc 1(Title: ...) ...\\n..."

Dense indexes (E5 encoder + faiss) need the `dense` extra; everything else is core.
"""

import importlib

# Names resolve on first use, so that `import megarl.retrieval.<module>` (the CLI builds its
# parser from megarl.retrieval.commands) does not load FastAPI, uvicorn and httpx.
_EXPORTS = {
    "client": ("ClientStats", "RetrievalClient", "SearchResult"),
    "corpus": ("iter_corpus", "write_jsonl_corpus"),
    "documents": ("Document", "Hit", "format_documents", "split_title_text"),
    "errors": ("CorpusError", "IndexExistsError", "IndexFormatError", "RetrievalError"),
    "index": ("build_index", "load_index", "read_manifest"),
    "retriever": ("Retriever",),
    "server": ("BackgroundServer", "create_app", "serve"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'megarl.retrieval' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"megarl.retrieval.{_MODULE_OF[name]}"), name)
    globals()[name] = value
    return value
