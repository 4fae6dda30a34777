"""The typed configuration of a megarl run.

One tree of dataclasses, each field documented with its unit and meaning, defaults
following DAPO (docs/architecture.md, "Reference settings"). A run is described by a YAML file plus
dotted command-line overrides (``algorithm.clip_ratio_high=0.28``); `load_config` merges
them, checks every key and type, and validates the values before any heavy work starts.

Main entry point: ``load_config(path, overrides) -> RunConfig``.
Loading, overrides and type checks live in `megarl.config_loader`; this module holds the
schema and the value checks next to it.
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from megarl.config_loader import (
    ConfigError,
    Problem,
    Problems,
    config_to_dict,
    load_config as _load_config,
    param,
    save_config,
)
from megarl.config_algorithm import AlgorithmConfig, DynamicSamplingConfig, OverlongConfig, check_algorithm
from megarl.config_async import AsyncRolloutConfig, check_async_rollout
from megarl.config_cluster import ClusterConfig
from megarl.config_lora import LoraConfig, check_lora
from megarl.config_megatron import check_megatron
from megarl.config_probe import ProbeConfig, check_probe
from megarl.config_rollout import RolloutConfig, SamplingConfig, SGLangConfig, check_rollout
from megarl.reward.settings import RewardConfig, check_reward_config

__all__ = ["RunConfig", "AlgorithmConfig", "DynamicSamplingConfig", "OverlongConfig", "RewardConfig", "RolloutConfig",
           "SamplingConfig", "SGLangConfig", "ConfigError", "load_config", "save_config", "config_to_dict"]


Dtype = Literal["float32", "bfloat16", "float16"]


@dataclass
class ModelConfig:
    path: str = param("", "HF model directory (safetensors + config.json) or hub name; the policy's initial weights.")
    tokenizer_path: str | None = param(None, "Tokenizer directory; defaults to model.path.")
    trust_remote_code: bool = param(False, "Allow custom modelling code shipped with the checkpoint.")
    dtype: Dtype = param("bfloat16", "Parameter and compute dtype of the train and rollout models.")


@dataclass
class DataConfig:
    train_files: list[str] = param(help="Training parquet / jsonl files (Search-R1 / verl row format).", factory=list)
    val_files: list[str] = param(help="Validation parquet / jsonl files.", factory=list)
    prompt_key: str = param("prompt", "Column holding the prompt (chat messages or a string).")
    max_prompt_length: int = param(2048, "Longest prompt in tokens; longer prompts are filtered out and counted.", gt=0)
    train_batch_size: int = param(512, "Prompts per training step (each expanded to rollout.n samples).", gt=0)
    gen_batch_size: int | None = param(
        1536, "Prompts drawn per generation batch; DAPO over-generates 3x and refills. None = train_batch_size.", gt=0
    )
    val_batch_size: int | None = param(None, "Prompts per validation generation batch; None = the whole set.", gt=0)
    shuffle: bool = param(True, "Shuffle the training prompts every epoch (seeded by trainer.seed).")
    apply_chat_template: bool = param(True, "Render prompts with the tokenizer's chat template when it has one.")


@dataclass
class RetrievalConfig:
    url: str | None = param(None, "Retriever endpoint (POST /retrieve); None = start megarl's server from index_dir.")
    index_dir: str | None = param(None, "Index built by `megarl retrieval build` (used when url is None).")
    kind: Literal["bm25", "dense"] = param("bm25", "Index kind: bm25 (bm25s) or dense (E5 + faiss).")
    host: str = param("auto", "Address the started retrieval server binds to; auto = 127.0.0.1 when the run is on "
                      "one node (cluster.nnodes), the address of the node it runs on otherwise.")
    api_key: str | None = param(
        None, "Key of the retrieval server ('Authorization: Bearer KEY' on /retrieve). With url: the key it was "
        "started with; None = $MEGARL_RETRIEVAL_API_KEY, else none. The server megarl starts from index_dir always "
        "takes one: this, else that variable, else a fresh key per run. Never in the saved config or MLflow.",
        secret=True)
    port: int = param(8000, "Port of the started retrieval server; 0 = any free port.", ge=0, lt=65536)
    topk: int = param(3, "Documents returned per search.", gt=0)
    timeout_s: float = param(30.0, "Deadline of one retrieval request in seconds, connecting and reading the whole "
                             "answer included. Concurrent searches share requests: the client keeps at most "
                             "RetrievalClient.max_concurrency in flight, for all trajectories together, and the "
                             "searches that wait for one go together in the next (up to its batch_size queries).",
                             gt=0.0)
    max_retries: int = param(3, "Retries (with backoff) of a failed request before the observation reports a failed "
                             "search, for every search in that request.", ge=0)


@dataclass
class AgentConfig:
    max_turns: int = param(0, "Tool-calling turns per trajectory; 0 = single-turn generation (e.g. DAPO math).", ge=0)
    max_turn_length: int = param(500, "Tokens the model may generate in one turn.", gt=0)
    max_obs_length: int = param(500, "Observation tokens kept per tool call (the rest is cut).", gt=0)
    mask_observations: bool = param(True, "Exclude observation tokens from the loss (Search-R1's loss mask).")
    tools: dict[str, dict[str, Any]] = param(
        help="The tools the model may call, by name (its tag): each a mapping of settings, `class` "
        "('package.module:Class', not needed for the built-ins search, calculator and python), `timeout_s`, `ray` "
        "(true: in a Ray actor of its own, with `num_cpus`), and the class's own. Replaced whole by an override, e.g. 'agent.tools={calculator: {}}'. See docs/extending.md.",
        factory=lambda: {"search": {}})
    tool_format: Literal["tags", "tool_call"] = param(
        "tags", "How the model calls a tool: tags (Search-R1, <search> query </search>) or tool_call (the chat "
        "template's <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>, e.g. Qwen2.5 and Qwen3).")
    retrieval: RetrievalConfig = param(help="Retriever used by the search tool.", factory=RetrievalConfig)

    def uses_search(self) -> bool:
        """Whether the run searches: multi-turn, with a search tool (it then needs a retrieval server)."""
        from megarl.tools import is_search

        return self.max_turns > 0 and any(is_search(name, spec) for name, spec in self.tools.items())


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = param(1, "Tensor-parallel size (megatron).", gt=0)
    pipeline_model_parallel_size: int = param(1, "Pipeline-parallel stages (megatron).", gt=0)
    virtual_pipeline_model_parallel_size: int | None = param(None, "Virtual stages per pipeline rank (interleaved schedule).", gt=0)
    context_parallel_size: int = param(
        1, "Context-parallel size (megatron): every sequence split over this many ranks (Transformer Engine's "
        "ring attention on GPUs, padded rows; all-gathered keys and values on the local layers).", gt=0)
    sequence_parallel: bool = param(True, "Sequence parallelism with TP > 1 (megatron; a mixture of experts needs it).")
    expert_model_parallel_size: int = param(
        1, "Expert parallelism (megatron, mixture-of-experts models): each MoE layer's experts split over this many "
        "ranks, tokens sent to them by all-to-all.", gt=0)
    expert_tensor_parallel_size: int | None = param(
        None, "Tensor parallelism inside each expert (megatron); None = tensor_model_parallel_size.", gt=0)
    use_distributed_optimizer: bool = param(True, "Shard optimizer state over data-parallel ranks (megatron).")
    data_parallel_size: int | None = param(
        None, "Data-parallel replicas (megatron); None = every GPU left by TP x PP x CP (cluster.nnodes x "
        "cluster.gpus_per_node), 1 on a CPU run.", gt=0)

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size


@dataclass
class OptimConfig:
    lr: float = param(1e-6, "Peak learning rate.", gt=0.0)
    lr_warmup_steps: int = param(10, "Linear warm-up in optimizer steps.", ge=0)
    lr_scheduler: Literal["constant", "cosine"] = param("constant", "Schedule after warm-up.")
    min_lr_ratio: float = param(0.0, "Cosine floor as a fraction of lr.", ge=0.0, le=1.0)
    weight_decay: float = param(0.1, "AdamW weight decay (not on biases and norm weights).", ge=0.0)
    betas: list[float] = param(help="AdamW betas.", factory=lambda: [0.9, 0.999])
    eps: float = param(1e-8, "AdamW epsilon.", gt=0.0)
    grad_clip: float = param(1.0, "Clip the global gradient norm to this; 0 = off.", ge=0.0)
    offload: bool = param(False, "Adam's state, FP32 masters and step on the host (megatron, distributed optimizer).")


@dataclass
class TrainWorkerConfig:
    backend: Literal["torch", "megatron"] = param("torch", "torch = plain HF model (CPU / one GPU); megatron = megatron-core.")
    ppo_mini_batch_size: int = param(32, "Prompts per optimizer step (x rollout.n samples).", gt=0)
    ppo_micro_batch_size: int = param(4, "Samples per forward/backward pass (gradient accumulation unit).", gt=0)
    ppo_epochs: int = param(1, "Passes over each training batch.", gt=0)
    shuffle_mini_batches: bool = param(True, "Cut the step's samples into mini-batches in a random order (seeded by "
                                       "trainer.seed and the step); false = as generated, whole groups together.")
    max_tokens_per_gpu: int | None = param(
        None, "Token budget of a dynamic micro-batch (of whole sequences: under context parallelism each rank holds "
        "1/CP of them); None = fixed micro-batch size.", gt=0)
    pack_sequences: bool | None = param(
        None, "Pack a micro-batch's sequences end to end, no compute on padding (megatron; max_tokens_per_gpu then "
        "counts real tokens): None = where the attention has a packed path (Transformer Engine's THD); true = also "
        "on megatron's local layers, through a block-diagonal mask (tokens^2 memory: CPU and small runs); "
        "false = padded rows.")
    gradient_checkpointing: bool = param(False, "Recompute activations in backward to save memory.")
    share_prompts: bool = param(
        True, "torch backend: forward each distinct prompt of a micro-batch once and its samples' responses on its "
        "keys and values (the same log-probs and gradients up to float rounding; far fewer tokens when G samples "
        "share a prompt). Not with gradient checkpointing or a mixture of experts (routing recorded or replayed).")
    reference_offload: bool = param(
        False, "Keep the frozen reference model's weights in host memory, on the device only while reference "
        "log-probs are computed (saves one model's weights of GPU memory per rank for one host-to-device copy "
        "per step; actor only).")
    moe_aux_loss_coeff: float | None = param(
        None, "Load-balancing loss of a mixture of experts (megatron's aux_loss, per micro-batch over its real "
        "tokens); None = the model config's router_aux_loss_coef; 0 = off.", ge=0.0)
    moe_routing_replay: bool = param(
        False, "Mixture of experts: the actor's forwards (old log-probs and updates, not the reference) route "
        "each token to the experts the rollout engine routed it to, so both see one routing (rollout routing "
        "replay); the engines record it (SGLang: --enable-return-routed-experts).")
    transformer_impl: Literal["transformer_engine", "local"] = param("transformer_engine", "megatron layer implementation.")
    fp8: Literal["hybrid", "e4m3"] | None = param(None, "Transformer Engine FP8 format; None = off.")
    fp8_recipe: Literal["delayed", "tensorwise", "blockwise"] = param("delayed", "Transformer Engine FP8 scaling recipe.")
    fp8_param_gather: bool = param(False, "Weights kept and all-gathered in FP8 (fp8 tensorwise/blockwise, distributed optimizer).")
    parallel: ParallelConfig = param(help="Model parallel layout (megatron backend).", factory=ParallelConfig)
    lora: LoraConfig = param(help="Low-rank adapters on a frozen base (PEFT's names; off by default).",
                             factory=LoraConfig)
    optim: OptimConfig = param(help="Optimizer and learning-rate schedule.", factory=OptimConfig)


def _critic_defaults() -> CriticConfig:
    return CriticConfig(optim=OptimConfig(lr=1e-5, weight_decay=0.01))


@dataclass
class CriticConfig(TrainWorkerConfig):
    enable: bool = param(False, "Train a value model (needed by algorithm.adv_estimator=gae).")
    model_path: str | None = param(None, "Initial critic weights; None = model.path with a fresh value head.")
    cliprange_value: float = param(0.5, "Clip range of the clipped value loss.", gt=0.0)


@dataclass
class TrainerConfig:
    output_dir: str | None = param(None, "Run directory: resolved config, checkpoints, MLflow store, exports. "
                                   "None = outputs/<the config file's name>, or outputs/run without a file.")
    total_training_steps: int | None = param(None, "Stop after this many steps; None = total_epochs over the data.", gt=0)
    total_epochs: int = param(1, "Passes over the training prompts.", gt=0)
    seed: int = param(42, "Seed of data order, sampling and initialisation.")
    test_freq: int = param(5, "Validate every k steps; 0 = never.", ge=0)
    val_before_train: bool = param(True, "Validate once before the first step.")
    save_freq: int = param(10, "Checkpoint every k steps; 0 = only at the end.", ge=0)
    save_interval_min: float = param(0.0, "Also checkpoint at the end of a step once this many minutes have passed "
                                     "since the last checkpoint (or the start); 0 = off.", ge=0.0)
    save_before_job_end: bool = param(
        True, "Where the job's end is known ($MEGARL_JOB_END_TIME, which the slurm recipes set, or "
        "$SLURM_JOB_END_TIME): after a step, when the next one (as long as the longest of the last 3) and a save "
        "would end within job_end_margin_s of it, checkpoint and stop (exit 75) so that the requeued job resumes "
        "there (megarl.job_time).")
    job_end_margin_s: float = param(600.0, "Seconds before the job's end by which the run has saved and stopped "
                                    "(the recipes' SIGTERM comes 300 s before it).", ge=0.0)
    max_ckpt_to_keep: int = param(2, "Checkpoints kept on disk (oldest deleted first).", gt=0)
    resume: str = param("auto", "auto = newest checkpoint in output_dir; disable = start fresh; or a checkpoint path.")
    resume_changed_config: bool = param(
        False, "Resume even when the config changes what the checkpoint's run was learning (its model, data, "
        "algorithm, optimizer, sampling, rewards or seed; megarl.resume_guard): the changed keys are logged. "
        "Off: such a resume is refused, naming the keys.")
    max_bad_steps: int = param(3, "Consecutive NaN/inf steps tolerated before the run stops.", gt=0)
    max_rewardless_steps: int = param(3, "Consecutive steps in which every sample's reward failed (raised, timed "
                                      "out, gave NaN) before the run stops as failed: it would learn nothing.", gt=0)
    sleep_during_generation: bool | None = param(
        None, "The trainer hands its device memory to the engines while they generate: weights, gradients, "
        "optimizer state and the reference leave the GPU after each weight sync and come back before the next "
        "training phase, bit for bit (docs/training.md). None = on where engine servers share the trainer's GPUs "
        "(rollout.engine=sglang, rollout.mode=colocated, cluster.gpus_per_node > 0); true also on the CPU.")
    async_rollout: AsyncRolloutConfig = param(help="Generation overlapped with training (off by default).",
                                              factory=AsyncRolloutConfig)


@dataclass
class TrackingConfig:
    backend: Literal["mlflow", "none"] = param("mlflow", "Experiment tracker.")
    uri: str | None = param(None, "MLflow tracking URI; None = $MLFLOW_TRACKING_URI, else a local store inside trainer.output_dir.")
    experiment_name: str = param("megarl", "MLflow experiment.")
    run_name: str | None = param(None, "MLflow run name; None = the output directory's name.")
    log_rollouts_freq: int = param(10, "Log a table of sample rollouts every k steps; 0 = never.", ge=0)


@dataclass
class SyncConfig:
    bucket_mb: int = param(512, "Size of one weight-sync bucket in MiB.", gt=0)
    transport: str = param(
        "auto", "How weights reach the engines (a transport registered in megarl.weights): ipc = CUDA IPC handles to engines on the same GPUs (colocated); "
        "nccl = a process group between each pipeline stage's source rank and the engines (gloo without CUDA); "
        "disk = safetensors files in sync.disk_dir; inprocess = the embedded engine (rollout.engine=local); "
        "lora = the LoRA adapters alone, through sync.disk_dir, loaded by SGLang's LoRA route (actor.lora.sync=adapter). "
        "auto = lora with actor.lora.sync=adapter, inprocess for the embedded engine, ipc when colocated on GPUs, "
        "nccl otherwise.")
    disk_dir: str | None = param(None, "Shared directory for sync.transport=disk; None = trainer.output_dir/weight_sync.")
    verify: bool = param(False, "After each sync, compare the engines' per-tensor checksums with the trainer's "
                         "(exact; the local engine and megarl's embedded servers). SGLang's own servers report none: "
                         "there the weights probe (sync.probe) is the check, and sync.verify requires it.")
    probe: ProbeConfig = param(help="The weights probe and the step's gate: engines checked against the trainer.",
                               factory=ProbeConfig)


@dataclass
class RunConfig:
    model: ModelConfig = param(help="Policy model.", factory=ModelConfig)
    data: DataConfig = param(help="Prompts.", factory=DataConfig)
    rollout: RolloutConfig = param(help="Generation engines and sampling.", factory=RolloutConfig)
    agent: AgentConfig = param(help="Multi-turn search agent (Search-R1).", factory=AgentConfig)
    algorithm: AlgorithmConfig = param(help="Advantages, losses, dynamic sampling, shaping.", factory=AlgorithmConfig)
    actor: TrainWorkerConfig = param(help="Actor (and reference) train workers.", factory=TrainWorkerConfig)
    critic: CriticConfig = param(help="Critic train workers.", factory=_critic_defaults)
    reward: RewardConfig = param(help="Reward functions.", factory=RewardConfig)
    trainer: TrainerConfig = param(help="Run length, validation, checkpoints.", factory=TrainerConfig)
    tracking: TrackingConfig = param(help="Experiment tracking.", factory=TrackingConfig)
    sync: SyncConfig = param(help="Weight sync from trainer to engines.", factory=SyncConfig)
    cluster: ClusterConfig = param(help="Ray cluster.", factory=ClusterConfig)

    def train_world_size(self) -> int:
        """Processes of the train worker group: 1 with the torch backend; TP x PP x CP x DP
        megatron ranks otherwise (one per GPU, or CPU processes on a CPU run: the fewest that
        hold both the model-parallel and the expert-parallel layout)."""
        p = self.actor.parallel
        if self.actor.backend == "torch":
            return 1
        if p.data_parallel_size is not None:
            return p.model_parallel_size * p.data_parallel_size
        if self.cluster.gpus_per_node:
            return self.cluster.nnodes * self.cluster.gpus_per_node
        expert_tp = p.expert_tensor_parallel_size or p.tensor_model_parallel_size
        return math.lcm(p.model_parallel_size, expert_tp * p.expert_model_parallel_size * p.pipeline_model_parallel_size)

    def trainer_sleeps(self) -> bool:
        """trainer.sleep_during_generation with None resolved: on for engine servers colocated on GPUs."""
        if self.trainer.sleep_during_generation is not None:
            return self.trainer.sleep_during_generation
        return (self.rollout.engine == "sglang" and self.rollout.mode == "colocated" and self.cluster.gpus_per_node > 0
                and not self.trainer.async_rollout.enable)

    def engines_report_checksums(self) -> bool:
        """The engines can report per-tensor checksums of their HF weights (sync.verify): all but
        SGLang's own servers."""
        return not (self.rollout.engine == "sglang" and self.rollout.sglang.server == "sglang")

    def probe_tolerance(self) -> float:
        """sync.probe.tolerance with None resolved by model.dtype, device, whether the model is a
        mixture of experts and whether the trainer computes in FP8 (megarl.weights.probe)."""
        from megarl.weights.probe import default_tolerance, is_mixture_of_experts

        p = self.sync.probe
        if p.tolerance is not None:
            return p.tolerance
        return default_tolerance(self.model.dtype, self.cluster.gpus_per_node > 0,
                                 is_mixture_of_experts(self.model.path), self.actor.fp8 is not None)

    def probe_ceiling(self) -> float:
        """sync.probe.ceiling with None resolved from the probe's bound (megarl.weights.probe)."""
        from megarl.weights.probe import default_ceiling

        p = self.sync.probe
        return p.ceiling if p.ceiling is not None else default_ceiling(self.probe_tolerance())

    def gate_bound(self) -> float:
        """sync.probe.gate_bound with None resolved: 10 x the probe's tolerance."""
        p = self.sync.probe
        return p.gate_bound if p.gate_bound is not None else 10 * self.probe_tolerance()

    def launcher(self) -> str:
        """cluster.launcher with auto resolved: inprocess for a run on one CPU machine with the torch
        backend and the embedded engine, ray for everything else (several nodes, GPUs, megatron's
        ranks, engine servers, an existing Ray cluster, sandbox services, a tool with `ray: true`). On one
        CPU machine the Ray actors cost start-up and time each step (docs/benchmarks.md, megarl beside TRL)."""
        c = self.cluster
        if c.launcher != "auto":
            return c.launcher
        one_cpu_machine = c.nnodes == 1 and not c.gpus_per_node and c.ray_address is None
        embedded = self.actor.backend == "torch" and self.rollout.engine == "local" and not self.reward.sandbox_servers
        return "inprocess" if one_cpu_machine and embedded and not self.ray_tools() else "ray"

    def ray_tools(self) -> list[str]:
        """The tools of agent.tools asking for a Ray actor of their own (`ray: true`), when tools are called."""
        return [name for name, spec in self.agent.tools.items() if spec.get("ray") is True] \
            if self.agent.max_turns > 0 else []

    def sync_transport(self) -> str:
        """sync.transport with auto resolved: inprocess for the embedded engine, ipc for
        engine servers colocated on GPUs, nccl for the others (gloo where there is no CUDA)."""
        if self.sync.transport != "auto":
            return self.sync.transport
        if self.actor.lora.enabled and self.actor.lora.sync == "adapter" and self.rollout.engine != "local":
            return "lora"
        if self.rollout.engine == "local":
            return "inprocess"
        if self.cluster.gpus_per_node and self.rollout.mode == "colocated":
            return "ipc"
        return "nccl"

    def num_rollout_engines(self) -> int:
        """rollout.num_engines, or as many as the rollout GPUs hold: the train GPUs / engine TP
        when colocated, the GPUs the trainer leaves when disaggregated, 1 on a CPU run."""
        r, c = self.rollout, self.cluster
        if r.engine == "local":
            return 1
        if r.num_engines is not None:
            return r.num_engines
        if not c.gpus_per_node:
            return 1
        if r.mode == "colocated":
            return max(self.train_world_size() // r.tensor_parallel_size, 1)
        return (c.nnodes * c.gpus_per_node - self.train_world_size()) // r.tensor_parallel_size

    def check_consistency(self, problems: Problems) -> None:
        """Rules that involve several fields; each names the keys and the fix."""
        d, r, a, actor = self.data, self.rollout, self.algorithm, self.actor
        gen = d.gen_batch_size if d.gen_batch_size is not None else d.train_batch_size
        if gen < d.train_batch_size:
            problems.add("data.gen_batch_size", f"{gen} is smaller than data.train_batch_size={d.train_batch_size}",
                         "set data.gen_batch_size >= data.train_batch_size (DAPO uses 3x)")
        for name, worker in (("actor", actor), ("critic", self.critic)):
            if name == "critic" and not self.critic.enable:
                continue
            if d.train_batch_size % worker.ppo_mini_batch_size:
                problems.add(f"{name}.ppo_mini_batch_size",
                             f"{worker.ppo_mini_batch_size} does not divide data.train_batch_size={d.train_batch_size}",
                             "choose a mini batch size that divides the train batch size")
            mini_samples = worker.ppo_mini_batch_size * r.n
            if mini_samples % worker.ppo_micro_batch_size:
                problems.add(f"{name}.ppo_micro_batch_size",
                             f"{worker.ppo_micro_batch_size} does not divide a mini batch of "
                             f"{worker.ppo_mini_batch_size} prompts x rollout.n={r.n} = {mini_samples} samples",
                             "choose a micro batch size that divides ppo_mini_batch_size * rollout.n")
        if a.clip_ratio_high < a.clip_ratio_low:
            problems.add("algorithm.clip_ratio_high",
                         f"{a.clip_ratio_high} is below algorithm.clip_ratio_low={a.clip_ratio_low}",
                         "clip-higher needs clip_ratio_high >= clip_ratio_low (DAPO: 0.28 / 0.2)")
        if a.overlong.enable and a.overlong.buffer_len >= r.max_response_length:
            problems.add("algorithm.overlong.buffer_len",
                         f"{a.overlong.buffer_len} is not below rollout.max_response_length={r.max_response_length}",
                         "use a buffer shorter than the maximum response (DAPO: 4096 of 20480)")
        check_algorithm(self, problems)
        if self.trainer.sleep_during_generation and self.trainer.async_rollout.enable:
            problems.add("trainer.sleep_during_generation", "is on with trainer.async_rollout, where the engines "
                         "generate while the trainer trains", "turn one of them off")
        if a.old_log_probs == "engine" and a.tis_cap is not None:
            problems.add("algorithm.old_log_probs", "is engine, but algorithm.tis_cap weighs the loss by exp(old - "
                         "engine log-probs), which is then 1 everywhere", "use algorithm.old_log_probs=trainer with TIS")
        if a.use_kl_loss and a.use_kl_in_reward:
            problems.add("algorithm.use_kl_loss", "and algorithm.use_kl_in_reward are both on (KL counted twice)",
                         "turn one of them off")
        if self.agent.max_turns > 0 and self.agent.max_turn_length > r.max_response_length:
            problems.add("agent.max_turn_length",
                         f"{self.agent.max_turn_length} exceeds rollout.max_response_length={r.max_response_length}",
                         "a single turn cannot be longer than the whole trajectory budget")
        if self.agent.uses_search() and self.agent.retrieval.url is None and self.agent.retrieval.index_dir is None:
            problems.add("agent.retrieval", f"agent.max_turns={self.agent.max_turns} searches, but nothing serves the searches",
                         "set agent.retrieval.index_dir (megarl starts a server on it) or agent.retrieval.url")
        check_tools(self.agent, problems)
        for name, worker in (("actor", actor), ("critic", self.critic)):
            p = worker.parallel
            if worker.backend == "torch" and (p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                                              p.context_parallel_size, p.expert_model_parallel_size) != (1, 1, 1, 1):
                problems.add(f"{name}.parallel", "sets TP/PP/CP/EP > 1 with the torch backend",
                             f"set {name}.backend=megatron or the parallel sizes to 1")
            if p.virtual_pipeline_model_parallel_size is not None and p.pipeline_model_parallel_size == 1:
                problems.add(f"{name}.parallel.virtual_pipeline_model_parallel_size", "is set without pipeline parallelism",
                             f"set {name}.parallel.pipeline_model_parallel_size > 1 or leave it null")
            if worker.fp8 is not None and worker.backend != "megatron":
                problems.add(f"{name}.fp8", "needs the megatron backend with Transformer Engine",
                             f"set {name}.backend=megatron or {name}.fp8=null")
        if self.critic.enable and self.critic.backend != actor.backend:
            problems.add("critic.backend", f"{self.critic.backend} differs from actor.backend={actor.backend}",
                         f"set critic.backend={actor.backend} (actor and critic share the worker processes)")
        if actor.backend == "megatron":
            check_megatron(self, problems)
        if len(actor.optim.betas) != 2 or not all(0.0 <= b < 1.0 for b in actor.optim.betas):
            problems.add("actor.optim.betas", f"{actor.optim.betas} is not two numbers in [0, 1)", "give two numbers in [0, 1), e.g. [0.9, 0.999]")
        if self.trainer.resume not in ("auto", "disable") and not self.trainer.resume.strip():
            problems.add("trainer.resume", "is empty", "use auto, disable or a checkpoint path")
        check_reward_config(self.reward, problems, "reward.")
        from megarl.reward.registry import check_reward_functions  # imports the user's modules, as check_algorithm

        check_reward_functions(self.reward, problems)
        check_async_rollout(self, problems)
        check_lora(self, problems)
        check_rollout(self, problems)
        check_probe(self, problems)
        if self.cluster.launcher == "inprocess" and self.ray_tools():
            problems.add(f"agent.tools.{self.ray_tools()[0]}.ray", "is true, but cluster.launcher=inprocess runs no "
                         "Ray actor: the tool would run in the driver", "set cluster.launcher=auto or ray (auto picks "
                         "ray for such a tool), or ray: false")



def check_tools(agent: AgentConfig, problems: Problems) -> None:
    """Each tool's class imports and takes its settings (megarl.tools.tool_problems)."""
    from megarl.tools import tool_problems

    if agent.max_turns > 0 and not agent.tools:
        problems.add("agent.tools", f"is empty, but agent.max_turns={agent.max_turns} calls tools",
                     "name at least one tool, e.g. agent.tools={search: {}}, or set agent.max_turns=0")
    for name, spec in agent.tools.items():
        for problem in tool_problems(name, spec):
            key, _, message = problem.partition(": ")
            if not key.startswith(f"agent.tools.{name}"):
                key, message = f"agent.tools.{name}", problem
            problems.add(key, message, "see docs/extending.md, 'A tool'")


def load_config(path: str | None, overrides: list[str] | None = None, consistent: bool = True) -> RunConfig:
    """Read a YAML run file, apply ``key=value`` overrides and validate (with `consistent`, the
    rules across fields too); raise ConfigError. A run without a trainer.output_dir gets one
    named after its file: two configs never share a directory (and resume each other's runs)
    by default."""
    cfg = _load_config(RunConfig, path, overrides or [], consistent)
    if cfg.trainer.output_dir is not None and not str(cfg.trainer.output_dir).strip():
        raise ConfigError([Problem("trainer.output_dir", "is empty (it would be the current directory)",
                                   "name the run's directory, or leave the key out for outputs/<config name>")])
    if cfg.trainer.output_dir is None:
        cfg.trainer.output_dir = str(Path("outputs") / (Path(path).stem if path else "run"))
    return cfg
