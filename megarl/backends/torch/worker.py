"""The torch backend's TrainWorker: actor, optional frozen reference and critic on one device.

Implements `TrainWorker` (megarl.backends.base: compute_log_prob, compute_values,
update_actor, update_critic, export_hf_weights, save_checkpoint / load_checkpoint), as the
megatron backend's MegatronTrainWorker does. Main entry point: `TorchTrainWorker`.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path

import torch
from safetensors.torch import load_file, load_model, save_file, save_model

from megarl.backends.base import Batch  # a share comes only with its whole batch here: one rank
from megarl.backends.packed import as_rows
from megarl.backends.offload import HostOffloaded
from megarl.backends.rng import rng_state, set_rng_state
from megarl.backends.schedule import optimizer_steps
from megarl.backends.sleep import WorkerSleep
from megarl.backends.torch.actor import TorchActor
from megarl.backends.torch.critic import TorchCritic
from megarl.backends.torch.lora import adapter_state, load_adapter_state, merged_hf_tensors, with_adapters
from megarl.checkpoint import unreadable
from megarl.config import RunConfig
from megarl.weights.buckets import group_tensors, hf_tensors, weight_checksums


ADAPTER_FILE = "actor_adapter.safetensors"  # a LoRA run's actor in a checkpoint: PEFT's names (megarl export reads it)


class TorchTrainWorker:
    def __init__(self, model: torch.nn.Module, cfg: RunConfig, total_steps: int, critic_model: torch.nn.Module | None = None):
        """`total_steps`: the run's training steps (each actor and critic learning-rate schedule
        counts its own optimizer steps: megarl.backends.schedule.optimizer_steps)."""
        a = cfg.algorithm
        samples = cfg.rollout.n
        self.cfg = cfg
        self.lora = cfg.actor.lora.enabled  # the base frozen, PEFT's adapters trained (megarl.backends.torch.lora)
        if cfg.critic.enable and critic_model is None:
            critic_model = copy.deepcopy(model)  # the base, before the adapters go into it
        if self.lora:
            model = with_adapters(model, cfg.actor.lora, seed=cfg.trainer.seed)
        self.actor = TorchActor(
            model, a, cfg.actor.optim, mini_batch_samples=cfg.actor.ppo_mini_batch_size * samples,
            micro_batch_samples=cfg.actor.ppo_micro_batch_size, ppo_epochs=cfg.actor.ppo_epochs,
            temperature=cfg.rollout.temperature,
            total_steps=optimizer_steps(total_steps, cfg.data.train_batch_size, cfg.actor),
            norm_length=cfg.rollout.max_response_length, moe_aux_loss_coeff=cfg.actor.moe_aux_loss_coeff,
            routing_replay=cfg.actor.moe_routing_replay, share_prompts=cfg.actor.share_prompts)
        self.needs_reference = a.use_kl_loss or a.use_kl_in_reward
        # with LoRA the reference is the actor with its adapters off: no copy
        self.reference = (copy.deepcopy(model).eval().requires_grad_(False)
                          if self.needs_reference and not self.lora else None)
        self.reference_weights = None  # HostOffloaded with actor.reference_offload
        if self.reference is not None and cfg.actor.reference_offload:
            self.reference_weights = HostOffloaded([self.reference], next(model.parameters()).device)
        self.critic = None
        if cfg.critic.enable:
            self.critic = TorchCritic(
                critic_model, cfg.critic.optim,
                cliprange_value=cfg.critic.cliprange_value, loss_agg_mode=a.loss_agg_mode,
                mini_batch_samples=cfg.critic.ppo_mini_batch_size * samples,
                micro_batch_samples=cfg.critic.ppo_micro_batch_size, ppo_epochs=cfg.critic.ppo_epochs,
                total_steps=optimizer_steps(total_steps, cfg.data.train_batch_size, cfg.critic),
                norm_length=cfg.rollout.max_response_length)
        self._sleep = WorkerSleep(next(model.parameters()).device)

    # -- TrainWorker ---------------------------------------------------------------------
    @property
    def has_reference(self) -> bool:
        return self.needs_reference

    @property
    def is_export_source(self) -> bool:
        """One process holds the whole model: it sends the weights."""
        return True

    pipeline_stage = 0  # the whole model is one stage

    def save_hf(self, directory: str | Path) -> str:
        """The actor as HF safetensors + config in `directory` (the tokenizer is the caller's); with
        LoRA the merged model."""
        if self.lora:
            merged = dict(merged_hf_tensors(self.actor.model))
            self.actor.model.get_base_model().save_pretrained(directory, state_dict=merged, safe_serialization=True)
        else:
            self.actor.model.save_pretrained(directory, safe_serialization=True)
        return str(directory)

    def data_parallel(self) -> tuple[int, int]:
        """(this rank's data-parallel rank, the data-parallel size): one rank holds everything."""
        return 0, 1

    def compute_log_prob(self, batch: Batch, with_entropy: bool = False, temperature: float | None = None,
                         own_routing: bool = False):
        rows, back = as_rows(batch)
        log_probs, entropy = self.actor.compute_log_prob(rows, with_entropy, temperature=temperature,
                                                         own_routing=own_routing)
        return back(log_probs), (back(entropy) if entropy is not None else None)

    def compute_ref_log_prob(self, batch: Batch) -> torch.Tensor:
        if not self.needs_reference:
            raise RuntimeError("no reference model: turn on algorithm.use_kl_loss or use_kl_in_reward")
        rows, back = as_rows(batch)
        if self.lora:  # the base: the actor's own model with its adapters off
            with self.actor.model.disable_adapter():
                return back(self.actor.compute_log_prob(rows, own_routing=True)[0])
        with self.reference_weights.on_device() if self.reference_weights else nullcontext():
            return back(self.actor.compute_log_prob(rows, model=self.reference)[0])

    def compute_values(self, batch: Batch) -> torch.Tensor:
        if self.critic is None:
            raise RuntimeError("no critic: set critic.enable=true")
        rows, back = as_rows(batch)
        return back(self.critic.compute_values(rows))

    def update_actor(self, batch: Batch) -> dict[str, float]:
        return self.actor.update_actor(as_rows(batch)[0])

    def update_critic(self, batch: Batch) -> dict[str, float]:
        if self.critic is None:
            raise RuntimeError("no critic: set critic.enable=true")
        return self.critic.update_critic(as_rows(batch)[0])

    def sleep(self, keep_weights: bool = False) -> float:
        """Optimizer states, gradients and the reference off the device, then the weights unless
        `keep_weights` (megarl.backends.sleep.WorkerSleep)."""
        parts = [self.actor] + ([self.critic] if self.critic is not None else [])
        # an offloaded reference is on the host already
        frozen = [self.reference] if self.reference is not None and self.reference_weights is None else []
        return self._sleep.sleep([p.model for p in parts], [p.optimizer for p in parts], frozen, keep_weights)

    def wake(self, weights_only: bool = False) -> float:
        return self._sleep.wake(weights_only)

    def export_hf_weights(self, bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
        """The actor's HF-named tensors in buckets of about `bucket_bytes` (megarl.weights.buckets)."""
        return group_tensors(self._hf_tensors(), bucket_bytes)

    def weight_checksums(self) -> dict[str, str]:
        return weight_checksums(self._hf_tensors())

    def _hf_tensors(self):
        """The weights the engines get, by HF names: with LoRA, the adapters merged into the base, or
        with actor.lora.sync=adapter the adapters alone (PEFT's names)."""
        if self.lora and self.cfg.actor.lora.sync == "adapter":
            return iter(adapter_state(self.actor.model).items())
        return merged_hf_tensors(self.actor.model) if self.lora else hf_tensors(self.actor.model)

    def save_checkpoint(self, directory: str | Path) -> None:
        """Weights as safetensors; optimizer, scheduler and RNG states as tensor-only files
        that load with torch.load(weights_only=True)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        parts = {"actor": self.actor}
        if self.critic is not None:
            parts["critic"] = self.critic
        for name, part in parts.items():
            if name == "actor" and self.lora:  # the adapters alone: the base is model.path's, frozen
                save_file(adapter_state(part.model), str(directory / ADAPTER_FILE))
            else:
                save_model(part.model, str(directory / f"{name}.safetensors"))  # stores tied weights once
            torch.save({"optimizer": part.optimizer.state_dict(), "scheduler": part.scheduler.state_dict()},
                       directory / f"{name}_optim.pt")
        torch.save(rng_state(), directory / "rng.pt")

    def load_checkpoint(self, directory: str | Path) -> None:
        directory = Path(directory)
        parts = {"actor": self.actor}
        if self.critic is not None:
            parts["critic"] = self.critic
        for name, part in parts.items():
            adapters = name == "actor" and self.lora
            weights = directory / (ADAPTER_FILE if adapters else f"{name}.safetensors")
            missing = [f.name for f in (weights, directory / f"{name}_optim.pt") if not f.exists()]
            if missing:
                raise FileNotFoundError(f"checkpoint {directory} lacks {missing}; was it written by another config "
                                        f"(actor.lora.r={self.cfg.actor.lora.r} here)?")
            if adapters:
                load_adapter_state(part.model, _read_tensors(weights), str(weights))
            else:
                absent, unexpected = _read_weights(part.model, weights)
                if absent or unexpected:  # load_model already left out the tied copies
                    raise ValueError(f"checkpoint {weights} does not match the model: "
                                     f"missing {sorted(absent)[:5]}, unexpected {sorted(unexpected)[:5]}")
            state = _read_state(directory / f"{name}_optim.pt")
            part.optimizer.load_state_dict(state["optimizer"])
            part.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(_read_state(directory / "rng.pt"))


# A file that cannot be parsed is named in one line instead of the reader's traceback (a
# checkpoint recording sizes and hashes has been verified before; older ones get here).
def _read_weights(model: torch.nn.Module, path: Path):
    from safetensors import SafetensorError

    try:
        return load_model(model, str(path), strict=False)
    except SafetensorError as e:
        raise unreadable(path, e) from None


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError

    try:
        return load_file(str(path))
    except SafetensorError as e:
        raise unreadable(path, e) from None


def _read_state(path: Path):
    try:
        return torch.load(path, weights_only=True)
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError) as e:
        raise unreadable(path, e) from None
