"""Errors of the retrieval package that a user can cause and fix (bad corpus, bad index dir).

Each message says what happened, which file or row caused it, and what to do; the command
line prints them without a traceback.
"""

from __future__ import annotations


class RetrievalError(Exception):
    """Base class: a problem with the user's input (corpus, index directory, options)."""


class CorpusError(RetrievalError, ValueError):
    """A corpus file is missing, of an unknown format, or has a malformed row."""


class IndexFormatError(RetrievalError, ValueError):
    """An index directory is missing files, is incomplete, or was written by another version."""


class IndexExistsError(RetrievalError, FileExistsError):
    """The output directory of a build already holds files and --overwrite was not given."""
