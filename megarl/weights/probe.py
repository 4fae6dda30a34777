"""The weights probe: are the engines serving the trainer's weights?

A few fixed token sequences, drawn from the run's training prompts when it starts, are scored
twice after every event that loads the engines' weights or could lose them (a sync, an engine
restart and its reload, a resume of released memory, a resume from a checkpoint): by the
trainer, for the weights it pushed (`WeightProbe.expect`, computed by the runtime), and by every engine (the log-prob of
each token given the ones before it: SGLang's `/generate` by input ids with `return_logprob`
and `logprob_start_len=0`; `RolloutEngine.probe_log_probs`). An engine whose mean absolute
difference per token exceeds the tolerance serves other weights: wiped by a memory release,
half loaded, another version, another model. What then happens (one reload, then the run
stops by name) is the runtime's business (megarl.runtime.base.Runtime.check_engine_weights).

Exact per-tensor checksums (sync.verify) say more where an engine can report them; the probe
works with every engine, SGLang's own servers included, at the cost of one short prefill.

Main entry points: `WeightProbe`, `probe_sequences`, `default_tolerance`, `WrongWeights`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

from megarl.errors import ComponentDied


class WrongWeights(ComponentDied):
    """An engine serves other weights than the trainer's, and reloading them did not help."""


# mean |engine - trainer| log-prob per probe token (nats) that still counts as the same weights.
# float32 on the CPU: the same model computed by two code paths agrees within 1e-5 (measured
# here: the embedded engine and SGLang 0.5.23's CPU server against the torch trainer). bf16: a
# published comparison of engines and trainers on the same checkpoint (docs/training.md) found
# 0.005-0.006 for Qwen3-32B and 0.14-0.34 for Qwen3-30B-A3B, whose routers pick other experts
# for some tokens (the probe does not replay the engine's routing). Wiped or foreign weights
# differ by nats (a uniform guess over a 150k vocabulary is -11.9).
TOLERANCES = {"float32": (1e-4, 1e-3), "bfloat16": (0.05, 0.05), "float16": (0.05, 0.05)}  # (CPU, GPU)
MOE_FACTOR = 10  # a mixture of experts: 10x the dense tolerance


def default_tolerance(dtype: str, on_gpu: bool, moe: bool = False) -> float:
    """The probe's tolerance for the model's dtype on this kind of device (TOLERANCES), 10x for
    a mixture of experts."""
    return TOLERANCES[dtype][on_gpu] * (MOE_FACTOR if moe else 1)


@lru_cache(maxsize=8)  # the gate asks every step (RunConfig.gate_bound): the file is read once
def is_mixture_of_experts(model_path: str) -> bool:
    """Whether the HF config in `model_path` routes tokens to experts (False when it cannot be read)."""
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return False
    config = config.get("text_config", config)
    return any(int(config.get(key) or 0) > 1 for key in ("num_experts", "num_local_experts", "n_routed_experts"))


def probe_sequences(prompts: Sequence[Sequence[int]], count: int, tokens: int) -> list[list[int]]:
    """`count` sequences of at most `tokens` tokens: the longest prompts' first tokens, in a
    fixed order (ties by position), so every run on the same data probes the same tokens.
    Sequences of one token have nothing to score and are left out."""
    order = sorted(range(len(prompts)), key=lambda i: (-len(prompts[i]), i))
    picked = [list(prompts[i][:tokens]) for i in order[:count]]
    return [p for p in picked if len(p) >= 2]


@dataclass
class Mismatch:
    """One engine's disagreement with the trainer on the probe."""

    engine: str
    mean_abs: float  # mean |engine - trainer| log-prob a token
    max_abs: float
    tokens: int

    def describe(self, tolerance: float) -> str:
        return (f"{self.engine}: mean |engine - trainer| log-prob {self.mean_abs:.3g} a token over {self.tokens} "
                f"probe tokens (largest {self.max_abs:.3g}; tolerance {tolerance:.3g})")


class WeightProbe:
    """The probe's sequences, the trainer's log-probs of them for the weights it last pushed,
    and the comparison with an engine's."""

    def __init__(self, sequences: list[list[int]], tolerance: float):
        if not sequences:
            raise ValueError("the weights probe needs at least one sequence of two or more tokens")
        self.sequences = sequences
        self.tolerance = tolerance
        self.expected: list[torch.Tensor] | None = None  # per sequence, log-probs of tokens 1..n-1
        self.version: int | None = None  # the weights `expected` is for

    def expect(self, trainer_log_probs: list[torch.Tensor], version: int) -> None:
        """The trainer's log-probs of the sequences (tokens 1..n-1 of each, at temperature 1, as
        the engines answer) for the weights of `version`."""
        if [len(t) for t in trainer_log_probs] != [len(s) - 1 for s in self.sequences]:
            raise ValueError("the trainer's probe log-probs do not cover every scored token of the probe")
        self.expected = [t.float() for t in trainer_log_probs]
        self.version = version

    async def mismatches(self, engine) -> list[Mismatch]:
        """The engines of `engine` (one, or each of a fleet) that disagree with the trainer
        beyond the tolerance; [] when all agree. An answer of the wrong shape is a mismatch."""
        if self.expected is None:
            raise RuntimeError("the weights probe has no trainer log-probs yet (WeightProbe.expect)")
        answers = await engine.probe_log_probs(self.sequences)
        return [m for m in (self.compare(name, got) for name, got in answers.items())
                if not m.mean_abs <= self.tolerance]  # NaN is a mismatch too

    def compare(self, engine: str, got: Sequence[Sequence[float]]) -> Mismatch:
        """How far `got` (per sequence, log-probs of tokens 1..n-1) is from the trainer's."""
        want_lengths = [len(e) for e in self.expected]
        if [len(g) for g in got] != want_lengths:
            return Mismatch(engine, float("inf"), float("inf"), sum(want_lengths))
        diff = (torch.tensor([x for g in got for x in g], dtype=torch.float64)
                - torch.cat(self.expected).double()).abs()
        return Mismatch(engine, float(diff.mean()), float(diff.max()), diff.numel())
