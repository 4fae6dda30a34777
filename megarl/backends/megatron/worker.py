"""The megatron backend's TrainWorker: one rank of an SPMD group.

Every rank of the group (tensor x pipeline x context x data parallel) runs the same method
with the same arguments at the same time (`megarl.runtime` calls them all and answers with
rank 0's result); results are equal on every rank. Each data-parallel rank computes its
share of the rows and the shares are gathered, so the caller hands every rank the whole batch.

Parts: the actor (GPTModel + distributed optimizer), an optional frozen reference (a second
copy of the initial weights, no optimizer) and an optional critic (`megatron.critic`), all
in the same layout. Checkpoints are megatron distributed checkpoints (dist_checkpointing:
weights and optimizer state, reshardable onto another TP/PP/DP layout) plus each rank's RNG
state. Main entry point: `MegatronTrainWorker`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from megarl.backends.base import Batch
from megarl.backends.batch import TrainBatch
from megarl.backends.epochs import mean_metrics, run_epochs
from megarl.backends.packed import DataShare, PackedBatch, as_rows
from megarl.backends.megatron.lora import add_adapters as add_lora
from megarl.backends.megatron.optim_state import load_optimizer_state, model_key, sharded_state
from megarl.backends.megatron.routing import install_replay
from megarl.backends.offload import HostOffloaded
from megarl.backends.rng import rng_state, set_rng_state
from megarl.backends.schedule import lr_factor, optimizer_steps
from megarl.backends.sleep import WorkerSleep
from megarl.config import RunConfig, TrainWorkerConfig
from megarl.models import ModelSpec
from megarl.models.hf_files import copy_config_and_tokenizer
from megarl.weights.buckets import group_tensors, weight_checksums

log = logging.getLogger(__name__)


def layout_of(worker: TrainWorkerConfig, impl: str):
    """The Layout of a worker config. Sequence parallelism is on with TP > 1 where asked, and
    needs Transformer Engine's layers (megatron's local spec has no sequence-parallel norms);
    it saves activation memory and changes no result."""
    from megarl.backends.megatron.model import Layout

    p = worker.parallel
    sequence_parallel = p.sequence_parallel and p.tensor_model_parallel_size > 1
    if sequence_parallel and impl == "local":
        log.info("sequence parallelism is off: megatron's local layer spec does not support it")
        sequence_parallel = False
    return Layout(tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size, cp=p.context_parallel_size,
                  vpp=p.virtual_pipeline_model_parallel_size, sequence_parallel=sequence_parallel,
                  ep=p.expert_model_parallel_size, etp=p.expert_tensor_parallel_size)


def build_options(worker: TrainWorkerConfig, dtype: str) -> dict:
    """build_model's keyword arguments for a worker config: dtype, layer implementation,
    recomputation, FP8 fields passed through to Transformer Engine, and whether attention
    gets masks of its own (sequences packed on the local layers)."""
    from megarl.backends.megatron.layers import resolve_impl

    fp8 = None
    if worker.fp8:
        fp8 = {"fp8": worker.fp8, "fp8_recipe": worker.fp8_recipe, "fp8_param": worker.fp8_param_gather}
    impl = resolve_impl(worker.transformer_impl, worker.fp8)
    return {"dtype": dtype, "impl": impl, "recompute": "full" if worker.gradient_checkpointing else None, "fp8": fp8,
            "explicit_mask": micro_batching(worker, impl)["packing"] == "mask",
            "aux_loss_coeff": worker.moe_aux_loss_coeff}


def micro_batching(worker: TrainWorkerConfig, impl: str) -> dict:
    """How a worker cuts its batches: the keyword arguments of `split_batch`. Context
    parallelism does not split THD-packed sequences (yet): there rows are padded."""
    from megarl.backends.megatron.forward import packing_for

    packing = packing_for(worker.pack_sequences, impl)
    if packing == "thd" and worker.parallel.context_parallel_size > 1:
        log.info("context parallelism: sequences are not packed (padded rows are split over the CP ranks)")
        packing = None
    return {"micro_batch_size": worker.ppo_micro_batch_size, "max_tokens": worker.max_tokens_per_gpu,
            "packing": packing}


@dataclass
class _Part:
    """A trained model (actor or critic) on this rank."""
    chunks: list[torch.nn.Module]  # the GPTModel chunks
    model: list[torch.nn.Module]  # the same, DDP-wrapped
    optimizer: object
    cfg: TrainWorkerConfig
    batching: dict  # split_batch's keyword arguments
    steps: int = 0  # optimizer steps taken (the LR schedule's position)

    def lr(self, run: RunConfig, total_steps: int) -> float:
        """The learning rate of its next optimizer step; `total_steps`: the run's training steps."""
        optimizer_total = optimizer_steps(total_steps, run.data.train_batch_size, self.cfg)
        return self.cfg.optim.lr * lr_factor(self.cfg.optim, optimizer_total, self.steps)


class MegatronTrainWorker:
    """torch.distributed must be initialised (gloo on CPU, NCCL on GPUs) before this is built."""

    def __init__(self, cfg: RunConfig, total_steps: int):
        from megarl.backends.megatron.critic import VALUE_HEAD, build_critic
        from megarl.backends.megatron.model import build_model, free_master_sources, initialize, load_hf_weights
        from megarl.backends.megatron.step import wrap_for_training

        self.cfg, self.total_steps = cfg, total_steps
        self.spec = ModelSpec.from_hf(cfg.model.path)
        options = build_options(cfg.actor, cfg.model.dtype)
        self.layout = layout_of(cfg.actor, options["impl"])
        self.layout.check(self.spec, torch.distributed.get_world_size())
        initialize(self.layout, seed=cfg.trainer.seed)
        a, samples = cfg.algorithm, cfg.rollout.n
        self.temperature = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0

        def trained(chunks, worker_cfg, impl):
            distributed = worker_cfg.parallel.use_distributed_optimizer
            model, optimizer = wrap_for_training(chunks, worker_cfg.optim, distributed_optimizer=distributed,
                                                 fp8_param_gather=bool(worker_cfg.fp8 and worker_cfg.fp8_param_gather),
                                                 fp8_recipe=worker_cfg.fp8_recipe if worker_cfg.fp8 else None)
            return _Part(chunks, model, optimizer, worker_cfg, micro_batching(worker_cfg, impl))

        chunks = build_model(self.spec, self.layout, **options)
        load_hf_weights(chunks, self.spec, cfg.model.path)  # before the optimizer: its masters start from these
        self.adapters = {}  # with actor.lora: {HF module: its adapter} of this rank (megarl.backends.megatron.lora)
        if cfg.actor.lora.enabled:  # before the optimizer: the frozen base gets no gradient buffers nor state
            self.adapters = add_lora(chunks, self.spec, cfg.actor.lora, seed=cfg.trainer.seed,
                                     sequence_parallel=self.layout.sequence_parallel)
        self.actor = trained(chunks, cfg.actor, options["impl"])
        if cfg.actor.moe_routing_replay:  # the actor's forwards route as the rollout engine did
            install_replay(chunks)
        self.needs_reference = a.use_kl_loss or a.use_kl_in_reward
        self.reference = None  # with LoRA the reference is the actor with its adapters off
        self.reference_weights = None  # HostOffloaded with actor.reference_offload
        if self.needs_reference and not self.adapters:
            self.reference = build_model(self.spec, self.layout, **options)
            load_hf_weights(self.reference, self.spec, cfg.model.path)
            free_master_sources(self.reference)  # no optimizer builds masters for the frozen reference
            for chunk in self.reference:
                chunk.eval().requires_grad_(False)
            if cfg.actor.reference_offload:
                self.reference_weights = HostOffloaded(self.reference, next(chunks[0].parameters()).device)
        self.critic = None
        if cfg.critic.enable:
            critic_path = cfg.critic.model_path or cfg.model.path
            critic_spec = ModelSpec.from_hf(critic_path)
            self.layout.check(critic_spec, torch.distributed.get_world_size())
            critic_options = build_options(cfg.critic, cfg.model.dtype)
            critic_chunks = build_critic(critic_spec, self.layout, **critic_options)
            load_hf_weights(critic_chunks, critic_spec, critic_path, skip=VALUE_HEAD)
            self.critic = trained(critic_chunks, cfg.critic, critic_options["impl"])
        self.mini = {"actor": cfg.actor.ppo_mini_batch_size * samples, "critic": cfg.critic.ppo_mini_batch_size * samples}
        self._sleep = WorkerSleep(next(chunks[0].parameters()).device)

    # -- where this rank stands ------------------------------------------------------------
    @property
    def has_reference(self) -> bool:
        return self.needs_reference

    @staticmethod
    def _dp() -> tuple[int, int]:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()

    @property
    def is_export_source(self) -> bool:
        """TP rank 0 of DP rank 0 (and CP rank 0) in each pipeline stage: the ranks that send
        exported weights."""
        from megatron.core import parallel_state

        return (parallel_state.get_tensor_model_parallel_rank() == 0 and self._dp()[0] == 0
                and parallel_state.get_context_parallel_rank() == 0)

    @property
    def pipeline_stage(self) -> int:
        from megatron.core import parallel_state

        return parallel_state.get_pipeline_model_parallel_rank()

    def data_parallel(self) -> tuple[int, int]:
        """(this rank's data-parallel rank, the data-parallel size): which share of a batch it takes."""
        return self._dp()

    def _share(self, share: DataShare) -> DataShare:
        if (share.dp_rank, share.dp_size) != self._dp():
            raise ValueError(f"a share for data-parallel rank {share.dp_rank} of {share.dp_size} was sent to rank "
                             f"{self._dp()[0]} of {self._dp()[1]}")
        return share

    # -- forward passes ----------------------------------------------------------------------
    def _over_data_parallel(self, batch: Batch, fn) -> list[torch.Tensor]:
        """fn(this DP rank's rows) -> tensors (rows, L); the rows of every DP rank gathered, in
        the batch's layout. A `DataShare` is this rank's rows already: its results only."""
        from megatron.core import parallel_state

        rows, back = as_rows(self._share(batch) if isinstance(batch, DataShare) else batch)
        if isinstance(batch, DataShare):
            return [back(t.cpu()) for t in fn(rows)]
        return [back(t) for t in self._gathered(rows, fn, parallel_state)]

    def _gathered(self, batch: TrainBatch, fn, parallel_state) -> list[torch.Tensor]:
        rank, size = self._dp()
        if size == 1:
            return [t.cpu() for t in fn(batch)]
        bounds = [len(batch) * r // size for r in range(size + 1)]
        mine = fn(batch.select(slice(bounds[rank], bounds[rank + 1])))
        most = max(bounds[r + 1] - bounds[r] for r in range(size))
        out = []
        for tensor in mine:
            padded = torch.nn.functional.pad(tensor, (0, 0, 0, most - tensor.shape[0]))
            parts = [torch.empty_like(padded) for _ in range(size)]
            torch.distributed.all_gather(parts, padded.contiguous(), group=parallel_state.get_data_parallel_group())
            out.append(torch.cat([p[: bounds[r + 1] - bounds[r]] for r, p in enumerate(parts)]).cpu())
        return out

    def _log_probs(self, chunks, batch: Batch, with_entropy: bool, temperature: float | None = None):
        from megarl.backends.megatron.actor import forward_log_probs

        def fn(rows):
            lp, ent = forward_log_probs(chunks, self.spec.vocab_size, rows, **self.actor.batching,
                                        temperature=temperature or self.temperature, with_entropy=with_entropy)
            return [lp, ent] if with_entropy else [lp]

        with torch.no_grad():
            for chunk in chunks:
                chunk.eval()
            out = self._over_data_parallel(batch, fn)
        return out[0], (out[1] if with_entropy else None)

    def compute_log_prob(self, batch: Batch, with_entropy: bool = False, temperature: float | None = None,
                         own_routing: bool = False):
        if own_routing:
            from megarl.backends.megatron.routing import routing_by_itself

            with routing_by_itself():
                return self._log_probs(self.actor.chunks, batch, with_entropy, temperature)
        return self._log_probs(self.actor.chunks, batch, with_entropy, temperature)

    def compute_ref_log_prob(self, batch: Batch) -> torch.Tensor:
        if not self.needs_reference:
            raise RuntimeError("no reference model: turn on algorithm.use_kl_loss or use_kl_in_reward")
        if self.adapters:  # the base: the actor's chunks with the adapters off, routing by themselves
            from megarl.backends.megatron.lora import adapters_off
            from megarl.backends.megatron.routing import routing_by_itself

            with adapters_off(self.actor.chunks), routing_by_itself():
                return self._log_probs(self.actor.chunks, batch, False)[0]
        with self.reference_weights.on_device() if self.reference_weights else nullcontext():
            return self._log_probs(self.reference, batch, False)[0]

    def compute_values(self, batch: Batch) -> torch.Tensor:
        from megarl.backends.megatron.critic import forward_values

        if self.critic is None:
            raise RuntimeError("no critic: set critic.enable=true")
        with torch.no_grad():
            for chunk in self.critic.chunks:
                chunk.eval()
            return self._over_data_parallel(batch, lambda rows: [forward_values(
                self.critic.chunks, rows, **self.critic.batching)])[0]

    # -- updates --------------------------------------------------------------------------------
    def _update(self, part: _Part, name: str, batch: Batch, step_fn) -> dict[str, float]:
        """PPO epochs of mini-batches; each DP rank steps on its contiguous share of every mini-batch
        (a `DataShare`: the share it was sent, with the whole mini-batches' sizes)."""
        rank, size = self._dp()
        if self.mini[name] % size:
            raise ValueError(f"{name}: a mini-batch of {self.mini[name]} samples does not split over "
                             f"{size} data-parallel ranks")
        for chunk in part.model:
            chunk.train()
        if isinstance(batch, DataShare):
            return self._update_share(part, self._share(batch), step_fn)
        batch = as_rows(batch)[0]

        def one_step(mini: TrainBatch) -> dict[str, float]:
            counts = {"num_tokens": int(mini.loss_mask.sum()), "num_seqs": len(mini),
                      "norm_length": self.cfg.rollout.max_response_length}
            share = len(mini) // size
            metrics = step_fn(mini.select(slice(rank * share, (rank + 1) * share)), counts,
                              part.lr(self.cfg, self.total_steps))
            if not metrics.get("skipped_steps"):
                part.steps += 1  # a skipped step leaves the schedule where it was (as the torch backend)
            return metrics

        return run_epochs(batch, self.mini[name], part.cfg.ppo_epochs, one_step)

    def _update_share(self, part: _Part, share: DataShare, step_fn) -> dict[str, float]:
        def one_step(rows: PackedBatch, counts: dict) -> dict[str, float]:
            metrics = step_fn(rows.padded(), counts | {"norm_length": self.cfg.rollout.max_response_length},
                              part.lr(self.cfg, self.total_steps))
            if not metrics.get("skipped_steps"):
                part.steps += 1
            return metrics

        return mean_metrics(one_step(rows, counts) for _ in range(part.cfg.ppo_epochs)
                            for rows, counts in share.mini_batches())

    def update_actor(self, batch: Batch) -> dict[str, float]:
        from megarl.backends.megatron.actor import actor_step

        fields = batch.batch if isinstance(batch, DataShare) else batch
        if fields.old_log_probs is None or fields.advantages is None:
            raise ValueError("update_actor needs batch.old_log_probs and batch.advantages")
        if self.cfg.algorithm.use_kl_loss and fields.ref_log_probs is None:
            raise ValueError("algorithm.use_kl_loss needs batch.ref_log_probs")
        return self._update(self.actor, "actor", batch, lambda rows, counts, lr: actor_step(
            self.actor.model, self.actor.optimizer, self.spec.vocab_size, rows, **self.actor.batching,
            algo=self.cfg.algorithm, counts=counts, lr=lr, weight_decay=self.cfg.actor.optim.weight_decay,
            temperature=self.temperature))

    def update_critic(self, batch: Batch) -> dict[str, float]:
        from megarl.backends.megatron.critic import critic_step

        if self.critic is None:
            raise RuntimeError("no critic: set critic.enable=true")
        fields = batch.batch if isinstance(batch, DataShare) else batch
        if fields.values is None or fields.returns is None:
            raise ValueError("update_critic needs batch.values and batch.returns")
        c = self.cfg.critic
        return self._update(self.critic, "critic", batch, lambda rows, counts, lr: critic_step(
            self.critic.model, self.critic.optimizer, rows, **self.critic.batching, cliprange_value=c.cliprange_value,
            loss_agg_mode=self.cfg.algorithm.loss_agg_mode, counts=counts, lr=lr, weight_decay=c.optim.weight_decay))

    # -- weights out ------------------------------------------------------------------------------
    def _hf_tensors(self, gather_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
        """The export this rank walks: the stage's HF-named actor tensors, TP-gathered, on each
        TP rank of DP rank 0; nothing on other DP ranks (replicas), except with expert
        parallelism: an EP group spans DP ranks, so every rank yields them, and the ipc sender's
        collectives between buckets meet each expert gather in step. `gather_bytes`: the most of
        a layer's experts gathered at once (export_hf_tensors)."""
        from megarl.backends.megatron.model import export_hf_tensors

        if self._dp()[0] == 0 or self.layout.ep > 1:
            from megarl.backends.megatron.lora import adapter_hf_tensors, merged_hf_tensors

            if self.adapters and self.cfg.actor.lora.sync == "adapter":  # the engines keep their base
                return adapter_hf_tensors(self.adapters)
            tensors = export_hf_tensors(self.actor.chunks, self.spec, expert_gather_bytes=gather_bytes)
            return merged_hf_tensors(tensors, self.adapters) if self.adapters else tensors  # base + scale B A
        return iter(())

    def export_hf_weights(self, bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
        """This pipeline stage's HF-named actor tensors in buckets of about `bucket_bytes`, the
        same buckets on every rank that yields any (`_hf_tensors`); every rank must iterate (the
        source rank sends them, see is_export_source). A layer's experts are gathered at most a
        bucket's worth at a time: the sync holds a bucket anyway, so the gathers at most double it."""
        return group_tensors(self._hf_tensors(bucket_bytes), bucket_bytes)

    def weight_checksums(self) -> dict[str, str]:
        """Checksums of every HF tensor of the actor (all stages), the same on every rank."""
        tensors = self._hf_tensors(self.cfg.sync.bucket_mb << 20)
        mine = weight_checksums(tensors) if self.is_export_source else _walk(tensors)
        gathered = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, mine)
        return {name: value for part in gathered for name, value in part.items()}

    def save_hf(self, directory: str | Path) -> str:
        """The actor as an HF model directory (safetensors + config; the tokenizer is the
        caller's). A collective: every rank must call it; each stage's source rank writes its
        own file, rank 0 the index and config."""
        from megatron.core import parallel_state
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        stage = parallel_state.get_pipeline_model_parallel_rank()
        stages = parallel_state.get_pipeline_model_parallel_world_size()
        file = f"model-{stage + 1:05d}-of-{stages:05d}.safetensors"
        exported = self._hf_tensors(self.cfg.sync.bucket_mb << 20)
        tensors = {n: t.contiguous().cpu() for n, t in exported} if self.is_export_source else _walk(exported)
        names = [[] for _ in range(stages)]
        if self.is_export_source:
            save_file(tensors, str(directory / file), metadata={"format": "pt"})
        gathered = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, (stage, sorted(tensors) if self.is_export_source else []))
        for s, keys in gathered:
            names[s] += keys
        if torch.distributed.get_rank() == 0:
            weight_map = {n: f"model-{s + 1:05d}-of-{stages:05d}.safetensors" for s in range(stages) for n in names[s]}
            (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
            copy_config_and_tokenizer(Path(self.cfg.model.path), directory, self.cfg.model.dtype)
        torch.distributed.barrier()
        return str(directory)

    # -- the engines' turn on the GPUs ------------------------------------------------------------
    def sleep(self, keep_weights: bool = False) -> float:
        """Optimizer state (masters and moments), the reference and TE's FP8 weight caches off the
        device, the gradient buffers freed, then the weights (megatron's parameter buffers) unless
        `keep_weights` (megarl.backends.sleep.WorkerSleep)."""
        parts = self._parts().values()
        frozen = self.reference if self.reference is not None and self.reference_weights is None else []
        return self._sleep.sleep([c for p in parts for c in p.chunks], [p.optimizer for p in parts], list(frozen),
                                 keep_weights)

    def wake(self, weights_only: bool = False) -> float:
        return self._sleep.wake(weights_only)

    # -- checkpoints ------------------------------------------------------------------------------
    def _parts(self) -> dict[str, _Part]:
        return {"actor": self.actor} | ({"critic": self.critic} if self.critic is not None else {})

    def save_checkpoint(self, directory: str | Path) -> None:
        """Each part as a megatron distributed checkpoint (weights + optimizer state) in
        `directory/<part>/`, its step count, and every rank's RNG state. A collective."""
        from megatron.core import dist_checkpointing

        directory = Path(directory)
        rank = torch.distributed.get_rank()
        for name, part in self._parts().items():
            path = directory / name
            if rank == 0:
                path.mkdir(parents=True, exist_ok=True)
            torch.distributed.barrier()
            dist_checkpointing.save(sharded_state(part, loading=False, adapters_only=self._lora(name)), str(path))
        if self.adapters:  # the adapters under PEFT's names too, a file a stage: what megarl export reads
            self._save_adapters(directory)
        if rank == 0:
            (directory / "megatron_trainer.json").write_text(json.dumps(
                {name: {"steps": part.steps} for name, part in self._parts().items()} | {"layout": repr(self.layout)}))
        (directory / "rng").mkdir(exist_ok=True)
        torch.save(_rng_state(), directory / "rng" / f"rank_{rank:05d}.pt")
        torch.distributed.barrier()

    def _lora(self, part: str) -> bool:
        """Whether `part`'s checkpoint holds its adapters alone (the actor's with actor.lora: its
        base is model.path's, frozen)."""
        return part == "actor" and bool(self.adapters)

    def _save_adapters(self, directory: Path) -> None:
        """This stage's adapters, whole, as PEFT names them (written by the stage's source rank).
        A collective of the TP group."""
        from megatron.core import parallel_state
        from safetensors.torch import save_file

        from megarl.backends.megatron.lora import adapter_hf_tensors

        tensors = {n: t.contiguous().cpu() for n, t in adapter_hf_tensors(self.adapters)}
        if self.is_export_source:
            stage, stages = self.pipeline_stage, parallel_state.get_pipeline_model_parallel_world_size()
            save_file(tensors, str(directory / f"actor_adapter-{stage + 1:05d}-of-{stages:05d}.safetensors"))

    def load_checkpoint(self, directory: str | Path) -> None:
        """Load what `save_checkpoint` wrote, also when it was written in another layout
        (RNG states are restored only where the world size is the same)."""
        from megatron.core import dist_checkpointing

        from megarl.backends.megatron.dist_format import check_dist_checkpoint

        directory = Path(directory)
        state = directory / "megatron_trainer.json"
        if not state.exists():
            raise FileNotFoundError(f"{directory} is not a megatron-backend checkpoint (no {state.name}); "
                                    "was it written with actor.backend=torch?")
        trainer = json.loads(state.read_text())
        for name, part in self._parts().items():
            if name not in trainer:
                raise ValueError(f"checkpoint {directory} has no {name}; was it written by another config?")
            check_dist_checkpoint(directory / name)  # megatron unpickles its metadata and objects in full
            loaded = dist_checkpointing.load(sharded_state(part, loading=True, adapters_only=self._lora(name)),
                                             str(directory / name))
            for i, chunk in enumerate(part.chunks):
                chunk.load_state_dict(loaded[model_key(part, i)], strict=False)
            load_optimizer_state(part.optimizer, loaded["optimizer"])
            part.steps = trainer[name]["steps"]
        rng = directory / "rng" / f"rank_{torch.distributed.get_rank():05d}.pt"
        if rng.exists() and len(list((directory / "rng").glob("rank_*.pt"))) == torch.distributed.get_world_size():
            _set_rng_state(torch.load(rng, weights_only=True))


def _rng_state() -> dict[str, torch.Tensor]:
    """The host RNG states (megarl.backends.rng) and the model-parallel RNG tracker's, under
    `tracker/<name>`."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return rng_state() | {f"tracker/{k}": v for k, v in get_cuda_rng_tracker().get_states().items()}


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    set_rng_state(state)
    tracker = {k.removeprefix("tracker/"): v for k, v in state.items() if k.startswith("tracker/")}
    if tracker:
        get_cuda_rng_tracker().set_states(tracker)


def _walk(tensors: Iterator) -> dict:
    """Run a collective iterator to its end (taking part in its gathers), keeping nothing: {}."""
    for _ in tensors:
        pass
    return {}
