"""The mixture-of-experts metrics of a megatron actor step, as the torch backend logs them.

`actor/moe_aux_loss`: each micro-batch's load-balancing loss summed over the MoE layers, and
`actor/moe_load_max_over_mean`: the most loaded expert's tokens over the mean, averaged over
the MoE layers, each averaged over the micro-batches by their share of the mini-batch's loss
tokens (megarl.backends.moe has the formulas). Forward hooks on megatron's routers see each
micro-batch's router input and padding mask; the router's logits are computed again from the
input there (one small GEMM, without gradients). Layers add up over the pipeline stages and
micro-batches over the data-parallel ranks. Under sequence parallelism each TP rank routes its
share of the tokens and the metrics are TP rank 0's. Main entry point: `MoeMetrics`.
"""

from __future__ import annotations

import torch

from megarl.backends.megatron.collectives import reduce_values
from megarl.backends.moe import load_balancing_loss, load_max_over_mean, routed_counts


class MoeMetrics:
    """with MoeMetrics(chunks, topk, coeff) as m: <the step's forwards>; m.metrics(micros, num_tokens)."""

    def __init__(self, chunks: list[torch.nn.Module], topk: int, coeff: float):
        from megatron.core.transformer.moe.router import TopKRouter

        self.routers = [m for chunk in chunks for m in chunk.modules() if isinstance(m, TopKRouter)]
        self.topk, self.coeff = topk, coeff
        self.calls: dict[int, list[tuple[float, float]]] = {}  # router -> (aux loss, load) per micro-batch
        self._handles = []

    def __enter__(self) -> MoeMetrics:
        for i, router in enumerate(self.routers):
            self._handles.append(router.register_forward_hook(self._hook(i)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, index: int):
        def record(router, args, output) -> None:
            if _in_backward():  # activation recomputation runs the forward again: counted once
                return
            hidden = args[0]
            padding = args[1] if len(args) > 1 else None
            with torch.no_grad():
                logits = router.gating(hidden).reshape(-1, router.config.num_moe_experts)
                real = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device) if padding is None \
                    else ~padding.reshape(-1).to(logits.device)
                aux = float(load_balancing_loss([logits], real, self.topk, self.coeff))
                load = load_max_over_mean(routed_counts([logits], real, self.topk))
            self.calls.setdefault(index, []).append((aux, load))
        return record

    def metrics(self, micros, num_tokens: int) -> dict[str, float]:
        """The step's metrics, the same on every rank (collectives over the PP and DP groups)."""
        from megatron.core import parallel_state

        shares = [float(m.data.loss_mask.sum()) / max(num_tokens, 1) for m in micros]
        aux = load = 0.0
        for calls in self.calls.values():
            if len(calls) != len(micros):
                raise RuntimeError(f"a router ran {len(calls)} forwards for {len(micros)} micro-batches")
            aux += sum(share * a for share, (a, _) in zip(shares, calls))
            load += sum(share * lo for share, (_, lo) in zip(shares, calls))
        totals = reduce_values([aux, load, float(len(self.calls))], parallel_state.get_pipeline_model_parallel_group())
        layers = max(totals[2], 1.0)
        mine = reduce_values([totals[0], totals[1] / layers],
                             parallel_state.get_data_parallel_group(with_context_parallel=True))
        return {"moe_aux_loss": mine[0], "moe_load_max_over_mean": mine[1]}


def _in_backward() -> bool:
    """Whether autograd is running a backward pass (where recomputation runs forwards again)."""
    return torch._C._current_graph_task_id() != -1
