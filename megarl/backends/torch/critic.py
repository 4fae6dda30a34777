"""The torch backend's critic: an HF causal LM's transformer with a scalar value head.

values[:, t] is the value of the state just before token t, read from the hidden state at
position t − 1 (the same position whose logits predict token t), so values, log-probs and
advantages share one alignment. Trained with the clipped value loss over mini/micro-batches
(megarl.backends.torch.step). Main entry point: `TorchCritic`.
"""

from __future__ import annotations

import torch

from megarl.algo import value_loss
from megarl.backends.batch import TrainBatch
from megarl.backends.epochs import run_epochs
from megarl.backends.torch.actor import build_optimizer
from megarl.backends.torch.step import accumulate_and_step, check_split
from megarl.config import OptimConfig


class ValueModel(torch.nn.Module):
    """`backbone` (an HF *ForCausalLM) without its LM head, plus Linear(hidden, 1)."""

    def __init__(self, causal_lm: torch.nn.Module):
        super().__init__()
        self.backbone = causal_lm.model
        self.value_head = torch.nn.Linear(causal_lm.config.hidden_size, 1)
        # start from V = 0: early advantages are then the rewards themselves, not noise
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)
        self.value_head.to(next(self.backbone.parameters()))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        values = self.value_head(hidden[:, :-1]).squeeze(-1).float()
        return torch.cat([torch.zeros_like(values[:, :1]), values], dim=1)


class TorchCritic:
    def __init__(self, causal_lm: torch.nn.Module, optim: OptimConfig, *, cliprange_value: float,
                 loss_agg_mode: str = "token-mean", mini_batch_samples: int, micro_batch_samples: int,
                 ppo_epochs: int = 1, total_steps: int = 1, norm_length: int | None = None):
        check_split(mini_batch_samples, micro_batch_samples)
        self.model = ValueModel(causal_lm)
        self.optim_cfg, self.cliprange_value, self.loss_agg_mode = optim, cliprange_value, loss_agg_mode
        self.mini, self.micro, self.epochs, self.norm_length = mini_batch_samples, micro_batch_samples, ppo_epochs, norm_length
        self.optimizer, self.scheduler = build_optimizer(self.model, optim, total_steps)
        self.device = next(self.model.parameters()).device

    def _values(self, batch: TrainBatch) -> torch.Tensor:
        return self.model(batch.input_ids.to(self.device), batch.attention_mask.to(self.device))

    @torch.no_grad()
    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        self.model.eval()
        return torch.cat([self._values(batch.select(slice(i, i + self.micro)))
                          for i in range(0, len(batch), self.micro)]).cpu()

    def update_critic(self, batch: TrainBatch) -> dict[str, float]:
        """Clipped value regression towards batch.returns around batch.values (the values the
        advantages were computed with)."""
        if batch.values is None or batch.returns is None:
            raise ValueError("update_critic needs batch.values and batch.returns")
        self.model.train()
        params = list(self.model.parameters())
        return run_epochs(batch, self.mini, self.epochs, lambda mini: accumulate_and_step(
            params, self.optimizer, self.scheduler, mini, self.micro, self.optim_cfg.grad_clip, self._loss,
            self.norm_length))

    def _loss(self, micro: TrainBatch, counts: dict):
        return value_loss(self._values(micro), micro.values.to(self.device), micro.returns.to(self.device),
                          micro.loss_mask.to(self.device), self.cliprange_value, self.loss_agg_mode, **counts)
