"""The host RNG states a checkpoint keeps, in one format for both backends.

A resumed run draws the same random numbers as one that never stopped: torch's CPU
generator, numpy's global generator and Python's `random`. The state is a flat dict of
tensors, so `torch.load(weights_only=True)` reads it back:

    torch       torch.get_rng_state()
    numpy_keys  numpy's MT19937 key (624 words) and numpy_pos, its position in the key
    python      the 625 MT19937 words of random.getstate()

A backend adds its own generators under keys of its own (megatron: `tracker/<name>` for its
model-parallel RNG tracker); `set_rng_state` ignores keys it does not know. The Gaussian that
numpy and `random` cache between draws is not kept, so a resume is exact for everything but
the second half of a pair of Gaussians drawn across it.

Main entry points: `rng_state`, `set_rng_state`.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

import numpy as np
import torch


def rng_state() -> dict[str, torch.Tensor]:
    """This process's torch (CPU), numpy and Python RNG states as tensors."""
    _, keys, pos, _, _ = np.random.get_state()
    return {"torch": torch.get_rng_state(), "numpy_keys": torch.from_numpy(keys.astype(np.int64)),
            "numpy_pos": torch.tensor(pos), "python": torch.tensor(random.getstate()[1], dtype=torch.int64)}


def set_rng_state(state: Mapping) -> None:
    """Restore what `rng_state` returned. Also reads the torch backend's rng.pt written before
    this format, which nested numpy's state as {"numpy": {"keys", "pos"}}."""
    numpy_keys, numpy_pos = ((state["numpy"]["keys"], state["numpy"]["pos"]) if "numpy" in state
                             else (state["numpy_keys"], state["numpy_pos"]))
    torch.set_rng_state(state["torch"])
    np.random.set_state(("MT19937", numpy_keys.numpy().astype(np.uint32), int(numpy_pos), 0, 0.0))
    random.setstate((3, tuple(int(x) for x in state["python"]), None))
