"""Dense retrieval with faiss (optional extra): `build_dense(docs, dir, encoder)` and `DenseRetriever.load`.

Passages are embedded with an `E5Encoder` and stored in a faiss index that scores by inner
product (cosine, since E5 vectors are unit length): IndexFlatIP (exact) or IndexHNSWFlat
(approximate, much faster on millions of passages). faiss is imported only here and only
when used: `pip install 'megarl[dense]'`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import islice
from pathlib import Path
from typing import Any

from megarl.retrieval.docstore import DocStore
from megarl.retrieval.documents import Document, Hit
from megarl.retrieval.encoder import E5Encoder
from megarl.retrieval.errors import IndexFormatError, RetrievalError
from megarl.retrieval.retriever import check_search_args

DENSE_SUBDIR = "dense"
FAISS_FILE = "index.faiss"


def import_faiss():
    """The faiss module, or a RetrievalError saying how to install it."""
    try:
        import faiss
    except ImportError as e:
        raise RetrievalError(
            "dense retrieval needs faiss, which is not installed: pip install 'megarl[dense]' "
            "(or faiss-gpu); BM25 indexes (--kind bm25) work without it"
        ) from e
    return faiss


def build_dense(
    docs: Iterable[Document],
    directory: str | Path,
    *,
    encoder: E5Encoder,
    hnsw: bool = False,
    hnsw_m: int = 32,
    ef_construction: int = 200,
    ef_search: int = 128,
    chunk_docs: int = 4096,
) -> dict[str, Any]:
    """Embed the contents of `docs` ("passage: " + contents) into `directory/dense/index.faiss`.

    hnsw: IndexHNSWFlat with hnsw_m links per node and ef_construction / ef_search candidate
    lists (larger = better recall, slower); otherwise exact IndexFlatIP.
    chunk_docs: documents embedded and added per step (bounds memory).
    Returns the parameters to record in the index manifest.
    """
    faiss = import_faiss()
    if hnsw:
        index = faiss.IndexHNSWFlat(encoder.dim, hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = ef_construction
    else:
        index = faiss.IndexFlatIP(encoder.dim)
    docs = iter(docs)
    while chunk := list(islice(docs, chunk_docs)):
        index.add(encoder.encode_passages([doc.contents for doc in chunk]))
    out = Path(directory) / DENSE_SUBDIR
    out.mkdir(parents=True, exist_ok=True)
    faiss.write_index(index, str(out / FAISS_FILE))
    params: dict[str, Any] = {
        "encoder": str(Path(encoder.path).resolve()),
        "dim": encoder.dim,
        "max_length": encoder.max_length,
        "pooling": "mean",
        "normalized": True,
        "metric": "inner_product",
        "index_type": "hnsw" if hnsw else "flat",
        "faiss_version": faiss.__version__,
    }
    if hnsw:
        params.update(hnsw_m=hnsw_m, ef_construction=ef_construction, ef_search=ef_search)
    return params


class DenseRetriever:
    """A faiss index plus its encoder and documents; see `Retriever` for `search`."""

    kind = "dense"

    def __init__(self, index, encoder: E5Encoder, store: DocStore):
        self.index = index
        self.encoder = encoder
        self.store = store

    @classmethod
    def load(
        cls,
        directory: str | Path,
        params: dict[str, Any],
        *,
        encoder: str | Path | None = None,
        device: str | None = None,
        ef_search: int | None = None,
    ) -> DenseRetriever:
        """Open `directory`; `params` is the manifest's "dense" section.

        encoder: the encoder directory, when it is not (or no longer) where the build found it.
        ef_search: HNSW candidate list at query time (default: the value recorded at build).
        """
        faiss = import_faiss()
        directory = Path(directory)
        path = directory / DENSE_SUBDIR / FAISS_FILE
        if not path.is_file():
            raise IndexFormatError(f"index {directory}: {DENSE_SUBDIR}/{FAISS_FILE} is missing; rebuild the index")
        index = _read_index_mmap(faiss, path)
        if params.get("index_type") == "hnsw":
            index.hnsw.efSearch = ef_search or params.get("ef_search", 128)
        store = DocStore.open(directory)
        if index.ntotal != len(store):
            raise IndexFormatError(
                f"index {directory}: faiss holds {index.ntotal} vectors but the store {len(store)} documents; "
                "rebuild the index"
            )
        encoder_path = Path(encoder or params["encoder"])
        enc = E5Encoder(encoder_path, max_length=params.get("max_length", 256), device=device)
        if enc.dim != index.d:
            raise IndexFormatError(
                f"encoder {encoder_path} makes {enc.dim}-d vectors but index {directory} holds {index.d}-d ones; "
                "use the encoder the index was built with"
            )
        return cls(index, enc, store)

    def __len__(self) -> int:
        return len(self.store)

    def search(
        self, queries: Sequence[str], topk: int, return_scores: bool = True
    ) -> list[list[Hit]] | list[list[Document]]:
        check_search_args(queries, topk)
        if not queries:
            return []
        scores, positions = self.index.search(self.encoder.encode_queries(queries), min(topk, len(self)))
        return self.store.collect(positions.tolist(), scores.tolist(), return_scores)


def _read_index_mmap(faiss, path: Path):
    # Memory-map the vectors when this faiss supports it (1.8+), so opening a 60 GB flat
    # wiki-18 index does not first copy it into RAM; otherwise read it whole.
    flags = getattr(faiss, "IO_FLAG_MMAP_IFC", 0) | getattr(faiss, "IO_FLAG_READ_ONLY", 0)
    try:
        return faiss.read_index(str(path), flags)
    except RuntimeError:
        return faiss.read_index(str(path))
