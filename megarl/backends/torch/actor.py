"""The torch backend's actor: log-probs and PPO / DAPO updates on a plain HF causal LM.

An update walks the batch in mini-batches (one optimizer step each) split into
micro-batches (one forward/backward each). Every loss term is aggregated with the global
token and sequence counts of its mini-batch (megarl.algo.aggregation), so the gradient is
the same however the mini-batch is split. Main entry point: `TorchActor`.
"""

from __future__ import annotations

from functools import partial

import torch

from megarl.backends.batch import TrainBatch
from megarl.backends.epochs import run_epochs
from megarl.backends.loss import actor_loss
from megarl.backends.moe import load_balancing_loss, load_max_over_mean, replay_indices, routed_counts
from megarl.backends.schedule import lr_factor
from megarl.backends.torch.lora import base_model
from megarl.backends.torch.logprobs import token_log_probs
from megarl.backends.torch.routing import replayed_routing
from megarl.backends.torch.step import accumulate_and_step, check_split
from megarl.config import AlgorithmConfig, OptimConfig


def build_optimizer(model: torch.nn.Module, optim: OptimConfig, total_steps: int):
    """AdamW and a LambdaLR (megarl.backends.schedule). Biases and norm weights (1-D) get no
    weight decay, as in megatron's optimizer, so both backends take the same step."""
    decay, plain = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (plain if p.ndim == 1 or name.endswith(".bias") else decay).append(p)
    groups = [{"params": decay, "weight_decay": optim.weight_decay}, {"params": plain, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=optim.lr, betas=tuple(optim.betas),
                                  eps=optim.eps)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_factor, optim, total_steps))


class TorchActor:
    """Actor on one process (CPU or one GPU).

    mini_batch_samples: samples per optimizer step; micro_batch_samples: samples per
    forward/backward; temperature: the rollout temperature (log-probs are taken under it);
    norm_length: the constant of seq-mean-token-sum-norm (the max response length).
    """

    def __init__(self, model: torch.nn.Module, algo: AlgorithmConfig, optim: OptimConfig, *, mini_batch_samples: int,
                 micro_batch_samples: int, ppo_epochs: int = 1, temperature: float = 1.0, total_steps: int = 1,
                 norm_length: int | None = None, moe_aux_loss_coeff: float | None = None,
                 routing_replay: bool = False, share_prompts: bool = False):
        check_split(mini_batch_samples, micro_batch_samples)
        self.model, self.algo, self.optim_cfg = model, algo, optim
        self.mini, self.micro, self.epochs = mini_batch_samples, micro_batch_samples, ppo_epochs
        self.temperature = temperature if temperature > 0 else 1.0
        self.norm_length = norm_length
        self.optimizer, self.scheduler = build_optimizer(model, optim, total_steps)
        self.device = next(model.parameters()).device
        # a mixture of experts: the load-balancing loss (megarl.backends.moe); None = the HF config's coefficient
        self.moe_topk = getattr(model.config, "num_experts_per_tok", 0) or 0
        coeff = getattr(model.config, "router_aux_loss_coef", 0.0) if moe_aux_loss_coeff is None else moe_aux_loss_coeff
        self.moe_aux_loss_coeff = float(coeff or 0.0) if self.moe_topk else 0.0
        if routing_replay and not self.moe_topk:
            raise ValueError("actor.moe_routing_replay is for a mixture of experts; this model has no routed experts")
        self.routing_replay = routing_replay  # the actor's forwards route as the batch's routed_experts say
        self.share_prompts = share_prompts and not self.moe_topk  # megarl.backends.torch.shared_prompts

    @torch.no_grad()
    def compute_log_prob(self, batch: TrainBatch, with_entropy: bool = False, model: torch.nn.Module | None = None,
                         temperature: float | None = None, own_routing: bool = False):
        """(log_probs, entropy or None), each (B, L), in micro-batches, without gradients;
        `model` (e.g. the frozen reference) defaults to the actor's own, `temperature` to the rollout's;
        `own_routing`: the model's routers route, routing replay or not."""
        self.model.eval()
        parts = [self._forward(batch.select(slice(i, i + self.micro)), with_entropy, model, temperature=temperature,
                               own_routing=own_routing)
                 for i in range(0, len(batch), self.micro)]
        log_probs = torch.cat([p[0] for p in parts]).cpu()
        entropy = torch.cat([p[1] for p in parts]).cpu() if with_entropy else None
        return log_probs, entropy

    def _forward(self, batch: TrainBatch, with_entropy: bool, model: torch.nn.Module | None = None,
                 router_logits: list | None = None, temperature: float | None = None, own_routing: bool = False):
        model = model or self.model
        with replayed_routing(model, self._replayed(batch) if model is self.model and not own_routing else None):
            return token_log_probs(model, batch.input_ids.to(self.device), batch.attention_mask.to(self.device),
                                   temperature or self.temperature, with_entropy, router_logits, wanted=batch.loss_mask,
                                   entropy_grad=bool(self.algo.entropy_coeff), share_prompts=self.share_prompts)

    def _replayed(self, batch: TrainBatch) -> list[torch.Tensor] | None:
        """Each MoE layer's replayed experts for `batch`'s tokens (routing replay), or None."""
        if not self.routing_replay:
            return None
        if batch.routed_experts is None:
            raise ValueError("actor.moe_routing_replay: the batch carries no routed experts from the rollout engine")
        cfg = self.model.config
        moe_layers = [i for i, layer in enumerate(base_model(self.model).model.layers) if hasattr(layer.mlp, "experts")]
        return replay_indices(batch.routing().to(self.device), self.moe_topk, moe_layers, cfg.num_hidden_layers)

    def update_actor(self, batch: TrainBatch) -> dict[str, float]:
        """PPO epochs over the batch; needs old_log_probs and advantages. Returns mean metrics."""
        if batch.old_log_probs is None or batch.advantages is None:
            raise ValueError("update_actor needs batch.old_log_probs and batch.advantages")
        if self.algo.use_kl_loss and batch.ref_log_probs is None:
            raise ValueError("algorithm.use_kl_loss needs batch.ref_log_probs")
        self.model.train()
        params = list(self.model.parameters())
        return run_epochs(batch, self.mini, self.epochs, lambda mini: accumulate_and_step(
            params, self.optimizer, self.scheduler, mini, self.micro, self.optim_cfg.grad_clip, self._loss,
            self.norm_length))

    def _loss(self, micro: TrainBatch, counts: dict) -> tuple[torch.Tensor, dict[str, float]]:
        if not self.moe_topk:
            log_probs, entropy = self._forward(micro, with_entropy=True)
            return actor_loss(log_probs, entropy, micro, self.algo, counts)
        routers: list[torch.Tensor] = []
        log_probs, entropy = self._forward(micro, True, router_logits=routers)
        loss, metrics = actor_loss(log_probs, entropy, micro, self.algo, counts)
        real = micro.attention_mask.to(self.device).reshape(-1).bool()
        aux = load_balancing_loss(routers, real, self.moe_topk, self.moe_aux_loss_coeff)
        micro_batches = -(-counts["num_seqs"] // self.micro)
        metrics["moe_aux_loss"] = float(aux.detach())
        metrics["moe_load_max_over_mean"] = load_max_over_mean(routed_counts(routers, real, self.moe_topk))
        return loss + aux / micro_batches, metrics
