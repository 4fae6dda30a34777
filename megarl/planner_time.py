"""The step-time estimate of `megarl plan`: how long one RL step takes on a layout, split into
generation, log-probs, training and weight sync, run synchronously and one step off.

    generation   decode is bound by the GPU's memory bandwidth: each decode step of an engine
                 reads its weights once (2 P / engine TP bytes per GPU) and the KV cache of the B
                 sequences it decodes at once, at their mean context (prompt + half the response);
                 tokens/s per GPU = (B / engine TP) / (that many bytes / (HBM bandwidth x e_decode));
                 B = the samples an engine gets, at most what its KV cache holds (each at prompt +
                 mean response). The phase: samples x mean response / (GPUs x that rate), and no
                 less than the longest response decoded alone at the end (max response x a decode
                 step of one sequence, the weights read once: what bounds a small model's phase).
    log-probs    forward passes of the step's tokens (the old policy's, unless they come from the
                 engine, and the reference's with a KL term): 2 N_active FLOPs a token each, at
                 e_forward of the GPU's dense BF16 peak.
    training     6 N_active FLOPs a token (forward and backward; 8 with full recomputation; with LoRA
                 4, the frozen base's weight gradients not computed, the adapters' few FLOPs left out) at
                 e_train of the peak (e_train_moe for a mixture of experts, whose all-to-alls and
                 small expert GEMMs reach far less).
    weight sync  the model's 2 P bytes at an effective rate R (the gather from the train layout,
                 the transfer, the engines' load).
    synchronous  = generation + log-probs + training + weight sync.
    one step off = max(generation, log-probs + training) + weight sync, for engines on GPUs of their
                 own (a colocated engine cannot generate while the trainer trains on its GPU).

The efficiencies are set from one published breakdown (NeMo-RL v0.3, Megatron-Core, 64 H100:
Qwen3-32B 213 s = 96 generation + 40 log-probs + 68 training + 7 refit; Qwen3-30B-A3B for
e_train_moe), and tests/test_plan_time.py holds the estimate within 30% of published step times
that were not used to set them; the sources are in docs/planning.md. An estimate for choosing a
layout, not a measurement. Main entry points: `StepWork`, `estimate_step`, `GPUS`.
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.planner_models import ModelShape


@dataclass(frozen=True)
class Gpu:
    name: str
    bf16_flops: float  # dense BF16 peak, FLOP/s
    hbm_bytes_per_s: float


# NVIDIA's H100 SXM datasheet: 989.4 TFLOPS dense BF16 (1979 with sparsity), 3.35 TB/s HBM3. The
# H800 is the same chip with a slower NVLink, which the estimate does not model.
GPUS = {"H100": Gpu("H100 SXM", 989.4e12, 3.35e12), "H800": Gpu("H800 SXM", 989.4e12, 3.35e12)}

# set from NeMo-RL v0.3's breakdowns on 64 H100 (module docstring; the arithmetic in docs/planning.md):
# of the HBM bandwidth in decoding, of the BF16 peak in the forwards and in training; a mixture of
# experts by its active parameters (Qwen3-30B-A3B's row; its all-to-alls and small expert GEMMs
# reach far less of the peak, and the estimate of one is not checked against another figure)
E_DECODE, E_DECODE_MOE = 0.32, 0.45  # Qwen3-32B: 6.72M tokens in 96 s; Qwen3-30B-A3B: 6.66M in 78 s
E_FORWARD, E_FORWARD_MOE = 0.36, 0.063  # 2 forwards of 6.95M tokens: 40 s; 23 s
E_TRAIN, E_TRAIN_MOE = 0.315, 0.045  # 6 N x 6.95M FLOPs: 68 s; 50 s
SYNC_BYTES_PER_S = 9.4e9  # Qwen3-32B's 65.5 GB in 7 s


@dataclass(frozen=True)
class StepWork:
    """One RL step's work: `samples` sequences of `prompt` + `response` tokens on average."""

    samples: int
    prompt: float
    response: float
    max_response: int  # the longest a response may be
    forwards: int = 2  # log-prob passes: the old policy's and, with a KL term, the reference's
    recompute: bool = False  # full activation recomputation in training
    critic: bool = False  # PPO: the critic's values (one more forward) and its update (as long as the actor's)
    lora: bool = False  # the actor's base frozen: its backward computes no weight gradients

    @property
    def tokens(self) -> float:
        return self.samples * (self.prompt + self.response)


@dataclass(frozen=True)
class StepTime:
    generation: float
    log_probs: float
    training: float
    weight_sync: float
    decode_batch: int  # sequences an engine decodes at once
    one_step_off: float | None  # None: colocated engines cannot overlap with training

    @property
    def synchronous(self) -> float:
        return self.generation + self.log_probs + self.training + self.weight_sync


def active_params(shape: ModelShape) -> float:
    """Parameters a token passes through: all but the experts it is not routed to."""
    s = shape.spec
    experts = sum(shape.expert_params(i) for i in range(s.num_layers))
    return shape.params() - (experts * (1 - s.moe_topk / s.num_experts) if s.is_moe else 0)


def decode_step_s(shape: ModelShape, engine_tp: int, batch: int, context: float, gpu: Gpu) -> float:
    """Seconds of one decode step of an engine of `engine_tp` GPUs with `batch` sequences at a mean
    `context`: its weights and their KV cache read once (see the module docstring)."""
    read = 2 * shape.params() / engine_tp + batch * context * shape.kv_bytes_per_token(engine_tp)
    return read / (gpu.hbm_bytes_per_s * (E_DECODE_MOE if shape.spec.is_moe else E_DECODE))


def estimate_step(shape: ModelShape, work: StepWork, *, train_gpus: int, engine_gpus: int, engine_tp: int,
                  kv_tokens_per_engine: int, colocated: bool, gpu: Gpu = GPUS["H100"]) -> StepTime:
    """The step's phases on `train_gpus` and engines of `engine_tp` GPUs on `engine_gpus` (the
    same GPUs when `colocated`), each engine with KV cache for `kv_tokens_per_engine` tokens."""
    engines = engine_gpus // engine_tp
    per_engine = -(-work.samples // engines)
    fits = max(int(kv_tokens_per_engine // (work.prompt + work.response)), 1)
    batch = min(per_engine, fits)
    rate = batch / engine_tp / decode_step_s(shape, engine_tp, batch, work.prompt + work.response / 2, gpu)
    alone = work.max_response * decode_step_s(shape, engine_tp, 1, work.prompt + work.max_response / 2, gpu)
    generation = max(work.samples * work.response / (engine_gpus * rate), alone)
    n, moe = active_params(shape), shape.spec.is_moe
    log_probs = (work.forwards + work.critic) * 2 * n * work.tokens / (train_gpus * gpu.bf16_flops * (E_FORWARD_MOE if moe else E_FORWARD))
    recompute = 2 if work.recompute else 0
    actor = (4 if work.lora else 6) + recompute  # LoRA: the backward's input gradients only (adapters: negligible)
    train_flops = (actor + (6 + recompute if work.critic else 0)) * n * work.tokens
    training = train_flops / (train_gpus * gpu.bf16_flops * (E_TRAIN_MOE if moe else E_TRAIN))
    weight_sync = 2 * shape.params() / SYNC_BYTES_PER_S
    off = None if colocated else max(generation, log_probs + training) + weight_sync
    return StepTime(generation, log_probs, training, weight_sync, batch, off)


def kv_tokens(shape: ModelShape, engine_tp: int, gpu_bytes: float, fraction: float) -> int:
    """KV cache tokens of an engine whose weights and KV cache take `fraction` of each GPU (as
    vLLM's gpu_memory_utilization; SGLang's fraction is of the free memory, megarl.planner)."""
    per_gpu = fraction * gpu_bytes - 2 * shape.params() / engine_tp
    return int(max(per_gpu, 0) * engine_tp // shape.kv_bytes_per_token(engine_tp))


def describe(t: StepTime, gpu: Gpu) -> str:
    """The estimate in two lines, as `megarl plan` prints it."""
    off = (f"one step off (engines generating while the trainer trains): {t.one_step_off:.0f} s"
           if t.one_step_off is not None else
           "one step off: not with colocated engines (give them GPUs of their own: --rollout-gpus)")
    return (f"step time, estimated for {gpu.name} (docs/planning.md): generation {t.generation:.0f} s "
            f"({t.decode_batch} sequences an engine at once), log-probs {t.log_probs:.0f} s, training "
            f"{t.training:.0f} s, weight sync {t.weight_sync:.0f} s = {t.synchronous:.0f} s synchronous;\n  {off}")


def save_warnings(step_s: float, save_freq: int | None, job_s: float) -> list[str]:
    """Why a job of `job_s` seconds, of steps of about `step_s`, would end before it saves: a step
    longer than the job, or save_freq steps longer than it (a run whose job's end is known saves
    before it anyway: trainer.save_before_job_end)."""
    hours = f"the job's {job_s / 3600:.1f} h"
    if step_s > job_s:
        return [f"a step (~{step_s / 3600:.1f} h, estimated) is longer than {hours}: no step ends inside it; give "
                "the job more time or nodes, or shorten the responses"]
    if save_freq and save_freq * step_s > job_s:
        fit = int(job_s // step_s)
        return [f"trainer.save_freq={save_freq} saves every ~{save_freq * step_s / 3600:.1f} h (steps of "
                f"~{step_s / 3600:.1f} h, estimated), past {hours}. The run saves and stops before the job's end where "
                f"it knows that end (trainer.save_before_job_end; the slurm recipes tell it), else set "
                f"trainer.save_freq={fit} or trainer.save_interval_min"]
    return []
