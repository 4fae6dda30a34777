"""From rollouts to a training batch: rewards, overlong shaping, advantages.

The steps of the data flow (docs/architecture.md) between "rollout" and "update", as small functions the
training loop calls in order, and the step's gate (sync.probe.gate: `on_policy_tokens`, `gate`).
Main entry points: `reward_requests`, `shape_overlong`, `to_train_batch`, `compute_advantages`, `gate`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from megarl.algo import AdvantageEstimator, advantage_estimator, kl_penalty, overlong_penalty, scores_to_token_rewards
from megarl.algo.registry import SIGNATURES
from megarl.backends.batch import TrainBatch
from megarl.backends.packed import PackedBatch
from megarl.config import AlgorithmConfig
from megarl.data.prompts import PromptRecord
from megarl.data.tokenizer import rust_backend
from megarl.reward import RewardRequest
from megarl.reward.scoring import characters_read
from megarl.reward.settings import RewardConfig
from megarl.rollout.agent import Trajectory


@dataclass
class Sample:
    """One rollout of one prompt; `group` is the prompt group's uid."""

    record: PromptRecord
    group: int
    trajectory: Trajectory
    score: float = 0.0
    acc: bool = False


def reward_requests(samples: list[Sample], tokenizer, reward: RewardConfig | None = None) -> list[RewardRequest]:
    """Score the whole response text (model turns and observations, as Search-R1 does). With the
    run's `reward` settings, a response whose scoring reads only its last characters
    (`megarl.reward.scoring.characters_read`: DAPO's math reward, 300) is decoded from its last
    tokens, to those characters: a DAPO step's responses are 100 million tokens."""
    read = {} if reward is None else {d: characters_read(reward, d) for d in {s.record.data_source for s in samples}}
    tails = [read.get(s.record.data_source) for s in samples]
    whole = [i for i, n in enumerate(tails) if n is None]
    texts: list[str] = [""] * len(samples)
    for i, text in zip(whole, decode_all(tokenizer, [samples[i].trajectory.response_ids for i in whole])):
        texts[i] = text
    for chars in {n for n in tails if n is not None}:
        part = [i for i, n in enumerate(tails) if n == chars]
        for i, text in zip(part, decode_tails(tokenizer, [samples[i].trajectory.response_ids for i in part], chars)):
            texts[i] = text
    return [RewardRequest(s.record.data_source, text, s.record.ground_truth, s.record.extra_info, group_id=s.group,
                          response_length=len(s.trajectory.response_ids))
            for s, text in zip(samples, texts)]


def decode_all(tokenizer, rows: list) -> list[str]:
    """Each row's text as `tokenizer.decode(row, skip_special_tokens=True)` gives it. A fast
    tokenizer without HF's clean-up of spaces (Qwen's) decodes them in one call to its Rust
    backend, on every core and 7x faster on one than a decode a row: a step at a recipe's size is
    100 million tokens. Others decode row by row, as HF does."""
    backend = rust_backend(tokenizer)
    if backend is None:
        return [tokenizer.decode(row, skip_special_tokens=True) for row in rows]
    return backend.decode_batch(rows, skip_special_tokens=True)


TAIL_MARGIN_CHARS = 16  # past what a cut between tokens can change: half a character, a space a decoder strips


def decode_tails(tokenizer, rows: list, chars: int) -> list[str]:
    """`decode_all(tokenizer, rows)`, each text's last `chars` characters, decoded from as few of
    each row's last tokens as give `chars` + TAIL_MARGIN_CHARS characters (doubled until they
    do, or the row is whole). A cut between two tokens changes the start of a text only (bytes of
    a character cut in two, a leading space a decoder drops), never its end."""
    texts: list[str] = [""] * len(rows)
    todo, take = list(range(len(rows))), chars + TAIL_MARGIN_CHARS
    while todo:
        decoded = decode_all(tokenizer, [rows[i][-take:] for i in todo])
        for i, text in zip(todo, decoded):
            texts[i] = text[-chars:]
        todo = [i for i, text in zip(todo, decoded) if len(text) < chars + TAIL_MARGIN_CHARS and len(rows[i]) > take]
        take *= 2
    return texts


def shape_overlong(scores: list[float], lengths: list[int], max_response_length: int, algo: AlgorithmConfig) -> list[float]:
    """DAPO soft overlong punishment added to each score (when algorithm.overlong.enable):
    the one place a run applies it, once, after the reward (it is no reward component)."""
    o = algo.overlong
    if not o.enable:
        return list(scores)
    return [s + overlong_penalty(n, max_response_length, o.buffer_len, o.penalty_factor)
            for s, n in zip(scores, lengths)]


def to_train_batch(samples: list[Sample], routed_experts: bool = False) -> PackedBatch:
    """The samples' rows, packed; with `routed_experts` (routing replay) the engines' routing too."""
    t = [s.trajectory for s in samples]
    return PackedBatch.from_sequences([x.prompt_ids for x in t], [x.response_ids for x in t], [x.loss_mask for x in t],
                                      rollout_log_probs=[x.rollout_log_probs for x in t],
                                      routed_experts=[x.routing() for x in t] if routed_experts else None)


def compute_advantages(batch: PackedBatch, scores: list[float], groups: list[int], algo: AlgorithmConfig,
                       ref_log_probs: torch.Tensor | None = None,
                       old_log_probs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(advantages, returns, metrics), each tensor (N,) aligned with the packed batch's tokens,
    zero off the loss mask, by the estimator algorithm.adv_estimator names (megarl.algo.registry).

    An outcome estimator's one value per sequence is broadcast over its loss tokens (returns
    are the advantages, the same tensor); a token estimator runs on the rows padded, with the
    score on the last loss token, minus a per-token KL penalty when algorithm.use_kl_in_reward.
    """
    estimator = advantage_estimator(algo.adv_estimator)
    scores_t = torch.tensor(scores, dtype=torch.float32)
    groups_t = torch.tensor(groups)
    if estimator.kind == "outcome":
        per_seq = estimator.fn(scores_t, groups_t, algo)
        _check_shape(estimator, "advantages", per_seq, scores_t.shape)
        advantages = per_seq.repeat_interleave(batch.lengths).masked_fill_(~batch.loss_mask, 0.0)
        return advantages, advantages, {}
    padded = replace(batch.only("values"), routed_experts=None, ref_log_probs=ref_log_probs,
                     old_log_probs=old_log_probs).padded()
    advantages, returns, metrics = _token_advantages(estimator, padded, scores_t, groups_t, algo)
    return batch.pack(advantages), batch.pack(returns), metrics


def _token_advantages(estimator: AdvantageEstimator, batch: TrainBatch, scores_t: torch.Tensor, groups_t: torch.Tensor,
                      algo: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """A token estimator on (B, L) rows, given the token rewards."""
    mask = batch.loss_mask.float()
    metrics: dict[str, float] = {}
    rewards = scores_to_token_rewards(scores_t, batch.loss_mask)
    if algo.use_kl_in_reward:
        if batch.ref_log_probs is None or batch.old_log_probs is None:
            raise ValueError("algorithm.use_kl_in_reward needs reference and old log-probs")
        kl = kl_penalty(batch.old_log_probs, batch.ref_log_probs, algo.kl_reward_type) * mask
        rewards = rewards - algo.kl_reward_coef * kl
        metrics["kl_in_reward"] = float(kl.sum() / mask.sum().clamp_min(1))
    advantages, returns = estimator.fn(batch, rewards, scores_t, groups_t, algo)
    _check_shape(estimator, "advantages", advantages, rewards.shape)
    _check_shape(estimator, "returns", returns, rewards.shape)
    return advantages, returns, metrics


def _check_shape(estimator: AdvantageEstimator, what: str, tensor, shape: torch.Size) -> None:
    if not isinstance(tensor, torch.Tensor) or tensor.shape != shape:
        found = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(f"advantage estimator {estimator.name!r} ({estimator.kind}) returned {what} of shape {found}, "
                         f"expected {tuple(shape)}: {SIGNATURES[estimator.kind]}")


class EnginesDisagree(RuntimeError):
    """The step's samples were generated with other weights than the trainer's (sync.probe.gate)."""


def on_policy_tokens(samples: list[Sample], batch: PackedBatch, step: int) -> torch.Tensor:
    """(N,) over the batch's tokens: True where a token is trained on (loss mask) and was sampled
    with the trainer's current weights (version `step`), the tokens whose log-probs must agree."""
    out = torch.zeros(batch.num_tokens, dtype=torch.bool)
    for row_start, length, sample in zip(batch.starts().tolist(), batch.lengths.tolist(), samples):
        response_start = row_start + length - len(sample.trajectory.response_ids)
        for version, start, end in sample.trajectory.token_versions.runs():
            if version == step:
                out[response_start + start: response_start + end] = True
    return out & batch.loss_mask


def gate(differ: torch.Tensor, on_policy: torch.Tensor, bound: float, metrics: dict) -> None:
    """sync.probe.gate: EnginesDisagree when the mean |trainer - engine| log-prob over the
    `on_policy` tokens is above `bound`; nothing to judge (no such token) passes, counted."""
    count = int(on_policy.sum())
    metrics["rollout/gate_tokens"] = count
    if not count:
        return
    mismatch = float(differ[on_policy].mean())
    metrics["rollout/logprob_mismatch_on_policy"] = mismatch
    if not mismatch <= bound:  # NaN fails too
        raise EnginesDisagree(f"the engines' log-probs of the {count} tokens they sampled with the trainer's weights "
                              f"differ from the trainer's by {mismatch:.3g} a token (sync.probe.gate_bound={bound:.3g})")
