"""The rollout engine interface: token ids in, token ids and log-probs out.

Every engine (the embedded `LocalEngine`, an SGLang server reached over HTTP, the SGLang
fleet) implements `RolloutEngine`; the agent loop and the trainer see nothing else.
Requests are async and many may be in flight at once: the engine batches them.

Log-prob convention (the trainer must compare like with like): the log-prob of a sampled
token is log softmax(logits / T) at that token, with T the request's temperature (T = 1
for greedy), before top-p / top-k truncation. The trainer recomputes log-probs with the
same temperature scaling, so the two agree up to numerics.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import torch

from megarl.rollout.token_rows import VersionRuns
from megarl.weights.buckets import WeightBucket

FinishReason = Literal["stop", "length", "abort"]
PREEMPTED = "aborted for a weight update"  # GenerationOutput.message of a generation `abort_requests` ended


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request (names follow SGLang's sampling_params)."""

    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = no top-k
    stop: tuple[str, ...] = ()  # stop strings (kept in the output, like SGLang with no_stop_trim)
    stop_token_ids: tuple[int, ...] = ()  # in addition to the model's EOS ids
    ignore_eos: bool = False
    seed: int | None = None  # per-request seed; None = engine's generator
    # not a sampling parameter: return the experts each token was routed to, from this position
    # of the prompt on (SGLang's return_routed_experts and routed_experts_start_len); None = not
    routed_experts_from: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 0")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} must be -1 (off) or >= 1")
        if isinstance(self.stop, str) or isinstance(self.stop_token_ids, int):
            raise TypeError("stop and stop_token_ids take sequences; wrap a single value in a tuple")
        if self.routed_experts_from is not None and self.routed_experts_from < 0:
            raise ValueError(f"routed_experts_from={self.routed_experts_from} must be >= 0")

    @classmethod
    def from_sglang(cls, params: Mapping | None) -> SamplingParams:
        """Read SGLang's sampling_params JSON; unsupported keys raise (no silent ignoring)."""
        params = dict(params or {})
        stop = params.pop("stop", None) or ()
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        top_k = params.pop("top_k", -1)
        known = {"max_new_tokens", "temperature", "top_p", "stop_token_ids", "ignore_eos", "sampling_seed",
                 "no_stop_trim", "skip_special_tokens", "spaces_between_special_tokens", "n"}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(f"unsupported sampling_params {unknown}; supported: {sorted(known | {'stop', 'top_k'})}")
        if params.get("n", 1) != 1:
            raise ValueError("sampling_params.n must be 1: send one request per sample")
        return cls(
            max_new_tokens=int(params.get("max_new_tokens", 128)),
            temperature=float(params.get("temperature", 1.0)),
            top_p=float(params.get("top_p", 1.0)),
            top_k=-1 if top_k is None or top_k >= 1 << 30 else int(top_k),
            stop=stop,
            stop_token_ids=tuple(params.get("stop_token_ids") or ()),
            ignore_eos=bool(params.get("ignore_eos", False)),
            seed=params.get("sampling_seed"),
        )

    def to_sglang(self) -> dict:
        out = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
               "top_k": self.top_k, "stop": list(self.stop), "stop_token_ids": list(self.stop_token_ids),
               "ignore_eos": self.ignore_eos, "no_stop_trim": True, "skip_special_tokens": False}
        if self.seed is not None:
            out["sampling_seed"] = self.seed
        return out


@dataclass
class GenerationOutput:
    """One sample: the sampled tokens exactly as the engine produced them."""

    token_ids: list[int]
    log_probs: list[float]  # one per token, see the module docstring for the convention
    finish_reason: FinishReason
    matched_stop: int | str | None = None  # the stop id or string that ended it
    weight_version: int = 0  # weights it started with (stale samples can be counted)
    # weights of each token, where the engine reports it (a list, or runs: VersionRuns); None = all weight_version
    token_versions: Sequence[int] | None = None
    prompt_tokens: int = 0
    message: str | None = None  # why it aborted
    meta: dict = field(default_factory=dict)
    # asked for with SamplingParams.routed_experts_from = s: (positions, MoE layers x top-k) int16,
    # row i the experts that the token at position s + i was routed to in each MoE layer, for the
    # positions the engine computed: s .. prompt_tokens + len(token_ids) - 2 (the last token is
    # never an input); fewer rows, or None, where it ended before computing them (aborted waiting)
    routed_experts: torch.Tensor | None = None

    @property
    def preempted(self) -> bool:
        """Ended by `abort_requests` (a weight sync), not by a failure: continue it."""
        return self.finish_reason == "abort" and self.message == PREEMPTED

    def versions(self) -> list[int]:
        """The weight version of each token."""
        return list(self.version_runs())

    def version_runs(self) -> VersionRuns:
        """The weight version of each token, as runs (what a trajectory holds)."""
        if isinstance(self.token_versions, VersionRuns):
            return self.token_versions
        if self.token_versions is not None:
            return VersionRuns(self.token_versions)
        runs = VersionRuns()
        runs.append_run(self.weight_version, len(self.token_ids))
        return runs


@runtime_checkable
class RolloutEngine(Protocol):
    """What the agent loop, the trainer and the weight transports use of a generation engine
    (the embedded `LocalEngine`, a Ray actor's proxy, the SGLang fleet)."""

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput: ...

    async def update_weights(self, buckets: Iterable[WeightBucket], version: int) -> None:
        """Load HF-named tensors bucket by bucket; the next generate uses them."""

    async def begin_weight_update(self) -> None:
        """Before new weights arrive: stop decoding (in-flight requests wait, none is lost)
        and take back the memory the weights need, if it was released."""

    async def end_weight_update(self) -> None:
        """After the new weights are in: drop the stale prefix cache, take back the rest of
        the released memory (KV cache) and resume decoding."""

    async def abort_requests(self) -> None:
        """End every generation in flight now with the tokens it has (finish_reason abort,
        message PREEMPTED), so a weight sync need not wait for it; the caller continues it
        afterwards from those tokens under the new weights (partial rollouts)."""

    async def pause(self) -> None:
        """Stop starting decode steps (in-flight requests wait, none is lost)."""

    async def resume(self) -> None: ...

    async def flush_cache(self) -> None:
        """Drop cached prefixes (after a weight update they are stale)."""

    async def release_memory(self) -> None:
        """After a step's rollouts: free the device memory generation holds, for a trainer on
        the same GPUs (the next `begin_weight_update` takes it back)."""

    async def resume_memory(self) -> None: ...

    async def health(self) -> bool: ...

    async def weight_checksums(self) -> dict[str, str]:
        """{HF name: checksum} of the loaded weights (megarl.weights.buckets.weight_checksums), for sync.verify."""

    async def probe_log_probs(self, sequences: list[list[int]]) -> dict[str, list[list[float]]]:
        """{engine name: per sequence, the log-prob of each token after the first given the ones
        before it (softmax of the raw logits, as SGLang's prompt log-probs)}: each engine of a
        fleet on its own, for the weights probe (megarl.weights.probe)."""

    def metrics(self) -> dict[str, float]:
        """Counters for the step's metrics (restarts, re-sent requests); {} where none."""

    async def close(self) -> None: ...


class PauseAroundUpdates:
    """The weight-update steps of an engine that never gives its memory away (the embedded
    engine, a single server): pause before, flush the cache and resume after; no counters."""

    async def begin_weight_update(self) -> None:
        await self.pause()

    async def end_weight_update(self) -> None:
        await self.flush_cache()
        await self.resume()

    def metrics(self) -> dict[str, float]:
        return {}
