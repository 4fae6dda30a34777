"""Dense retrieval with faiss (optional extra): `build_dense(docs, dir, encoder)` and `DenseRetriever.load`.

Passages are embedded with an `E5Encoder` and stored in a faiss index that scores by inner
product (cosine, since E5 vectors are unit length): IndexFlatIP (exact) or IndexHNSWFlat
(approximate, much faster on millions of passages). faiss is imported only here and only
when used: `pip install 'megarl[dense]'`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np

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


def memory_needed(num_docs: int, dim: int, hnsw: bool = False, hnsw_m: int = 32) -> int:
    """Bytes a dense index holds in memory while it is built (and maps at serve time): the
    float32 vectors, plus HNSW's links (2 x M neighbours on the base layer, 4-byte ids).
    wiki-18 (21M passages) with e5-base (768-d): 64.6 GB flat, 69.9 GB HNSW with M = 32."""
    return num_docs * dim * 4 + (num_docs * 2 * hnsw_m * 4 if hnsw else 0)


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
    work_dir: str | Path | None = None,
    shard_docs: int = 100_000,
    shard: tuple[int, int] | None = None,
) -> dict[str, Any] | None:
    """Embed the contents of `docs` ("passage: " + contents) into `directory/dense/index.faiss`.

    hnsw: IndexHNSWFlat with hnsw_m links per node and ef_construction / ef_search candidate
    lists (larger = better recall, slower); otherwise exact IndexFlatIP.
    chunk_docs: documents embedded per encoder call (bounds memory).
    work_dir: keep the embeddings there, `shard_docs` documents per file, so a build that
    stops resumes from its last whole shard (the encoder is the slow part: hours for wiki-18).
    shard (i, n): embed only the shards k with k % n == i and return None (no index): n jobs,
    one per GPU, share the work; a last run without `shard` adds them all into the index.
    Returns the parameters to record in the index manifest.
    """
    faiss = import_faiss()
    if shard is not None and work_dir is None:
        raise RetrievalError("a sharded build (shard i of n) needs a work_dir the shards are kept in")
    work = EmbeddingShards(work_dir, encoder, shard_docs) if work_dir is not None else None
    if hnsw:
        index = faiss.IndexHNSWFlat(encoder.dim, hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = ef_construction
    else:
        index = faiss.IndexFlatIP(encoder.dim)
    docs = iter(docs)
    if work is None:
        while chunk := list(islice(docs, chunk_docs)):
            index.add(encoder.encode_passages([doc.contents for doc in chunk]))
    else:
        k = 0
        while batch := list(islice(docs, shard_docs)):
            mine = shard is None or k % shard[1] == shard[0]
            if mine and not work.done(k):
                work.write(k, np.concatenate([encoder.encode_passages([d.contents for d in batch[i:i + chunk_docs]])
                                              for i in range(0, len(batch), chunk_docs)]))
            k += 1
        if shard is not None:
            return None
        for i in range(k):
            index.add(work.read(i))
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


class EmbeddingShards:
    """A build's embeddings on disk, `shard_docs` documents per .npy file, each written under
    a temporary name and renamed (a file present is whole). `work.json` records what they
    were made with; a different encoder, length or shard size is refused, not mixed in."""

    def __init__(self, directory: str | Path, encoder: E5Encoder, shard_docs: int):
        if shard_docs < 1:
            raise RetrievalError(f"shard_docs={shard_docs} must be at least 1")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        identity = {"encoder": str(Path(encoder.path).resolve()), "dim": encoder.dim,
                    "max_length": encoder.max_length, "shard_docs": shard_docs}
        stamp = self.dir / "work.json"
        if stamp.exists():
            recorded = json.loads(stamp.read_text())
            if recorded != identity:
                raise RetrievalError(f"work directory {self.dir} holds embeddings made with {recorded}, not {identity}; "
                                     "use another --work-dir or delete it")
        else:
            stamp.write_text(json.dumps(identity, indent=1))
        self.dim = encoder.dim

    def path(self, k: int) -> Path:
        return self.dir / f"shard-{k:06d}.npy"

    def done(self, k: int) -> bool:
        return self.path(k).exists()

    def write(self, k: int, vectors: np.ndarray) -> None:
        tmp = self.dir / f".shard-{k:06d}.tmp.npy"
        np.save(tmp, vectors.astype(np.float32, copy=False))
        tmp.rename(self.path(k))

    def read(self, k: int) -> np.ndarray:
        if not self.done(k):
            raise RetrievalError(f"embedding shard {k} is missing from {self.dir}: run the sharded builds for every "
                                 "shard (or build without --shard) first")
        vectors = np.load(self.path(k))
        if vectors.ndim != 2 or vectors.shape[1] != self.dim:
            raise IndexFormatError(f"{self.path(k)} holds {vectors.shape} vectors, not (*, {self.dim})")
        return vectors


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
