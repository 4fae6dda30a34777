"""Which finished sequences the embedded engine keeps in its K/V cache for reuse, and where.

A multi-turn trajectory sends its whole history as the next turn's prompt: the previous turn's
prompt and output, then the tool's observation. The engine keeps the cache of each finished
sequence in a slot of its own (past the running slots) and, when a prompt starts with a kept
sequence, copies that cache into the new request's slot and computes only the rest of the
prompt. Kept sequences are forgotten oldest first when their slots run out, on use (the new
request's own sequence is kept in its turn), and all at once when the weights change.

The engine's model thread keeps and takes; its event loop asks, for each new request, whether
it continues a kept sequence (such requests are admitted first, before their kept sequence is
pushed out): a lock keeps the two consistent.

Prompts admitted together that start with the same tokens (a template's instruction, a system
prompt) share those tokens' computation too: `shared_prefixes` groups them, the engine computes
the shared tokens once in one prompt's slot and copies them to the others'. SGLang's radix cache
gives the fleet both.

Main entry points: `KeptPrefixes`, `shared_prefixes`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

# a group of prompts shares its first tokens' computation when that saves this many tokens of
# prefill at least (the shared tokens are one more forward pass, and copies)
SHARED_PREFIX_MIN_SAVING = 256


class KeptPrefixes:
    """Token sequences kept in the slots first_slot .. first_slot + size - 1, least recently
    kept first out."""

    def __init__(self, first_slot: int, size: int):
        self.first_slot, self.size = first_slot, size
        self._kept: OrderedDict[int, tuple[int, ...]] = OrderedDict()  # slot -> the tokens its cache holds
        self._lock = threading.Lock()
        self.hits = 0  # prompts that found a kept prefix
        self.reused_tokens = 0  # prompt tokens not computed again thanks to one
        self.not_kept = 0  # finished sequences not kept: the K/V budget had no room for them

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, tokens: tuple[int, ...], fits: Callable[[int], bool] | None = None) -> int | None:
        """The slot to copy the cache of `tokens` into: the first free one, else the oldest kept
        sequence's; or None when nothing is kept (size 0, no tokens, `tokens` already kept).
        `fits(slot)`: whether the cache's memory can hold `tokens` in that slot (the embedded
        engine's K/V budget); a free slot that does not fit gives way to the oldest sequence's,
        and when neither fits nothing is kept (counted in `not_kept`)."""
        with self._lock:
            if not self.size or not tokens or tokens in self._kept.values():
                return None
            fits = fits or (lambda slot: True)
            if len(self._kept) < self.size:
                slot = next(s for s in range(self.first_slot, self.first_slot + self.size) if s not in self._kept)
                if fits(slot):
                    self._kept[slot] = tokens
                    return slot
            if self._kept:
                oldest = next(iter(self._kept))
                if fits(oldest):
                    del self._kept[oldest]
                    self._kept[oldest] = tokens
                    return oldest
            self.not_kept += 1
            return None

    def find(self, prompt: list[int]) -> tuple[int, int] | None:
        """(slot, length) of the longest kept sequence that the prompt starts with and is longer
        than (one token at least is left to compute the next-token logits from), or None."""
        with self._lock:
            return self._find(prompt)

    def take(self, prompt: list[int]) -> tuple[int, int] | None:
        """`find`, and the sequence found is no longer kept (its cache moves to the prompt's slot)."""
        with self._lock:
            best = self._find(prompt)
            if best is not None:
                del self._kept[best[0]]
                self.hits += 1
                self.reused_tokens += best[1]
            return best

    def _find(self, prompt: list[int]) -> tuple[int, int] | None:
        best = None
        for slot, tokens in self._kept.items():
            n = len(tokens)
            # the last token first: most kept sequences fail there without a slice of the prompt
            if (n < len(prompt) and prompt[n - 1] == tokens[-1] and (best is None or n > best[1])
                    and tuple(prompt[:n]) == tokens):
                best = (slot, n)
        return best

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()


def shared_prefixes(prompts: list[tuple[int, ...]], min_saving: int | None = None) -> list[tuple[list[int], int]]:
    """Groups of `prompts` that start with the same tokens: (their indices, the first one the
    prompt whose slot computes them; how many tokens they share). Every prompt keeps one token
    at least to compute its next-token logits from. In sorted order alike prompts are
    neighbours: the groups are runs of neighbours, chosen (by dynamic programming over the
    runs) to save the most prefill, a group saving its size less one times the tokens it
    shares; a group saving fewer than `min_saving` tokens (SHARED_PREFIX_MIN_SAVING) is not
    made. The prompts must be distinct."""
    min_saving = SHARED_PREFIX_MIN_SAVING if min_saving is None else min_saving
    order = sorted(range(len(prompts)), key=prompts.__getitem__)
    seq = [prompts[i] for i in order]
    n = len(seq)
    neighbours = [common_length(seq[i], seq[i + 1]) for i in range(n - 1)]  # what sorted neighbours share
    # best[b]: the most saved over the first b sorted prompts; start[b], shares[b]: where its last
    # group starts and how many tokens that group shares
    best, start, shares = [0] * (n + 1), list(range(n + 1)), [0] * (n + 1)
    for b in range(1, n + 1):
        best[b], start[b] = best[b - 1], b - 1  # prompt b - 1 alone
        shared = len(seq[b - 1]) - 1
        for a in range(b - 2, -1, -1):  # the group seq[a:b]
            shared = min(shared, neighbours[a], len(seq[a]) - 1)
            if shared <= 0:
                break
            saving = (b - a - 1) * shared
            if saving >= min_saving and best[a] + saving > best[b]:
                best[b], start[b], shares[b] = best[a] + saving, a, shared
    groups, b = [], n
    while b > 0:
        a = start[b]
        if b - a > 1:
            groups.append(([order[i] for i in range(a, b)], shares[b]))
        b = a
    return groups[::-1]


def common_length(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """How many first tokens `a` and `b` have in common."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]: halve (tuple compares run in C)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo
