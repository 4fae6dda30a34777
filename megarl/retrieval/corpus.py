"""Reading retrieval corpora one row at a time: `iter_corpus(path)`.

A corpus is JSONL (optionally gzipped) or parquet with rows `{"id", "contents"}`, contents
being `'"Title"\\ntext'` as in Search-R1's and FlashRAG's wiki-18. Wiki-18 has 21M rows
(13 GB), so nothing here holds the corpus in memory. A malformed row stops the read with a
`CorpusError` naming the file, the 1-based row number and what is wrong with it.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from megarl.retrieval.documents import Document
from megarl.retrieval.errors import CorpusError

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
PARQUET_SUFFIXES = (".parquet",)
_ROW_EXAMPLE = '{"id": "0", "contents": "\\"Title\\"\\ntext"}'
_PARQUET_BATCH_ROWS = 8192


def corpus_format(path: str | Path) -> str:
    """"jsonl" or "parquet", from the file name; CorpusError for anything else."""
    name = Path(path).name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    supported = ", ".join(JSONL_SUFFIXES + PARQUET_SUFFIXES)
    raise CorpusError(f"corpus {path}: unknown file type; use one of {supported}")


def iter_corpus(path: str | Path) -> Iterator[Document]:
    """Yield the corpus rows of a JSONL or parquet file as Documents, in file order.

    JSONL: one JSON object per line; blank lines are skipped but counted, so the row number
    in an error is the line number an editor shows. Extra fields are ignored; integer ids
    become strings.
    """
    path = Path(path)
    fmt = corpus_format(path)
    if not path.is_file():
        raise CorpusError(f"corpus {path}: no such file")
    if fmt == "jsonl":
        yield from _iter_jsonl(path)
    else:
        yield from _iter_parquet(path)


def corpus_rows_hint(path: str | Path) -> int | None:
    """Number of rows when it is known without reading the corpus (parquet metadata), else None."""
    if corpus_format(path) != "parquet":
        return None
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).metadata.num_rows


def write_jsonl_corpus(path: str | Path, rows: Iterable[Document | dict[str, Any]]) -> Path:
    """Write rows as a JSONL corpus (the format `iter_corpus` reads); returns the path."""
    path = Path(path)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            obj = row.to_dict() if isinstance(row, Document) else row
            f.write(json.dumps(obj, ensure_ascii=False) + "\n")
    return path


def corpus_info(path: str | Path, checksum: bool = True) -> dict[str, Any]:
    """What identifies a corpus file: {"path" (absolute), "bytes", "sha256" (with checksum)}; an
    index manifest records it, and so can a data file prepared against the corpus."""
    path = Path(path)
    info: dict[str, Any] = {"path": str(path.resolve()), "bytes": path.stat().st_size}
    if checksum:
        info["sha256"] = file_sha256(path)
    return info


def file_sha256(path: str | Path, chunk_bytes: int = 1 << 20) -> str:
    """Hex SHA-256 of a file's bytes, read in chunks (one extra pass; seconds for wiki-18)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def _iter_jsonl(path: Path) -> Iterator[Document]:
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    with opener(path, "rb") as f:
        for row_number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except UnicodeDecodeError as e:
                raise _row_error(path, row_number, f"is not valid UTF-8 ({e})") from e
            except json.JSONDecodeError as e:
                raise _row_error(path, row_number, f"is not valid JSON ({e.msg} at column {e.colno})") from e
            yield _document_from_row(obj, path, row_number)


def _iter_parquet(path: Path) -> Iterator[Document]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a file that is not parquet
        raise CorpusError(f"corpus {path}: cannot be read as parquet ({e})") from e
    columns = set(parquet.schema_arrow.names)
    missing = [name for name in ("id", "contents") if name not in columns]
    if missing:
        raise CorpusError(
            f"corpus {path}: missing column(s) {', '.join(missing)} (has {', '.join(sorted(columns))}); "
            f"a corpus needs an 'id' and a 'contents' column"
        )
    row_number = 0
    for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=["id", "contents"]):
        ids = batch.column("id").to_pylist()
        contents = batch.column("contents").to_pylist()
        for doc_id, text in zip(ids, contents):
            row_number += 1
            yield _document_from_row({"id": doc_id, "contents": text}, path, row_number)


def _document_from_row(obj: Any, path: Path, row_number: int) -> Document:
    if not isinstance(obj, dict):
        raise _row_error(path, row_number, f"is a JSON {type(obj).__name__}, not an object")
    doc_id = obj.get("id")
    contents = obj.get("contents")
    if "id" not in obj:
        raise _row_error(path, row_number, "has no 'id' field")
    # bool is an int in Python, but an id of true/false is surely a mistake in the file
    if isinstance(doc_id, bool) or not isinstance(doc_id, (str, int)):
        raise _row_error(path, row_number, f"has an 'id' of type {_type_name(doc_id)}; expected a string or integer")
    if "contents" not in obj:
        hint = " (a 'title'/'text' corpus must be converted first)" if "text" in obj else ""
        raise _row_error(path, row_number, f"has no 'contents' field{hint}")
    if not isinstance(contents, str):
        raise _row_error(path, row_number, f"has a 'contents' of type {_type_name(contents)}; expected a string")
    return Document(id=str(doc_id), contents=contents)


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _row_error(path: Path, row_number: int, problem: str) -> CorpusError:
    return CorpusError(f"corpus {path}, row {row_number}: the row {problem}; each row must look like {_ROW_EXAMPLE}")
