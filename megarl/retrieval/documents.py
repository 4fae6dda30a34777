"""Retrieved documents and the text the search agent sees: `format_documents(docs)`.

A document is one corpus row `{"id", "contents"}` where contents is `'"Title"\\ntext'` (the
wiki-18 layout of Search-R1 and FlashRAG). `format_documents` renders search results exactly
as Search-R1 puts them between <information> tags, so checkpoints trained there see the same
bytes here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True, slots=True)
class Document:
    """One passage of the corpus; `id` is kept as a string whatever the corpus used."""

    id: str
    contents: str

    @property
    def title(self) -> str:
        return split_title_text(self.contents)[0]

    @property
    def text(self) -> str:
        return split_title_text(self.contents)[1]

    def to_dict(self) -> dict[str, str]:
        """The JSON form of the retrieval API and of corpus rows."""
        return {"id": self.id, "contents": self.contents}


class Hit(NamedTuple):
    """A search result with its score (higher is better); unpacks as `(document, score)`."""

    document: Document
    score: float


def split_title_text(contents: str) -> tuple[str, str]:
    """`'"Title"\\ntext'` → `("Title", "text")`: the first line without its surrounding quotes.

    Contents without a newline have no title: `("", contents)`.
    """
    first, newline, rest = contents.partition("\n")
    if not newline:
        return "", contents
    return first.strip('"'), rest


def format_documents(docs: Sequence[Document | Hit | Mapping]) -> str:
    """Search results as Search-R1 shows them to the policy, one line per document.

    `Doc {i}(Title: {first line}) {rest}\\n` for i = 1, 2, ...; accepts Documents, Hits, corpus
    dicts and the API's `{"document": ..., "score": ...}` items. Byte for byte Search-R1's
    rendering, which keeps the title line as stored (wiki-18: with its double quotes) and ends
    every document, the last one included, with a newline.
    """
    lines = []
    for i, doc in enumerate(docs, start=1):
        contents = _contents_of(doc)
        title, _, text = contents.partition("\n")
        lines.append(f"Doc {i}(Title: {title}) {text}\n")
    return "".join(lines)


def _contents_of(doc: Document | Hit | Mapping) -> str:
    if isinstance(doc, Hit):
        return doc.document.contents
    if isinstance(doc, Document):
        return doc.contents
    if isinstance(doc, Mapping):
        if "document" in doc:
            return _contents_of(doc["document"])
        if isinstance(doc.get("contents"), str):
            return doc["contents"]
    raise TypeError(
        f"format_documents: cannot read the contents of {doc!r}; pass Documents, Hits or "
        'dicts like {"id": "1", "contents": "\\"Title\\"\\ntext"}'
    )
