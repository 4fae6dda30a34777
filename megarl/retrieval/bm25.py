"""BM25 over a corpus with bm25s: `build_bm25(docs, dir)` and `BM25Retriever.load(dir)`.

Documents are tokenised with bm25s' tokenizer (lower case, words of 2+ characters, English
stopwords removed, optional Snowball stemming when PyStemmer is installed) in one streaming
pass; the score matrix is bm25s' sparse CSC arrays, loaded memory-mapped. The documents
themselves live in the index's DocStore.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import bm25s
import numpy as np
from bm25s.tokenization import Tokenizer

from megarl.retrieval.docstore import DocStore
from megarl.retrieval.documents import Document, Hit
from megarl.retrieval.errors import RetrievalError

# bm25s sets its logger to DEBUG on import; let it follow the application's logging instead
logging.getLogger("bm25s").setLevel(logging.NOTSET)
from megarl.retrieval.retriever import check_search_args

BM25_SUBDIR = "bm25"
STOPWORDS = "en"


def build_bm25(
    docs: Iterable[Document],
    directory: str | Path,
    *,
    stemmer: str | None = None,
    k1: float = 1.5,
    b: float = 0.75,
    method: str = "lucene",
    show_progress: bool = True,
) -> dict[str, Any]:
    """Index the contents (title line and text) of `docs` into `directory/bm25`.

    stemmer: a Snowball language such as "english" (needs PyStemmer), or None for none.
    k1, b, method: BM25 parameters; "lucene" is the variant of Pyserini, which Search-R1 used.
    Returns the parameters to record in the index manifest.
    """
    tokenizer = Tokenizer(stopwords=STOPWORDS, stemmer=make_stemmer(stemmer))
    contents = (doc.contents for doc in docs)
    # array("i") instead of lists: half the memory per token, which matters at wiki-18 scale
    token_ids = [array("i", ids) for ids in tokenizer.streaming_tokenize(contents, update_vocab=True)]
    vocab = tokenizer.get_vocab_dict()
    model = bm25s.BM25(k1=k1, b=b, method=method)
    model.index((token_ids, vocab), show_progress=show_progress)
    del token_ids
    model.save(Path(directory) / BM25_SUBDIR, show_progress=show_progress)
    return {
        "k1": k1,
        "b": b,
        "method": method,
        "stopwords": STOPWORDS,
        "stemmer": stemmer,
        "vocab_size": len(vocab),
        "bm25s_version": bm25s.__version__,
    }


def make_stemmer(language: str | None):
    """A PyStemmer stemmer for `language` (None: no stemming); RetrievalError saying how to get PyStemmer."""
    if language is None:
        return None
    try:
        import Stemmer
    except ImportError as e:
        raise RetrievalError(
            f"BM25 stemming ({language!r}) needs PyStemmer, which is not installed: "
            "pip install PyStemmer (or build/load the index without a stemmer)"
        ) from e
    try:
        return Stemmer.Stemmer(language)
    except KeyError as e:
        raise RetrievalError(
            f"PyStemmer has no stemmer for {language!r}; choose one of {', '.join(Stemmer.algorithms())}"
        ) from e


class BM25Retriever:
    """A BM25 index opened from disk; see `Retriever` for `search`."""

    kind = "bm25"

    def __init__(self, model: bm25s.BM25, store: DocStore, stemmer: str | None = None, search_threads: int = 0):
        self.model = model
        self.store = store
        self.stemmer_language = stemmer
        self._stemmer = make_stemmer(stemmer)
        self.search_threads = search_threads

    @classmethod
    def load(cls, directory: str | Path, params: dict[str, Any], *, mmap: bool = True, search_threads: int = 0):
        """Open `directory` (built by build_bm25 + a DocStore); `params` is the manifest's "bm25"."""
        directory = Path(directory)
        model = bm25s.BM25.load(directory / BM25_SUBDIR, mmap=mmap, load_corpus=False, show_progress=False)
        return cls(model, DocStore.open(directory), params.get("stemmer"), search_threads)

    def __len__(self) -> int:
        return len(self.store)

    def tokenize(self, queries: Sequence[str]) -> list[list[str]]:
        """Query terms as the index sees them (stopwords removed, stemmed if the index is)."""
        return bm25s.tokenize(
            list(queries), stopwords=STOPWORDS, stemmer=self._stemmer, return_ids=False, show_progress=False
        )

    def search(
        self, queries: Sequence[str], topk: int, return_scores: bool = True
    ) -> list[list[Hit]] | list[list[Document]]:
        check_search_args(queries, topk)
        if not queries:
            return []
        k = min(topk, len(self))  # bm25s refuses k larger than the corpus
        positions, scores = self.model.retrieve(
            self.tokenize(queries), k=k, show_progress=False, n_threads=self.search_threads
        )
        # bm25s gives every document score 0 for a query with no indexed term and fills
        # the top-k with them; Lucene (Search-R1's Pyserini index) returns only documents
        # that share a term with the query, and a zero-score passage in the prompt is noise.
        positions = np.where(scores > 0, positions, -1)
        return self.store.collect(positions, scores, return_scores)
