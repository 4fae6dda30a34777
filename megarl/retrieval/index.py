"""Building an index directory from a corpus and opening it again: `build_index`, `load_index`.

An index directory holds the documents (DocStore), the kind's own files (`bm25/` or
`dense/`) and `manifest.json` (kind, sizes, format version, the corpus path and SHA-256,
the build parameters). The manifest is written last and the directory is built under a
temporary name and renamed into place, so an index is either whole or absent.
`corpus_warnings` compares the manifest's corpus with the one a run's data was prepared against.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import uuid
from itertools import chain
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from megarl.retrieval.corpus import corpus_info, corpus_rows_hint, iter_corpus
from megarl.retrieval.docstore import DocStoreWriter
from megarl.retrieval.errors import CorpusError, IndexExistsError, IndexFormatError, RetrievalError
from megarl.retrieval.retriever import Retriever

MANIFEST_FILE = "manifest.json"
FORMAT_NAME = "megarl-retrieval-index"
FORMAT_VERSION = 1
KINDS = ("bm25", "dense")
_ENCODER_OPTIONS = ("max_length", "batch_size", "device", "fp16")
_OPTIONS = {
    "bm25": ("stemmer", "k1", "b", "method"),
    "dense": ("encoder", "hnsw", "hnsw_m", "ef_construction", "ef_search", "chunk_docs", "work_dir", "shard_docs",
              "shard") + _ENCODER_OPTIONS,
}


def build_index(
    corpus_path: str | Path,
    out_dir: str | Path,
    kind: str = "bm25",
    *,
    overwrite: bool = False,
    show_progress: bool = True,
    checksum: bool = True,
    **options: Any,
) -> Path | None:
    """Build a `kind` index of the corpus at `corpus_path` into `out_dir`; returns out_dir.

    overwrite: replace an existing non-empty out_dir (refused otherwise).
    checksum: record the corpus SHA-256 in the manifest (one extra read of the file).
    options, bm25: stemmer (e.g. "english", needs PyStemmer), k1, b, method.
    options, dense: encoder (directory, required), hnsw, hnsw_m, ef_construction, ef_search,
    chunk_docs, work_dir / shard_docs / shard (resumable and sharded embedding, see
    megarl.retrieval.dense.build_dense: with `shard` the result is None and no index is
    written), and for the encoder max_length, batch_size, device, fp16.
    """
    if kind not in KINDS:
        raise RetrievalError(f"unknown index kind {kind!r}; choose one of {', '.join(KINDS)}")
    unknown = sorted(set(options) - set(_OPTIONS[kind]))
    if unknown:
        raise RetrievalError(
            f"unknown option(s) {', '.join(unknown)} for a {kind} index; it takes {', '.join(_OPTIONS[kind])}"
        )
    corpus_path, out = Path(corpus_path), Path(out_dir)
    _check_out_dir(out, overwrite)
    docs = iter_corpus(corpus_path)
    first = next(docs, None)  # also surfaces a missing file or a bad first row before any work
    if first is None:
        raise CorpusError(f"corpus {corpus_path}: no rows; an index needs at least one document")
    build = _dense_builder(options) if kind == "dense" else _bm25_builder(options)
    corpus = corpus_info(corpus_path, checksum)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.building-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        store = DocStoreWriter(tmp)
        progress = tqdm(
            chain([first], docs), desc=f"indexing {corpus_path.name}", unit=" docs",
            total=corpus_rows_hint(corpus_path), disable=not show_progress,
        )
        try:
            params = build(store.tee(progress), tmp, show_progress)
        finally:
            store.close()
            progress.close()
        if params is None:  # one shard of a sharded build: its embeddings are kept, no index yet
            shutil.rmtree(tmp, ignore_errors=True)
            return None
        manifest = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "kind": kind,
            "num_docs": len(store),
            "corpus": corpus,
            "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            kind: params,
        }
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def load_index(
    directory: str | Path,
    *,
    mmap: bool = True,
    search_threads: int = 0,
    encoder: str | Path | None = None,
    device: str | None = None,
    ef_search: int | None = None,
) -> Retriever:
    """Open the index in `directory`, whichever kind its manifest names.

    bm25: mmap (memory-map the score arrays), search_threads (bm25s threads per batch; 0 = none).
    dense: encoder (directory overriding the one recorded at build), device, ef_search (HNSW).
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    kind = manifest["kind"]
    if kind == "bm25":
        from megarl.retrieval.bm25 import BM25Retriever

        retriever = BM25Retriever.load(directory, manifest["bm25"], mmap=mmap, search_threads=search_threads)
    else:
        from megarl.retrieval.dense import DenseRetriever

        retriever = DenseRetriever.load(
            directory, manifest["dense"], encoder=encoder, device=device, ef_search=ef_search
        )
    if len(retriever) != manifest["num_docs"]:
        raise IndexFormatError(
            f"index {directory}: manifest says {manifest['num_docs']} documents but the files hold "
            f"{len(retriever)}; rebuild the index"
        )
    return retriever


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The manifest of an index directory, checked for format, version and kind."""
    directory = Path(directory)
    path = directory / MANIFEST_FILE
    if not directory.is_dir():
        raise IndexFormatError(f"index {directory}: no such directory; build one with `megarl retrieval build`")
    if not path.is_file():
        raise IndexFormatError(
            f"index {directory}: no {MANIFEST_FILE}, so it is not an index written by `megarl retrieval build`"
        )
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise IndexFormatError(f"index {directory}: {MANIFEST_FILE} is not valid JSON ({e}); rebuild the index") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise IndexFormatError(f"index {directory}: {MANIFEST_FILE} is not a megarl retrieval index manifest")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise IndexFormatError(
            f"index {directory}: format version {version}, but this megarl reads version {FORMAT_VERSION}; "
            "rebuild the index with this megarl (or use the megarl that built it)"
        )
    kind = manifest.get("kind")
    if kind not in KINDS or not isinstance(manifest.get(kind), dict):
        raise IndexFormatError(f"index {directory}: unknown or incomplete index kind {kind!r} in {MANIFEST_FILE}")
    return manifest


def corpus_warnings(directory: str | Path, expected: dict[str, dict[str, Any]]) -> list[str]:
    """Why the index in `directory` may serve other documents than the data expects, checked
    without reading the corpus: `expected` maps a data file to the corpus it was prepared
    against (`corpus_info`: path, bytes, sha256), compared with the manifest's corpus by
    SHA-256 (by size when either has none); and the corpus file at the manifest's path, if
    still there, against the size it had when the index was built."""
    directory = Path(directory)
    built = read_manifest(directory).get("corpus") or {}
    warnings = []
    for data_file, wanted in expected.items():
        key = "sha256" if "sha256" in built and "sha256" in wanted else "bytes"
        if built.get(key) is not None and wanted.get(key) is not None and built[key] != wanted[key]:
            warnings.append(
                f"the retrieval index {directory} was built from another corpus than {data_file} was prepared "
                f"against: index: {built.get('path')} ({_identity(built)}), data: {wanted.get('path')} "
                f"({_identity(wanted)}); rebuild the index from the data's corpus (megarl retrieval build --corpus "
                f"...) or prepare the data against the index's corpus")
    path = Path(built.get("path") or "")
    if built.get("path") and path.is_file() and built.get("bytes") not in (None, path.stat().st_size):
        warnings.append(
            f"the corpus {path} changed since the retrieval index {directory} was built from it ({built['bytes']:,} "
            f"bytes then, {path.stat().st_size:,} now; sha256 then {built.get('sha256', 'not recorded')}): the "
            f"index serves the old documents; rebuild it if the run should search the new ones")
    return warnings


def _identity(corpus: dict[str, Any]) -> str:
    if corpus.get("sha256"):
        return f"sha256 {corpus['sha256']}"
    return f"{corpus['bytes']:,} bytes, no sha256" if isinstance(corpus.get("bytes"), int) else "no sha256"


def _bm25_builder(options: dict[str, Any]):
    from megarl.retrieval.bm25 import build_bm25, make_stemmer

    make_stemmer(options.get("stemmer"))  # fail before reading the corpus, not after

    def build(docs, directory, show_progress):
        return build_bm25(docs, directory, show_progress=show_progress, **options)

    return build


def _dense_builder(options: dict[str, Any]):
    from megarl.retrieval.dense import build_dense, import_faiss
    from megarl.retrieval.encoder import E5Encoder

    import_faiss()
    options = dict(options)
    encoder_path = options.pop("encoder", None)
    if not encoder_path:
        raise RetrievalError("a dense index needs an encoder: pass encoder=PATH (--encoder), e.g. a local e5-base-v2")
    encoder = E5Encoder(encoder_path, **{k: options.pop(k) for k in _ENCODER_OPTIONS if k in options})

    def build(docs, directory, show_progress):
        return build_dense(docs, directory, encoder=encoder, **options)

    return build


def _check_out_dir(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise IndexExistsError(f"output {out} is a file, not a directory; choose another --out")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise IndexExistsError(
            f"output directory {out} is not empty; pass --overwrite (overwrite=True) to replace it, "
            "or choose another --out"
        )


def _move_into_place(tmp: Path, out: Path) -> None:
    if not out.exists():
        os.rename(tmp, out)
        return
    # Move the old index aside first: rename cannot replace a non-empty directory.
    old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
    os.rename(out, old)
    os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
