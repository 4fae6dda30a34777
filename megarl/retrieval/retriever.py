"""The interface every index implements: `Retriever.search(queries, topk, return_scores)`.

The server, the command line and the agent's in-process path only see this protocol; BM25
(bm25s) and dense (faiss) indexes implement it. Open one with `megarl.retrieval.load_index`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from megarl.retrieval.documents import Document, Hit


@runtime_checkable
class Retriever(Protocol):
    kind: str
    """"bm25" or "dense"."""

    def __len__(self) -> int:
        """Number of documents in the index."""
        ...

    def search(
        self, queries: Sequence[str], topk: int, return_scores: bool = True
    ) -> list[list[Hit]] | list[list[Document]]:
        """For each query, up to `topk` documents, best first.

        With return_scores (the default) each result is a `Hit(document, score)`, otherwise a
        `Document`. Fewer than topk come back when fewer documents match (BM25: no query term
        in common) or the index holds fewer documents.
        """
        ...


def check_search_args(queries: Sequence[str], topk: int) -> None:
    """ValueError naming the bad argument, shared by the implementations."""
    if isinstance(queries, str) or not isinstance(queries, Sequence):
        raise ValueError(f"queries must be a list of strings, got {type(queries).__name__}")
    for i, query in enumerate(queries):
        if not isinstance(query, str):
            raise ValueError(f"queries[{i}] must be a string, got {type(query).__name__}")
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk must be a positive integer, got {topk!r}")
