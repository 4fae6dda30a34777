"""The documents of an index, read by position without loading them: `DocStore.open(dir)`.

Stored as `documents.jsonl` (one `{"id", "contents"}` object per line: itself a valid corpus)
plus `documents.offsets.npy` (int64 byte offsets, one more than there are documents). Both
are memory-mapped, so opening wiki-18's 13 GB costs nothing and a lookup reads one line.
"""

from __future__ import annotations

import json
import mmap
from array import array
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from megarl.retrieval.documents import Document, Hit
from megarl.retrieval.errors import IndexFormatError

DOCUMENTS_FILE = "documents.jsonl"
OFFSETS_FILE = "documents.offsets.npy"


class DocStoreWriter:
    """Appends documents to a store in `directory`; `close()` writes the offsets."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self._file = open(self.directory / DOCUMENTS_FILE, "wb")
        self._offsets = array("q", [0])

    def add(self, doc: Document) -> None:
        line = json.dumps(doc.to_dict(), ensure_ascii=False).encode("utf-8") + b"\n"
        self._file.write(line)
        self._offsets.append(self._offsets[-1] + len(line))

    def tee(self, docs: Iterable[Document]) -> Iterator[Document]:
        """Yield `docs` unchanged, storing each on the way (so one pass over the corpus does both)."""
        for doc in docs:
            self.add(doc)
            yield doc

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def close(self) -> None:
        self._file.close()
        np.save(self.directory / OFFSETS_FILE, np.frombuffer(self._offsets, dtype=np.int64))


class DocStore:
    """Read-only, memory-mapped documents; `store[i]` is the i-th document of the corpus."""

    def __init__(self, data: mmap.mmap, offsets: np.ndarray, directory: Path):
        self._data = data
        self._offsets = offsets
        self.directory = directory

    @classmethod
    def open(cls, directory: str | Path) -> DocStore:
        directory = Path(directory)
        docs_path, offsets_path = directory / DOCUMENTS_FILE, directory / OFFSETS_FILE
        for path in (docs_path, offsets_path):
            if not path.is_file():
                raise IndexFormatError(f"index {directory}: {path.name} is missing; rebuild the index")
        offsets = np.load(offsets_path, mmap_mode="r")
        size = docs_path.stat().st_size
        if offsets.ndim != 1 or len(offsets) < 2 or int(offsets[-1]) != size:
            raise IndexFormatError(
                f"index {directory}: {OFFSETS_FILE} does not match {DOCUMENTS_FILE} "
                f"({size} bytes); the index is damaged, rebuild it"
            )
        with open(docs_path, "rb") as f:
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return cls(data, offsets, directory)

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, position: int) -> Document:
        position = int(position)
        if not 0 <= position < len(self):
            raise IndexError(f"document {position} out of range (the store has {len(self)})")
        start, end = int(self._offsets[position]), int(self._offsets[position + 1])
        obj = json.loads(self._data[start:end])
        return Document(id=obj["id"], contents=obj["contents"])

    def collect(
        self, positions: Sequence[Sequence[int]], scores: Sequence[Sequence[float]], return_scores: bool
    ) -> list[list[Hit]] | list[list[Document]]:
        """Per-query positions and scores (best first) → Hits, or Documents without scores.

        Negative positions (faiss pads with -1 when it has fewer than k results) are dropped.
        """
        results: list = []
        for row_positions, row_scores in zip(positions, scores):
            row = []
            for position, score in zip(row_positions, row_scores):
                if position < 0:
                    continue
                doc = self[position]
                row.append(Hit(doc, float(score)) if return_scores else doc)
            results.append(row)
        return results
