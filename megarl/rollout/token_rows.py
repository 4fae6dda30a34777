"""A trajectory's per-token values, held compactly (a recipe's step holds 100 million tokens).

`TokenRow` is a typed array (4 bytes a token id or log-prob, 1 a mask entry) where a list holds a
pointer and an object for each. `VersionRuns` holds each token's weight version as runs (a
version and where it ends): the weights change a few times in a trajectory at most, so a few
runs stand for thousands of tokens. Both compare equal to a list of the same values.
Main entry points: `TokenRow`, `token_row`, `VersionRuns`.
"""

from __future__ import annotations

import array
import bisect
from collections.abc import Iterable, Iterator

import numpy as np


class TokenRow(array.array):
    """Per-token values as a typed array; equal to a list of the same values; `+` gives a list."""

    def __eq__(self, other):
        if isinstance(other, (list, tuple, array.array)):
            return len(self) == len(other) and list(self) == list(other)
        return NotImplemented

    __hash__ = None  # mutable, as a list

    def __getitem__(self, index):
        got = super().__getitem__(index)
        return TokenRow(self.typecode, got) if isinstance(index, slice) else got

    def __add__(self, other):
        return list(self) + list(other)

    def __radd__(self, other):
        return list(other) + list(self)


def token_row(typecode: str, values=()) -> TokenRow:
    """`values` as a TokenRow of `typecode` (itself when it already is one)."""
    return values if isinstance(values, TokenRow) and values.typecode == typecode else TokenRow(typecode, values)


class VersionRuns:
    """Each token's weight version, as runs: run k holds version `versions[k]` up to position
    `ends[k]` (exclusive). Reads as a sequence of one version a token (len, index, iteration,
    numpy.asarray) and extends as a list does; 12 bytes a run where a typed array takes 4 a token."""

    __slots__ = ("_ends", "_versions")

    def __init__(self, values: Iterable[int] = ()):
        self._ends = array.array("q")
        self._versions = array.array("i")
        self.extend(values)

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def append_run(self, version: int, count: int) -> None:
        """`count` more tokens of `version`."""
        if count <= 0:
            return
        if self._versions and self._versions[-1] == version:
            self._ends[-1] += count
        else:
            self._ends.append(len(self) + count)
            self._versions.append(version)

    def runs(self) -> Iterator[tuple[int, int, int]]:
        """(version, start, end) of each run, end exclusive."""
        start = 0
        for end, version in zip(self._ends, self._versions):
            yield version, start, end
            start = end

    def extend(self, values: Iterable[int]) -> None:
        if isinstance(values, VersionRuns):
            for version, start, end in values.runs():
                self.append_run(version, end - start)
            return
        values = np.asarray(values if isinstance(values, (list, tuple, array.array, np.ndarray)) else list(values),
                            dtype=np.int64)
        if not values.size:
            return
        changes = np.flatnonzero(values[1:] != values[:-1]) + 1
        bounds = [0, *changes.tolist(), values.size]
        for a, b in zip(bounds, bounds[1:]):
            self.append_run(int(values[a]), b - a)

    def __getitem__(self, index: int) -> int:
        if isinstance(index, slice):
            return list(self)[index]
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError("VersionRuns index out of range")
        return self._versions[bisect.bisect_right(self._ends, index)]

    def __iter__(self) -> Iterator[int]:
        for version, start, end in self.runs():
            yield from [version] * (end - start)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        counts = np.diff(np.asarray(self._ends, dtype=np.int64), prepend=0)
        return np.repeat(np.asarray(self._versions, dtype=dtype or np.int32), counts)

    def __eq__(self, other):
        if isinstance(other, VersionRuns):
            return self._ends == other._ends and self._versions == other._versions
        if isinstance(other, (list, tuple, array.array)):
            return len(self) == len(other) and list(self) == list(other)
        return NotImplemented

    __hash__ = None  # mutable, as a list

    def __repr__(self) -> str:
        runs = ", ".join(f"{v} x {e - s}" for s, e, v in zip([0, *self._ends[:-1]], self._ends, self._versions))
        return f"VersionRuns({runs})"

    def __getstate__(self):
        return self._ends.tobytes(), self._versions.tobytes()

    def __setstate__(self, state) -> None:
        self._ends, self._versions = array.array("q"), array.array("i")
        self._ends.frombytes(state[0])
        self._versions.frombytes(state[1])
