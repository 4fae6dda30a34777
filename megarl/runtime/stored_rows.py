"""A step's routing put in Ray's object store once, for every call that sends the ranks a share.

With routing replay (actor.moe_routing_replay) the engines' experts are most of the step's bytes
(768 a token for Qwen3-30B-A3B: about 39 GB a step of the DAPO recipe), and the driver sends
each rank its share twice: for the old log-probs and for the update, two different cuts of the
batch. The driver instead puts the routing once, in pieces: the batch's rows cut wherever a
forward share or an update's share begins or ends (`cuts`). Each share then names its pieces
(`StoredRows`) and the rank reads them from the store (`fetched`): every share is whole pieces,
so a rank still receives its rows and no others, and a piece sent for the log-probs is sent
again by name only.

A piece lives as long as the batch's routing does: they are dropped from the store when the
driver lets go of the batch. Main entry points: `RoutingInStore`, `cuts`, `fetched`.
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Iterable
from dataclasses import replace

import ray

from megarl.backends.batch import RaggedRows
from megarl.backends.packed import DataShare, StoredRows, forward_runs, read_only_rows, update_runs

FETCH_TIMEOUT_S = 600.0  # a share's routing is GBs, read from the driver's node at worst


def cuts(rows: int, dp_size: int, mini_rows: Iterable[int]) -> list[int]:
    """Where a batch of `rows` rows is cut into forward shares and into the shares of updates
    of mini-batches of each `mini_rows` (megarl.backends.packed's runs, and the rows an update
    leaves out of a mini-batch): every row index a share's run starts or stops at."""
    runs = forward_runs(rows, dp_size) + [run for mini in mini_rows for share in update_runs(rows, dp_size, mini)
                                          for run in share]
    ends = {min(start + mini, rows) for mini in mini_rows for start in range(0, rows, mini)}
    return sorted({0, rows, *ends, *(i for run in runs for i in (run.start, run.stop))})


class RoutingInStore:
    """The driver's side: the routing of the batch in hand, stored by piece as shares ask for
    them. A share of another batch's routing starts again (the old pieces are dropped with it)."""

    def __init__(self):
        self._whole: weakref.ref | None = None
        self._pieces: dict[tuple[int, int], ray.ObjectRef] = {}
        self.stored_bytes = 0  # the routing bytes put in the store, all batches together

    def __len__(self) -> int:
        """The pieces held in the store now."""
        return len(self._pieces)

    def share(self, share: DataShare, whole: RaggedRows, at: list[int]) -> DataShare:
        """`share` of the batch whose routing is `whole`, its routing named by pieces between
        the cuts `at`; a piece not yet in the store is put there."""
        if self._whole is None or self._whole() is not whole:
            self._pieces = {}
            self._whole = weakref.ref(whole)
            weakref.finalize(whole, self._pieces.clear)
        handles = []
        for run in (r for r in share.rows if r.stop > r.start):
            first = bisect.bisect_right(at, run.start) - 1
            bounds = [run.start, *(c for c in at[first + 1:] if c < run.stop), run.stop]
            for lo, hi in zip(bounds, bounds[1:]):
                if (lo, hi) not in self._pieces:
                    rows = [row.numpy() for row in whole.rows[lo:hi]]
                    self._pieces[(lo, hi)] = ray.put(rows)
                    self.stored_bytes += sum(r.nbytes for r in rows)
                handles.append(self._pieces[(lo, hi)])
        return replace(share, batch=replace(share.batch, routed_experts=StoredRows(tuple(handles))))


def fetched(args: tuple) -> tuple:
    """A call's arguments as the rank computes on them: a share's stored routing read from the
    object store (views of it, not copies)."""
    return tuple(_fetched(a) for a in args)


def _fetched(arg):
    if not isinstance(arg, DataShare) or not isinstance(arg.batch.routed_experts, StoredRows):
        return arg
    parts = arg.batch.routed_experts.parts
    try:
        pieces = ray.get(list(parts), timeout=FETCH_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError as error:
        raise TimeoutError(f"data-parallel rank {arg.dp_rank}: its share's routing ({len(parts)} pieces in Ray's "
                           f"object store) did not arrive within {FETCH_TIMEOUT_S:.0f} s") from error
    routed = read_only_rows([row for piece in pieces for row in piece])
    if len(routed) != len(arg.batch):
        raise ValueError(f"data-parallel rank {arg.dp_rank}: its share's routing holds {len(routed)} rows "
                         f"for {len(arg.batch)} rows")
    return replace(arg, batch=replace(arg.batch, routed_experts=routed))
