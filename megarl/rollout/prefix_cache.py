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

Main entry point: `KeptPrefixes`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict


class KeptPrefixes:
    """Token sequences kept in the slots first_slot .. first_slot + size - 1, least recently
    kept first out."""

    def __init__(self, first_slot: int, size: int):
        self.first_slot, self.size = first_slot, size
        self._kept: OrderedDict[int, tuple[int, ...]] = OrderedDict()  # slot -> the tokens its cache holds
        self._lock = threading.Lock()
        self.hits = 0  # prompts that found a kept prefix
        self.reused_tokens = 0  # prompt tokens not computed again thanks to one

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, tokens: tuple[int, ...]) -> int | None:
        """The slot to copy the cache of `tokens` into (the oldest kept sequence's when none is
        free), or None when nothing is kept (size 0, no tokens, or `tokens` already kept)."""
        with self._lock:
            if not self.size or not tokens or tokens in self._kept.values():
                return None
            if len(self._kept) < self.size:
                slot = next(s for s in range(self.first_slot, self.first_slot + self.size) if s not in self._kept)
            else:
                slot, _ = self._kept.popitem(last=False)
            self._kept[slot] = tokens
            return slot

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
