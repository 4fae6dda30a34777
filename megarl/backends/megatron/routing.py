"""Routing replay on megatron's routers (megarl.backends.moe has what it is for).

megatron's top-k routing asks the router's `router_replay` object for the top k (moe_utils
topk_routing_with_score_function), the hook its own RouterReplay uses. megarl puts a
`ReplayedRouting` there on each router of the actor (not of the reference or the critic):
while a micro-batch's routing is set it returns the replayed experts and their scores (the
scores gathered at them: softmax over them, or the pre-softmax probabilities, as megatron's
replay does), otherwise megatron's own top k. A router sees its tokens sequence first
([S, B] flattened; under sequence parallelism its TP rank's share of S), so each
micro-batch's routing is laid out so. Activation recomputation runs a layer's forward again
in the backward pass: those forwards take the micro-batches' routings in the order their
forwards came (1F1B runs the backwards in that order), as RouterReplay's backward list does.

Main entry points: `install_replay`, `replaying`.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from megarl.backends.moe import replay_indices


class ReplayedRouting:
    """One router's replay (router.router_replay): the routing of the micro-batch now in its
    forward, and those whose recomputation in the backward pass is still to come."""

    def __init__(self) -> None:
        self.now: torch.Tensor | None = None  # (tokens, k) long
        self.recompute: deque[torch.Tensor] = deque()

    def set(self, indices: torch.Tensor) -> None:
        self.now = indices
        if torch.is_grad_enabled():
            self.recompute.append(indices)

    def clear(self) -> None:
        self.now = None
        self.recompute.clear()

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        if self.now is None:
            return default_compute_topk(scores, topk, num_groups, group_topk)
        in_backward = torch._C._current_graph_task_id() != -1
        indices = (self.recompute.popleft() if in_backward else self.now).to(scores.device)
        if indices.shape != (scores.shape[0], topk):
            raise ValueError(f"routing replay: routing of shape {tuple(indices.shape)} for {scores.shape[0]} tokens "
                             f"of top-{topk}")
        return scores.gather(1, indices), indices


def _routers(chunk: torch.nn.Module) -> list:
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in chunk.modules() if isinstance(m, TopKRouter)]


# a chunk (as the schedule passes it, wrapped or not) -> its routers that replay; found once per
# chunk, since replay is installed before the first forward and never removed
_REPLAYING: weakref.WeakKeyDictionary[torch.nn.Module, list] = weakref.WeakKeyDictionary()


def _replaying_routers(chunk: torch.nn.Module) -> list:
    if chunk not in _REPLAYING:
        _REPLAYING[chunk] = [r for r in _routers(chunk) if isinstance(r.router_replay, ReplayedRouting)]
    return _REPLAYING[chunk]


def install_replay(chunks: list[torch.nn.Module]) -> None:
    """Give every router of `chunks` (the actor's) a ReplayedRouting."""
    routers = [r for chunk in chunks for r in _routers(chunk)]
    if not routers and not any(getattr(c.config, "num_moe_experts", None) for c in chunks):
        raise ValueError("actor.moe_routing_replay is for a mixture of experts; this model has no routed experts")
    for router in routers:
        if router.config.moe_router_fusion:
            raise ValueError("routing replay needs the unfused router (moe_router_fusion=False)")
        router.router_replay = ReplayedRouting()
    _REPLAYING.clear()  # found again, with these


def routing_for_rank(routed: torch.Tensor, topk: int, moe_layers: list[int], num_layers: int,
                     sequence_share: tuple[int, int] | None = None) -> dict[int, torch.Tensor]:
    """{layer: (tokens, k)} in the order a router sees the tokens ([S, B] flattened), from a
    micro-batch's routing `routed` (B, S, width); `sequence_share` (rank, ranks): under sequence
    parallelism the router has this TP rank's share of S."""
    batch, length = routed.shape[:2]
    per_layer = replay_indices(routed.transpose(0, 1).contiguous(), topk, moe_layers, num_layers)
    if sequence_share is not None:
        rank, ranks = sequence_share
        share = length // ranks * batch
        per_layer = [idx[rank * share:(rank + 1) * share] for idx in per_layer]
    return dict(zip(moe_layers, per_layer))


def _micro_routing(config, routed: torch.Tensor) -> dict[int, torch.Tensor]:
    from megatron.core import parallel_state

    freq = config.moe_layer_freq
    moe_layers = [i for i in range(config.num_layers) if (freq[i] if isinstance(freq, list) else i % freq == 0)]
    tp = parallel_state.get_tensor_model_parallel_world_size()
    share = (parallel_state.get_tensor_model_parallel_rank(), tp) if config.sequence_parallel and tp > 1 else None
    return routing_for_rank(routed, config.moe_router_topk, moe_layers, config.num_layers, share)


_OWN_ROUTING = [False]  # inside routing_by_itself


@contextmanager
def routing_by_itself() -> Iterator[None]:
    """Forwards in it route every token by the model's own routers, replay installed or not (the
    weights probe: its engine side routes by itself too)."""
    _OWN_ROUTING[0] = True
    try:
        yield
    finally:
        _OWN_ROUTING[0] = False


def set_micro_routing(chunk: torch.nn.Module, routed: torch.Tensor | None, *, by_itself: bool = False) -> None:
    """Before `chunk` runs a micro-batch: its routers replay `routed` (a chunk without replay
    installed routes by itself, and any inside routing_by_itself). `by_itself`: this micro-batch
    is routed by the routers themselves (a forward's stand-in, which no engine routed)."""
    routers = _replaying_routers(chunk)
    if not routers or _OWN_ROUTING[0]:
        return
    if by_itself:  # forward-only: nothing to recompute in a backward pass
        for router in routers:
            router.router_replay.now = None
        return
    if routed is None:
        raise ValueError("actor.moe_routing_replay: the batch carries no routed experts from the rollout engine")
    by_layer = _micro_routing(routers[0].config, routed)
    for router in routers:
        router.router_replay.set(by_layer[router.layer_number - 1])


@contextmanager
def replaying(chunks: list[torch.nn.Module]) -> Iterator[None]:
    """A pass of the schedule: the routings set in it are forgotten at its end."""
    try:
        yield
    finally:
        for chunk in chunks:
            for router in _replaying_routers(chunk):
                router.router_replay.clear()
