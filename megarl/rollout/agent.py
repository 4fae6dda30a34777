"""Multi-turn tool-calling rollouts (Search-R1 and any set of tools) and plain single-turn
rollouts, token-exact.

One trajectory: the model generates until a tool call closes (`</search>`, `</calculator>`,
`</tool_call>`: megarl.tools.base.ToolSet), `</answer>` or EOS; a call is answered with the
tool's observation as observation tokens (masked out of the loss); an answer ends the
trajectory; anything else gets Search-R1's invalid-action message and another turn (with
the chat template's tool calls, a turn without a call is the reply and ends it). After
`max_turns` turns a last turn runs without tools. `max_turns=0` is single-turn generation
(DAPO math) through the same path.

Tokens, not text, are carried: each turn's prompt is the prompt ids plus the response ids so
far, exactly as sampled, so nothing is re-tokenized (text is decoded only to read actions).
Trajectories run independently as asyncio tasks, so one that answers early frees its engine
slot at once. Main entry points: `run_trajectory`, `run_trajectories`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from functools import lru_cache

import torch

from megarl.data.tokenizer import rust_backend
from megarl.rollout.engine import GenerationOutput, RolloutEngine, SamplingParams
from megarl.rollout.token_rows import TokenRow, VersionRuns, token_row
from megarl.tools.base import Observation, ToolSet
from megarl.tools.search import (INVALID_ACTION_MESSAGE, SEARCH_INSTRUCTION, Searcher, SearchTool,
                                 build_search_prompt, format_observation)

__all__ = ["INVALID_ACTION_MESSAGE", "SEARCH_INSTRUCTION", "AgentSettings", "Trajectory", "build_search_prompt", "format_observation",
           "run_trajectories", "run_trajectory"]


@dataclass(frozen=True)
class AgentSettings:
    max_turns: int = 0  # turns that may call a tool; 0 = single-turn
    max_turn_length: int = 500  # tokens generated per turn
    max_obs_length: int = 500  # observation tokens kept per tool call
    max_response_length: int = 4096  # all response tokens of a trajectory (model + observations)
    topk: int = 3  # documents per search, where a Searcher stands for the tools
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    routed_experts: bool = False  # ask the engine for every token's experts (routing replay)


@dataclass
class Trajectory:
    prompt_ids: list[int]
    response_ids: TokenRow = field(default_factory=lambda: TokenRow("i"))
    loss_mask: TokenRow = field(default_factory=lambda: TokenRow("b"))  # 1 = model token, 0 = observation
    rollout_log_probs: TokenRow = field(default_factory=lambda: TokenRow("f"))  # float32; 0.0 on observations
    token_versions: VersionRuns = field(default_factory=VersionRuns)  # weights of each token (observations: the turn's last)
    num_turns: int = 0
    tool_calls: dict[str, int] = field(default_factory=dict)  # calls by tool name
    tool_failures: dict[str, int] = field(default_factory=dict)  # of those, the failed (errors, timeouts)
    tool_seconds: dict[str, float] = field(default_factory=dict)  # their time, by tool
    num_valid_actions: int = 0
    finish_reason: str = ""  # answer | eos | length | max_turns | abort
    weight_version: int = 0  # the weights its first token came from
    num_continued: int = 0  # generations a weight sync preempted and that went on from their tokens
    routed_experts: list[torch.Tensor] = field(default_factory=list)  # the engine's routing, by turn

    def __post_init__(self):
        self.response_ids, self.loss_mask = token_row("i", self.response_ids), token_row("b", self.loss_mask)
        self.rollout_log_probs = token_row("f", self.rollout_log_probs)
        if not isinstance(self.token_versions, VersionRuns):
            self.token_versions = VersionRuns(self.token_versions)

    @property
    def num_searches(self) -> int:
        return self.tool_calls.get(SearchTool.name, 0)

    @property
    def num_failed_searches(self) -> int:
        return self.tool_failures.get(SearchTool.name, 0)

    def count_call(self, observation: Observation) -> None:
        name = observation.tool
        self.tool_calls[name] = self.tool_calls.get(name, 0) + 1
        self.tool_failures[name] = self.tool_failures.get(name, 0) + observation.failed
        self.tool_seconds[name] = self.tool_seconds.get(name, 0.0) + observation.seconds

    @property
    def routed_rows(self) -> int:
        """Positions whose routing the trajectory holds (from position 0 on)."""
        return sum(r.shape[0] for r in self.routed_experts)

    def routing(self) -> torch.Tensor | None:
        """(positions, width) the experts of every token but the last, or None when not asked for.
        The turns' parts are joined once, in place: a single part is returned as it is."""
        if len(self.routed_experts) > 1:
            self.routed_experts = [torch.cat(self.routed_experts)]
        return self.routed_experts[0] if self.routed_experts else None

    def extend(self, ids: list[int], log_probs: list[float] | None, versions: list[int] | None = None,
               routed: torch.Tensor | None = None) -> None:
        if routed is not None:
            self.routed_experts.append(routed)
        self.response_ids.extend(ids)
        self.loss_mask.extend([1 if log_probs is not None else 0] * len(ids))
        self.rollout_log_probs.extend(log_probs if log_probs is not None else [0.0] * len(ids))
        if versions is not None:
            self.token_versions.extend(versions)
        else:  # the version of the token before (an observation: the turn's last)
            self.token_versions.append_run(self.token_versions[-1] if self.token_versions else self.weight_version,
                                           len(ids))


def text_of(tokenizer, ids) -> str:
    """`tokenizer.decode(ids)`, through its Rust backend where that is the same (rust_backend)."""
    backend = rust_backend(tokenizer)
    return tokenizer.decode(ids) if backend is None else backend.decode(ids, skip_special_tokens=False)


def ids_of(tokenizer, text: str) -> list[int]:
    """`tokenizer.encode(text, add_special_tokens=False)`, through its Rust backend where that is the same."""
    backend = rust_backend(tokenizer, encoding=True)
    return tokenizer.encode(text, add_special_tokens=False) if backend is None else \
        backend.encode(text, add_special_tokens=False).ids


@lru_cache(maxsize=8)  # a run holds one or two tokenizers; each is asked once per tool call
def longest_token_chars(tokenizer) -> int:
    """At most how many characters one token of `tokenizer` decodes to: its longest vocabulary
    entry (a byte-level BPE entry has a character per byte, a SentencePiece or WordPiece entry
    no fewer characters than its text)."""
    return max(max(map(len, tokenizer.get_vocab()), default=1), 1)


def observation_ids(tokenizer, text: str, max_tokens: int) -> list[int]:
    """The first `max_tokens` tokens of a tool's output. The text is cut first, past what that
    many tokens (and 8 more) can span, so a huge output (a 10 MB page) is never tokenized whole:
    the tokens kept are those of the whole text but where a single word runs across the cut."""
    limit = (max_tokens + 8) * longest_token_chars(tokenizer)
    return ids_of(tokenizer, text[:limit])[:max_tokens]


async def run_trajectory(engine: RolloutEngine, tokenizer, prompt_ids: list[int], settings: AgentSettings,
                         tools: ToolSet | Searcher | None = None, seed: int | None = None) -> Trajectory:
    """Roll out one trajectory (see the module docstring). `tools`: the run's ToolSet, or a
    Searcher alone (Search-R1's one search tool)."""
    if tools is not None and not isinstance(tools, ToolSet):
        tools = ToolSet([SearchTool(tools, topk=settings.topk)])
    if settings.max_turns > 0 and tools is None:
        raise ValueError("max_turns > 0 needs tools (agent.tools) for the model to call")
    traj = Trajectory(prompt_ids=list(prompt_ids))
    single_turn = settings.max_turns == 0
    for turn in range(settings.max_turns + 1):
        final = turn == settings.max_turns
        budget = settings.max_response_length - len(traj.response_ids)
        if budget <= 0:
            traj.finish_reason = "length"
            if settings.routed_experts:
                await route_to_the_end(engine, traj)
            return traj
        params = SamplingParams(
            max_new_tokens=budget if single_turn else min(settings.max_turn_length, budget),
            temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k,
            stop=() if single_turn else tools.stop_strings(final),
            seed=None if seed is None else seed + turn,
            routed_experts_from=traj.routed_rows if settings.routed_experts else None,
        )
        out = await generate_continued(engine, tokenizer, traj.prompt_ids + traj.response_ids, params, traj)
        if turn == 0:
            traj.weight_version = out.weight_version
        traj.extend(out.token_ids, out.log_probs, out.version_runs(), out.routed_experts)
        traj.num_turns += 1
        if out.finish_reason == "abort":
            traj.finish_reason = "abort"
            return traj
        if single_turn:
            traj.finish_reason = "eos" if out.finish_reason == "stop" else "length"
            return traj
        action = tools.parse(text_of(tokenizer, out.token_ids))
        if action.kind == "answer":
            traj.num_valid_actions += 1
            traj.finish_reason = "answer"
            return traj
        if action.kind == "reply":  # tool_call format: a turn that calls nothing is the model's reply
            traj.finish_reason = "eos" if out.finish_reason == "stop" else "length"
            return traj
        if final:
            traj.finish_reason = "max_turns"
            return traj
        if action.kind == "call":
            traj.num_valid_actions += not action.error
            result = await tools.run(action)
            traj.count_call(result)
            observation = observation_ids(tokenizer, result.text, settings.max_obs_length)
        else:
            observation = ids_of(tokenizer, tools.invalid_message())
        room = settings.max_response_length - len(traj.response_ids)
        traj.extend(observation[:room], None)
    return traj  # not reached: the last turn always returns


async def route_to_the_end(engine: RolloutEngine, traj: Trajectory) -> None:
    """Routing replay: a trajectory that ends on an observation has no routing for its last
    generated token and the observation (no forward pass of the engine ran over them, and the
    trainer replays a routing for every position but the last). One prefill of the whole
    sequence computes them; its one generated token is dropped."""
    have, need = traj.routed_rows, len(traj.prompt_ids) + len(traj.response_ids) - 1
    if have >= need:
        return
    out = await engine.generate(traj.prompt_ids + list(traj.response_ids),
                                SamplingParams(max_new_tokens=1, temperature=0.0, routed_experts_from=have))
    if out.routed_experts is None or out.routed_experts.shape[0] < need - have:
        got = 0 if out.routed_experts is None else out.routed_experts.shape[0]
        raise ValueError(f"the engine's prefill for the routing of a trajectory's last {need - have} positions "
                         f"answered {got} rows ({out.finish_reason}: {out.message})")
    traj.routed_experts.append(out.routed_experts[: need - have])


async def generate_continued(engine: RolloutEngine, tokenizer, prompt_ids: list[int], params: SamplingParams,
                             traj: Trajectory) -> GenerationOutput:
    """One turn's generation. One that a weight sync preempted (GenerationOutput.preempted) goes
    on from its tokens under the new weights until it ends: every token is kept once, with the
    log-prob and version of the weights that sampled it (partial rollouts); the routing asked for
    goes on from the positions the parts before computed."""
    out = await engine.generate(prompt_ids, params)
    parts = [out]
    while out.preempted and sum(len(p.token_ids) for p in parts) < params.max_new_tokens:
        traj.num_continued += 1
        done = [t for p in parts for t in p.token_ids]
        seed = None if params.seed is None else params.seed + 1_000_003 * len(parts)
        routed = None if params.routed_experts_from is None else params.routed_experts_from + sum(
            _rows(p) for p in parts)
        out = await engine.generate(prompt_ids + done, replace(params, max_new_tokens=params.max_new_tokens - len(done),
                                                              seed=seed, routed_experts_from=routed))
        parts.append(out)
    if len(parts) == 1:
        return out
    routing = [p.routed_experts for p in parts if p.routed_experts is not None]
    whole = GenerationOutput(
        token_ids=[t for p in parts for t in p.token_ids], log_probs=[x for p in parts for x in p.log_probs],
        finish_reason="length" if out.preempted else out.finish_reason, matched_stop=out.matched_stop,
        weight_version=parts[0].weight_version, token_versions=[v for p in parts for v in p.versions()],
        prompt_tokens=len(prompt_ids), message=None if out.preempted else out.message,
        routed_experts=torch.cat(routing) if routing else None)
    return _stop_across_parts(whole, [len(p.token_ids) for p in parts], params, tokenizer)


def _rows(out: GenerationOutput) -> int:
    return 0 if out.routed_experts is None else out.routed_experts.shape[0]


def _stop_across_parts(out: GenerationOutput, lengths: list[int], params: SamplingParams,
                       tokenizer) -> GenerationOutput:
    """A stop string split across two parts (the engine saw each part's tail only) ends the
    generation where it completes, as one uninterrupted generation would have."""
    if not params.stop or out.finish_reason == "stop":
        return out
    longest = max(len(s) for s in params.stop)
    boundary = 0
    for length in lengths[:-1]:
        boundary += length
        for end in range(boundary + 1, min(boundary + longest + 1, len(out.token_ids) + 1)):
            tail = tokenizer.decode(out.token_ids[max(end - longest - 2, 0):end])
            matched = next((s for s in params.stop if s in tail), None)
            if matched is not None:
                routed = out.routed_experts
                if routed is not None:  # every position but the new last token's
                    routed = routed[: out.prompt_tokens + end - 1 - params.routed_experts_from]
                return replace(out, token_ids=out.token_ids[:end], log_probs=out.log_probs[:end],
                               token_versions=out.token_versions[:end], finish_reason="stop", matched_stop=matched,
                               routed_experts=routed)
    return out


async def run_trajectories(engine: RolloutEngine, tokenizer, prompts: list[list[int]], settings: AgentSettings,
                           tools: ToolSet | Searcher | None = None, seeds: list[int] | None = None) -> list[Trajectory]:
    """All trajectories concurrently; each goes at its own pace (no lockstep between turns)."""
    seeds = seeds if seeds is not None else [None] * len(prompts)
    return await asyncio.gather(*[run_trajectory(engine, tokenizer, p, settings, tools, s)
                                  for p, s in zip(prompts, seeds)])
