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

The tolerance is calibrated at run time: the first probe (the engines' start, or a resume's
first sync: both sides hold the same weights) measures the noise floor, the largest mean
difference of an engine, and the tolerance in force becomes the larger of the configured bound
and `multiple` x that floor (`WeightProbe.calibrate`). A floor above the ceiling is not noise:
the runtime stops the run rather than calibrate wrong weights into acceptance.

Exact per-tensor checksums (sync.verify) say more where an engine can report them; the probe
works with every engine, SGLang's own servers included, at the cost of one short prefill.

Main entry points: `WeightProbe`, `probe_sequences`, `default_tolerance`, `default_ceiling`,
`WrongWeights`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

from megarl.errors import ComponentDied

log = logging.getLogger(__name__)


class WrongWeights(ComponentDied):
    """An engine serves other weights than the trainer's, and reloading them did not help."""


# The configured bound: mean |engine - trainer| log-prob per probe token (nats) that counts as the
# same weights before the first probe has measured the noise, and the least tolerance after.
# float32 on the CPU: the same model computed by two code paths agrees within 1e-5 (measured
# here: the embedded engine and SGLang 0.5.23's CPU server against the torch trainer). bf16: a
# published comparison of engines and trainers on the same checkpoint (docs/training.md) found
# 0.005-0.006 for Qwen3-32B and 0.14-0.34 for Qwen3-30B-A3B, whose routers pick other experts
# for some tokens (the probe does not replay the engine's routing), on sampled tokens; the probe
# scores teacher-forced prompt tokens, unlikely ones among them, whose bf16 logits' rounding does
# not cancel (about 0.04 nats by arithmetic): hence the calibration. Wiped or foreign weights
# differ by nats (a uniform guess over a 150k vocabulary is -11.9).
TOLERANCES = {"float32": (1e-4, 1e-3), "bfloat16": (0.05, 0.05), "float16": (0.05, 0.05)}  # (CPU, GPU)
MOE_FACTOR = 10  # a mixture of experts: 10x the dense tolerance
# The trainer's GEMMs in FP8 (actor.fp8) against bf16 engines. A mean of absolute differences
# obeys the triangle inequality token by token: |engine - fp8 trainer| <= |engine - bf16 trainer|
# + |bf16 trainer - fp8 trainer|, so the bound grows by the second term, which megarl's GPU test
# bounds at a mean of 0.1 nats a token (tests/gpu/test_megatron_gpu.py,
# test_fp8_log_probs_stay_close_to_bf16: e4m3 keeps 3 mantissa bits against bf16's 7, each
# operand rounded 16x coarser; fp32 accumulation over a layer's inputs averages much of it out).
FP8_GAP = 0.1
# The ceiling: the largest noise floor a first probe may measure, 10x the bound, at most 2 nats
# a token (the engines' probability of the trainer's tokens e^2 = 7.4x off on average: no rounding
# or routing noise comes near it; the largest published gap above is 0.34), never below the bound.
CEILING_FACTOR = 10
MAX_CEILING = 2.0


def default_tolerance(dtype: str, on_gpu: bool, moe: bool = False, fp8: bool = False) -> float:
    """The probe's configured bound for the model's dtype on this kind of device (TOLERANCES),
    10x for a mixture of experts, FP8_GAP more for a trainer computing in FP8."""
    return TOLERANCES[dtype][on_gpu] * (MOE_FACTOR if moe else 1) + (FP8_GAP if fp8 else 0.0)


def default_ceiling(bound: float) -> float:
    """The largest noise floor the first probe may measure, for the configured `bound`."""
    return max(bound, min(CEILING_FACTOR * bound, MAX_CEILING))


@lru_cache(maxsize=8)  # the gate asks every step (RunConfig.gate_bound): the config is read once
def is_mixture_of_experts(model_path: str) -> bool:
    """Whether the HF config of `model_path` routes tokens to experts: a model directory, its
    config.json, or a hub id in the local HF cache (never fetched: a config check must not wait
    on a network, which a cluster's compute nodes often lack). False, logged, when it cannot be
    read (the first probe's calibration still measures it)."""
    from transformers import PretrainedConfig

    try:  # the raw dict: no config class needed, so model types transformers lacks are read too
        config, _ = PretrainedConfig.get_config_dict(model_path, local_files_only=True)
    except (OSError, ValueError) as e:
        log.warning("sync.probe: model.path=%s has no HF config to read (%s); the probe's bound is a dense "
                    "model's", model_path, e)
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

    def describe(self, limit: float, name: str = "tolerance") -> str:
        return (f"{self.engine}: mean |engine - trainer| log-prob {self.mean_abs:.3g} a token over {self.tokens} "
                f"probe tokens (largest {self.max_abs:.3g}; {name} {limit:.3g})")


class WeightProbe:
    """The probe's sequences, the trainer's log-probs of them for the weights it last pushed,
    and the comparison with an engine's."""

    def __init__(self, sequences: list[list[int]], tolerance: float, multiple: float = 1.0,
                 ceiling: float = math.inf):
        """`tolerance`: the configured bound; `multiple` x the floor the first probe measures
        raises the tolerance above it; `ceiling`: the largest floor that counts as noise."""
        if not sequences:
            raise ValueError("the weights probe needs at least one sequence of two or more tokens")
        self.sequences = sequences
        self.bound = self.tolerance = tolerance  # the tolerance in force: the bound until calibrated
        self.multiple, self.ceiling = multiple, ceiling
        self.floor: float | None = None  # the noise floor the first probe measured
        self.expected: list[torch.Tensor] | None = None  # per sequence, log-probs of tokens 1..n-1
        self.version: int | None = None  # the weights `expected` is for

    def expect(self, trainer_log_probs: list[torch.Tensor], version: int) -> None:
        """The trainer's log-probs of the sequences (tokens 1..n-1 of each, at temperature 1, as
        the engines answer) for the weights of `version`."""
        if [len(t) for t in trainer_log_probs] != [len(s) - 1 for s in self.sequences]:
            raise ValueError("the trainer's probe log-probs do not cover every scored token of the probe")
        self.expected = [t.float() for t in trainer_log_probs]
        self.version = version

    def calibrate(self, floor: float) -> float:
        """The tolerance in force from the noise `floor` (the largest mean difference of an engine
        holding the trainer's weights): the larger of the bound and `multiple` x the floor."""
        if not floor <= self.ceiling:  # NaN too
            raise ValueError(f"the weights probe's noise floor {floor:.3g} a token is above the ceiling "
                             f"{self.ceiling:.3g}: not noise, other weights")
        self.floor, self.tolerance = floor, max(self.bound, self.multiple * floor)
        return self.tolerance

    async def measure(self, engine) -> list[Mismatch]:
        """How far each engine of `engine` (one, or each of a fleet) is from the trainer."""
        if self.expected is None:
            raise RuntimeError("the weights probe has no trainer log-probs yet (WeightProbe.expect)")
        answers = await engine.probe_log_probs(self.sequences)
        return [self.compare(name, got) for name, got in answers.items()]

    async def mismatches(self, engine) -> list[Mismatch]:
        """The engines of `engine` that disagree with the trainer beyond the tolerance in force;
        [] when all agree. An answer of the wrong shape is a mismatch."""
        return beyond(await self.measure(engine), self.tolerance)

    def compare(self, engine: str, got: Sequence[Sequence[float]]) -> Mismatch:
        """How far `got` (per sequence, log-probs of tokens 1..n-1) is from the trainer's."""
        want_lengths = [len(e) for e in self.expected]
        if [len(g) for g in got] != want_lengths:
            return Mismatch(engine, float("inf"), float("inf"), sum(want_lengths))
        diff = (torch.tensor([x for g in got for x in g], dtype=torch.float64)
                - torch.cat(self.expected).double()).abs()
        return Mismatch(engine, float(diff.mean()), float(diff.max()), diff.numel())


def beyond(found: list[Mismatch], limit: float) -> list[Mismatch]:
    """The mismatches of `found` above `limit` (NaN is one too)."""
    return [m for m in found if not m.mean_abs <= limit]
