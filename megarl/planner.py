"""`megarl plan`: layouts for a model on a cluster, with the memory each needs per GPU.

For every actor layout (TP and CP in 1, 2, 4, 8 with TP x CP within a node, PP dividing the
layers, DP the rest) it estimates the memory of one GPU while training (megatron, bf16 weights, fp32
gradient buffers, Adam with the distributed optimizer), picks the cheapest settings that
fit (no recompute, then full recompute, then optimizer offload), sizes SGLang engines
colocated on the same GPUs (or on GPUs of their own), and reports the KV cache left to them.
A mixture of experts gets expert parallelism too (EP dividing the experts and the GPUs per
stage, expert TP 1; megarl.planner_models has its parameter and activation counts). The
formulas, in bytes, with S = parameters of the largest pipeline stage per GPU: its experts / EP
plus the rest / TP:

    weights      2 S                       bf16
    grads        4 S                       fp32 gradient buffers (grad_reduce_in_fp32)
    optimizer    12 S / (DP x CP)          fp32 master weights + Adam m, v, sharded (0 with offload);
                                           the experts' part over expert DP = GPUs / (EP x PP)
    reference    2 S                       a frozen copy, when a KL term is on
    critic       18 S / ... as the actor   weights + grads + optimizer, with a critic (PPO)
    activations  one micro-batch of T tokens (T = max_tokens_per_gpu / CP), per layer
                 A = 2 T (4h + (q + 2 kv) d + q d + 3 f) / TP   (bf16: norms' inputs, QKV, attention
                 output, residuals, SwiGLU's gate/up and product; flash attention keeps no s x s
                 scores; sequence parallel splits the rest over TP);
                 no recompute: A x L (1F1B holds PP micro-batches of L / PP layers on stage 0);
                 full recompute: 2 T h / TP x L (each layer's input) + A (one layer rebuilt)
    logits       8 T V' / TP               fp32 logits and their gradient (V' padded vocabulary)
    overhead     4 GiB                     CUDA context, NCCL buffers, allocator slack
    FP8 caches   2 S                       actor.fp8 (--fp8): TE's FP8 copy of each weight and its
                                           transpose, 1 byte each (on all of S: an upper bound)

    LoRA (actor.lora, --lora R): the base frozen in bf16, the adapters (a of them on the GPU: the
    stage's, sharded as their layers are; megarl.planner_models) trained as weights are:
    weights 2 S + 2 a, grads 4 a, optimizer 12 a / (DP x CP), reference 0 (the base, adapters off)

    training peak = weights + grads + optimizer + reference + critic + activations + logits + FP8 caches
                    + overhead
    a layout fits when its peak is within USABLE = 90% of the GPU (fragmentation, caches)

    colocated, the weight sync's peak (the engines' weights back, the trainer pushing its own):
      trainer kept + engine weights + sync buffers 1.5 GiB (the bucket gathered, two in flight) +
      overhead + engine context, the trainer kept = its weights when it sleeps (the rest leaves the
      GPU first) and, with FP8, the S bytes of FP8 copies the weights probe's forward builds (no
      transpose without gradients); its static memory and FP8 caches awake; within USABLE too.
      A sleep drops the FP8 caches: none is left while the engines generate.

Rollout: SGLang's --mem-fraction-static f is a fraction of the memory *free when the engine
starts*, not of the GPU. SGLang 0.5.23 measures free = torch.cuda.mem_get_info before loading
the weights (the least over the engine's GPUs) and, after loading them, sizes the KV cache as
what is free then minus free x (1 - f): KV cache = f x free - engine weights. So
    engine weights per GPU = 2 P / engine TP (experts over the engine's EP = its TP),   KV bytes per token per GPU =
    2 (K, V) x L x max(kv / engine TP, 1) x d x 2 (bf16),
    static budget (engine weights + KV cache) B, and free F at start-up:
      colocated, the trainer asleep while the engines generate (trainer.sleep_during_generation,
      the default; megarl.backends.sleep), from before the engines start:
        B = 0.9 GPU - trainer asleep - engine context - engine runtime
        F = GPU - trainer asleep - engine context
      colocated, the trainer awake (SGLang's memory released during training; --no-sleep):
        B = 0.9 GPU - static - FP8 caches - overhead - engine context - engine runtime
        F = GPU - static at launch - overhead - engine context
      disaggregated (GPUs of their own):
        B = 0.9 GPU - engine context - engine runtime,   F = GPU - engine context
    f = B / F (rounded down to 0.01), KV cache = f F - engine weights
with trainer asleep 2 GiB (the CUDA context and NCCL communicators a sleeping trainer keeps),
engine context 1 GiB (the server's CUDA context and NCCL communicators, in use before SGLang
measures) and engine runtime 3 GiB (its activations and CUDA graphs, in SGLang's (1 - f) share).
B is what fits next to the trainer's memory while it holds its optimizer state; the engines
start after the trainer is built and before its first step (and before a checkpoint is loaded),
when Adam's m and v (8 of the optimizer's 12 bytes) do not exist yet: static at launch = static
- 2/3 optimizer (the critic's too). The engine TP is the smallest (1, 2, 4, 8) whose weights
take at most half of B (else, for a model whose weights fill a node, the smallest whose weights
leave KV cache for one sequence); where none within a node fits, an engine spans 2 or 4 whole
nodes by the same two rules.

These are estimates for choosing a layout, not measurements; layouts are listed by
preference (no offload, no recompute, no context parallelism, fewer pipeline stages, smaller
TP) after the problems that rule a layout out: context parallelism splits every sequence's
activations over CP ranks at the price of exchanging keys and values, and is preferred over
full recomputation for long sequences. Main entry points: `plan_layouts`, `estimate`, `ModelShape`.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import asdict, dataclass, field

from megarl.config_lora import LINEAR_MODULES
from megarl.planner_config import parse_job_time, settle
from megarl.planner_models import KNOWN_MODELS, ModelShape  # noqa: F401 (the command's public names)
from megarl.planner_time import GPUS, StepTime, StepWork, describe, estimate_step, save_warnings

GiB = 1 << 30
OVERHEAD = 4 * GiB
ENGINE_CONTEXT = 1 * GiB  # an engine server's CUDA context and NCCL communicators, before SGLang measures free memory
ENGINE_RUNTIME = 3 * GiB  # its activations and CUDA graphs, in the (1 - mem_fraction_static) share SGLang leaves
TRAINER_ASLEEP = 2 * GiB  # what a sleeping trainer keeps: its CUDA context and NCCL communicators
SYNC_BUFFERS = 3 * 512 << 20  # a colocated sync's own: the bucket being gathered and two in flight (sync.bucket_mb)
USABLE = 0.9  # of a GPU's memory

@dataclass
class Workload:
    max_prompt_length: int = 2048
    max_response_length: int = 20480
    max_tokens_per_gpu: int | None = None  # None = one longest sequence
    rollout_batch: int = 512 * 16  # sequences generated per step (prompts x samples)
    kl: bool = False  # a frozen reference model (KL loss or KL in the reward)
    critic: bool = False  # PPO's value model on the same GPUs
    sleep: bool = True  # colocated: the trainer sleeps while the engines generate (trainer.sleep_during_generation)
    lora: int = 0  # LoRA rank of the actor (actor.lora.r): the base frozen; 0 = every weight trains
    lora_modules: tuple[str, ...] = LINEAR_MODULES  # the HF linear layers given adapters
    fp8: bool = False  # the actor's GEMMs in FP8 through Transformer Engine (actor.fp8): its FP8 weight caches

    @property
    def sequence(self) -> int:
        return self.max_prompt_length + self.max_response_length

    @property
    def tokens(self) -> int:
        return max(self.max_tokens_per_gpu or 0, self.sequence)


@dataclass
class Estimate:
    tp: int
    pp: int
    cp: int
    dp: int
    recompute: bool
    offload: bool
    weights: int
    grads: int
    optimizer: int
    reference: int
    critic: int
    activations: int
    logits: int
    overhead: int
    train_peak: int
    engine_tp: int = 0
    engines: int = 0
    engine_weights: int = 0
    kv_cache: int = 0
    kv_tokens: int = 0
    sequences_per_engine: int = 0
    rollout_waves: int = 0
    mem_fraction_static: float = 0.0
    rollout_gpus: int = 0  # GPUs of the engines' own (disaggregated); 0 = colocated on the trainer's
    problems: list[str] = field(default_factory=list)
    ep: int = 1  # expert parallelism (a mixture of experts; expert TP 1)
    moe: bool = False
    sleep: bool = False  # colocated engines sized next to a sleeping trainer
    sync_peak: int = 0  # colocated: when the engines' weights come back for a sync (0 = not colocated)
    lora: int = 0  # the actor's LoRA rank (0 = every weight trains)
    fp8_caches: int = 0  # TE's FP8 copies and transposes of the weights while training (actor.fp8)

    @property
    def static(self) -> int:
        return self.weights + self.grads + self.optimizer + self.reference + self.critic

    @property
    def static_at_launch(self) -> int:
        """The trainer's memory when colocated engines start: built, no step taken, so Adam's m
        and v (8 of the optimizer's 12 bytes per parameter; megatron creates them at the first
        step) are not there yet, for the actor nor the critic."""
        moments = 2 * self.optimizer // 3
        return self.static - moments * (2 if self.critic else 1)


def estimate(shape: ModelShape, world: int, gpus_per_node: int, gpu_bytes: int, work: Workload, *, tp: int, pp: int,
             cp: int = 1, recompute: bool = False, offload: bool = False, rollout_gpus: int = 0,
             ep: int = 1) -> Estimate:
    """Memory per GPU of one layout on `world` train GPUs, the engines on them (colocated) or on
    `rollout_gpus` more (disaggregated); see the module docstring for every formula."""
    s = shape.spec
    dp = world // (tp * pp * cp) if world % (tp * pp * cp) == 0 else 0
    expert_dp = world // (ep * pp) if world % (ep * pp) == 0 else 0  # expert TP 1: EP x expert DP per stage
    problems = []
    if ep > 1 and not s.is_moe:
        problems.append(f"EP={ep} needs a mixture of experts")
    elif s.is_moe and s.num_experts % ep:
        problems.append(f"EP={ep} does not divide the {s.num_experts} experts")
    elif s.is_moe and not expert_dp:
        problems.append(f"EP x PP = {ep * pp} does not divide the {world} GPUs")
    if s.num_heads % tp or s.num_kv_heads % tp:
        problems.append(f"TP={tp} does not divide the {s.num_heads} heads and {s.num_kv_heads} KV heads")
    if s.num_layers % pp:
        problems.append(f"PP={pp} does not divide the {s.num_layers} layers")
    if tp > gpus_per_node:
        problems.append(f"TP={tp} spans nodes ({gpus_per_node} GPUs per node)")
    elif tp * cp > gpus_per_node:
        problems.append(f"TP x CP = {tp * cp} spans nodes ({gpus_per_node} GPUs per node)")
    if not dp:
        problems.append(f"TP x PP x CP = {tp * pp * cp} does not divide the {world} GPUs")
    rest, experts = shape.stage_split(tp, pp)
    stage = rest / tp + experts / ep
    weights, grads = int(2 * stage), int(4 * stage)
    optimizer = 0 if offload else int(12 * (rest / tp / max(dp * cp, 1) + experts / ep / max(expert_dp, 1)))
    critic = weights + grads + optimizer if work.critic else 0  # a critic trains every weight
    reference = weights if work.kl else 0
    if work.lora:  # the base frozen in bf16 (no gradients, no optimizer); the adapters train as weights do
        adapters = shape.stage_lora_params(tp, pp, work.lora, work.lora_modules)
        weights, grads = int(2 * stage + 2 * adapters), int(4 * adapters)
        optimizer = 0 if offload else int(12 * adapters / max(dp * cp, 1))
        reference = 0  # the base with the adapters off
    tokens = math.ceil(work.tokens / cp)
    per_layer = [shape.activation_bytes_per_layer(tokens, tp, i) for i in range(s.num_layers)]
    if recompute:
        activations = 2 * tokens * s.hidden_size // tp * s.num_layers + max(per_layer)
    else:
        activations = sum(per_layer)
    logits = 8 * tokens * s.padded_vocab_size(tp) // tp
    fp8_caches = int(2 * stage) if work.fp8 else 0
    peak = weights + grads + optimizer + reference + critic + activations + logits + fp8_caches + OVERHEAD
    if peak > USABLE * gpu_bytes:
        problems.append(f"training needs {peak / GiB:.1f} GiB, more than {USABLE:.0%} of the GPU's "
                        f"{gpu_bytes / GiB:.0f} GiB")
    e = Estimate(tp, pp, cp, dp, recompute, offload, weights, grads, optimizer, reference, critic, activations,
                 logits, OVERHEAD, peak, rollout_gpus=rollout_gpus, problems=problems, ep=ep, moe=s.is_moe,
                 lora=work.lora, fp8_caches=fp8_caches)
    e.sleep = work.sleep and not rollout_gpus
    _size_engines(e, shape, world, gpus_per_node, gpu_bytes, work)
    if not rollout_gpus and e.engine_tp:
        # the engines' weights back next to what the trainer keeps for the push: its weights alone
        # when it sleeps (all the rest left first: megarl.backends.sleep.WorkerSleep) and the FP8
        # copies the probe's forward builds before the weights sleep (no transpose without gradients),
        # everything awake
        kept = e.weights + e.fp8_caches // 2 if e.sleep else e.static + e.fp8_caches
        e.sync_peak = kept + e.engine_weights + SYNC_BUFFERS + OVERHEAD + ENGINE_CONTEXT
        if e.sync_peak > USABLE * gpu_bytes:
            e.problems.append(f"the weight sync needs {e.sync_peak / GiB:.1f} GiB when the engines' weights come back "
                              f"next to the trainer's {kept / GiB:.1f} GiB, more than {USABLE:.0%} of the GPU")
    return e


def engine_memory(e: Estimate, gpu_bytes: int, sleep: bool = False) -> tuple[int, int]:
    """(B, F): what an engine's weights and KV cache may take on one of its GPUs, and the memory
    free there when it starts (what SGLang's mem_fraction_static is a fraction of)."""
    if e.rollout_gpus:
        return int(USABLE * gpu_bytes) - ENGINE_CONTEXT - ENGINE_RUNTIME, gpu_bytes - ENGINE_CONTEXT
    if sleep:  # the trainer asleep from before the engines start: its CUDA context is all it keeps
        return (int(USABLE * gpu_bytes) - TRAINER_ASLEEP - ENGINE_CONTEXT - ENGINE_RUNTIME,
                gpu_bytes - TRAINER_ASLEEP - ENGINE_CONTEXT)
    # no FP8 cache at launch: the engines start before the trainer's first forward
    return (int(USABLE * gpu_bytes) - e.static - e.fp8_caches - OVERHEAD - ENGINE_CONTEXT - ENGINE_RUNTIME,
            gpu_bytes - e.static_at_launch - OVERHEAD - ENGINE_CONTEXT)


def _size_engines(e: Estimate, shape: ModelShape, world: int, gpus_per_node: int, gpu_bytes: int,
                  work: Workload) -> None:
    budget, free = engine_memory(e, gpu_bytes, work.sleep)
    engine_gpus = e.rollout_gpus or world
    total = 2 * shape.params()
    within = [t for t in (1, 2, 4, 8) if t <= gpus_per_node and engine_gpus % t == 0]
    across = [gpus_per_node * n for n in (2, 4) if engine_gpus % (gpus_per_node * n) == 0]
    # weights in at most half of the budget; else (a model whose weights fill a node: a large
    # mixture of experts) the smallest TP that leaves KV cache for one sequence; an engine
    # spans whole nodes (SGLang --nnodes: megarl.rollout.engine_unit) only where none within one fits
    fits = []
    for sizes in (within, across):
        fits = fits or [t for t in sizes if total / t <= budget / 2] or \
            [t for t in sizes if budget - total / t >= work.sequence * shape.kv_bytes_per_token(t)]
    if fits:
        e.engine_tp, e.engines = fits[0], engine_gpus // fits[0]
    if not e.engine_tp:
        where = (f"on GPUs of {gpu_bytes / GiB:.0f} GiB" if e.rollout_gpus
                 else f"next to the sleeping trainer's {TRAINER_ASLEEP / GiB:.0f} GiB" if work.sleep
                 else f"next to the trainer's {(e.static + e.fp8_caches) / GiB:.1f} GiB")
        e.problems.append(f"no room for SGLang engines {where} (an engine's weights would take more than half "
                          f"of the {max(budget, 0) / GiB:.1f} GiB left, and leave no KV cache for one "
                          f"{work.sequence}-token sequence)")
        return
    e.engine_weights = int(total / e.engine_tp)
    e.mem_fraction_static = math.floor(100 * budget / free) / 100
    e.kv_cache = int(e.mem_fraction_static * free) - e.engine_weights  # what SGLang makes of the rounded value
    e.kv_tokens = e.kv_cache // shape.kv_bytes_per_token(e.engine_tp)
    e.sequences_per_engine = e.kv_tokens // work.sequence
    if e.sequences_per_engine < 1:
        e.problems.append(f"the KV cache left ({e.kv_cache / GiB:.1f} GiB) does not hold one "
                          f"{work.sequence}-token sequence")
    else:
        e.rollout_waves = math.ceil(work.rollout_batch / (e.sequences_per_engine * e.engines))


def plan_layouts(shape: ModelShape, nodes: int, gpus_per_node: int, gpu_bytes: int, work: Workload,
                 rollout_gpus: int = 0) -> list[Estimate]:
    """For each (TP, CP, PP) the first settings that fit in the order no recompute,
    recompute, recompute + offload (or the last tried, with its problems); feasible layouts
    first, by preference. With `rollout_gpus` the engines have that many GPUs of their own
    (disaggregated) and the trainer the rest."""
    if not 0 <= rollout_gpus < nodes * gpus_per_node:
        raise ValueError(f"--rollout-gpus {rollout_gpus}: give 0 (engines colocated with the trainer) or fewer than "
                         f"the {nodes * gpus_per_node} GPUs, so that the trainer keeps some")
    world = nodes * gpus_per_node - rollout_gpus
    out = []
    s = shape.spec
    eps = [e for e in (1, 2, 4, 8, 16, 32, 64, 128) if s.num_experts % e == 0] if s.is_moe else [1]
    for tp, cp in ((t, c) for t in (1, 2, 4, 8) for c in (1, 2, 4, 8)):
        for pp, ep in ((p, e) for p in range(1, 17) if s.num_layers % p == 0 for e in eps):
            if tp * cp > gpus_per_node or world % (tp * pp * cp) or world % (ep * pp):
                continue
            for recompute, offload in ((False, False), (True, False), (True, True)):
                e = estimate(shape, world, gpus_per_node, gpu_bytes, work, tp=tp, pp=pp, cp=cp, recompute=recompute,
                             offload=offload, rollout_gpus=rollout_gpus, ep=ep)
                if not e.problems:
                    break
            out.append(e)
    return sorted(out, key=preference)


def step_time(shape: ModelShape, e: Estimate, nodes: int, gpus_per_node: int, work: Workload, prompt: float,
              response: float, gpu: str = "H100") -> StepTime:
    """megarl.planner_time's estimate of one step on layout `e`, sequences of `prompt` + `response`
    tokens on average."""
    world = nodes * gpus_per_node - e.rollout_gpus
    step = StepWork(work.rollout_batch, prompt, response, work.max_response_length, forwards=1 + work.kl,
                    recompute=e.recompute, critic=work.critic, lora=bool(work.lora))
    return estimate_step(shape, step, train_gpus=world, engine_gpus=e.rollout_gpus or world, engine_tp=e.engine_tp,
                         kv_tokens_per_engine=e.kv_tokens, colocated=not e.rollout_gpus, gpu=GPUS[gpu])


def what_would_fit(shape: ModelShape, nodes: int, gpus_per_node: int, gpu_bytes: int, work: Workload,
                   rollout_gpus: int = 0) -> list[str]:
    """Where no layout fits: the changes that would give one (the engines on GPUs of their own,
    the trainer asleep while they generate, twice or four times the nodes), each checked."""
    def fits(n: int, rollout: int, w: Workload) -> bool:
        return any(not e.problems for e in plan_layouts(shape, n, gpus_per_node, gpu_bytes, w, rollout))

    found = []
    if not rollout_gpus and fits(nodes, nodes * gpus_per_node // 2, work):
        found.append(f"the engines on {nodes * gpus_per_node // 2} GPUs of their own (--rollout-gpus "
                     f"{nodes * gpus_per_node // 2}, rollout.mode=disaggregated)")
    if not rollout_gpus and not work.sleep and fits(nodes, 0, Workload(**{**asdict(work), "sleep": True})):
        found.append("the trainer asleep while the engines generate (trainer.sleep_during_generation, without --no-sleep)")
    for more in (2 * nodes, 4 * nodes):
        if fits(more, rollout_gpus * more // nodes, work):
            found.append(f"{more} nodes")
            break
    return found or ["none of: the engines on GPUs of their own, the trainer asleep, 4x the nodes; shorter "
                     "sequences or GPUs with more memory (FP8 engine weights are not planned for yet)"]


def preference(e: Estimate) -> tuple:
    return bool(e.problems), e.offload, e.recompute, e.cp, e.pp, e.tp, e.ep


def parse_bytes(text: str) -> int:
    """'80GB' / '80GiB' / '80' (GiB) -> bytes; GPU memory is quoted in binary units."""
    m = re.fullmatch(r"\s*([\d.]+)\s*(G|GB|GiB|T|TB|TiB)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"--gpu-memory {text!r}: give a size such as 80GB")
    unit = (m.group(2) or "G").upper()[0]
    return int(float(m.group(1)) * (GiB if unit == "G" else 1024 * GiB))


def render(shape: ModelShape, nodes: int, gpus_per_node: int, gpu_bytes: int, work: Workload,
           estimates: list[Estimate], top: int, rollout_gpus: int = 0) -> str:
    g = lambda b: f"{b / GiB:6.1f}"  # noqa: E731
    engines = (f"{rollout_gpus} of them the engines' own" if rollout_gpus else
               "engines colocated with the trainer, which sleeps while they generate" if work.sleep else
               "engines colocated with the trainer, which keeps its memory")
    actor = f"LoRA rank {work.lora} on {', '.join(work.lora_modules)}, the base frozen; " if work.lora else ""
    actor += "FP8 GEMMs (TE's weight caches); " if work.fp8 else ""
    lines = [f"{shape.spec.family} model, {shape.params() / 1e9:.2f}B parameters; {actor}{nodes} nodes x {gpus_per_node} "
             f"GPUs of {gpu_bytes / GiB:.0f} GiB ({engines}); sequences up to {work.sequence} tokens "
             f"({work.max_prompt_length} prompt + {work.max_response_length} response), micro-batches of "
             f"{work.tokens} tokens; rollout batch {work.rollout_batch} sequences",
             "", "memory per GPU in GiB while training (w = weights, g = grads, opt = optimizer, act = activations):",
             "  TP PP CP EP DP recompute offload |      w      g    opt    act logits   peak | engines x TP  KV GiB  "
             "seq/engine waves mem_frac"]
    shown = [e for e in estimates if not e.problems][:top]
    for e in shown:
        lines.append(f"  {e.tp:2d} {e.pp:2d} {e.cp:2d} {e.ep:2d} {e.dp:2d} {'yes' if e.recompute else 'no':>9} "
                     f"{'yes' if e.offload else 'no':>7} | {g(e.weights)} {g(e.grads)} {g(e.optimizer)} "
                     f"{g(e.activations)} {g(e.logits)} {g(e.train_peak)} | {e.engines:7d} x {e.engine_tp:2d} "
                     f"{g(e.kv_cache)} {e.sequences_per_engine:10d} {e.rollout_waves:5d} {e.mem_fraction_static:8.2f}")
    if not shown:
        lines.append("  (no layout fits)")
    ruled_out = [e for e in estimates if e.problems]
    if ruled_out:
        lines += ["", "ruled out:"]
        lines += [f"  TP={e.tp} PP={e.pp}{f' CP={e.cp}' if e.cp > 1 else ''}{f' EP={e.ep}' if e.moe else ''}"
                  f"{' recompute' if e.recompute else ''}"
                  f"{' offload' if e.offload else ''}: "
                  + "; ".join(e.problems) for e in ruled_out]
    if shown:
        lines += ["", "recommended (megarl train overrides): " + " ".join(overrides(shown[0]))]
    return "\n".join(lines)


def overrides(e: Estimate) -> list[str]:
    """A layout as `megarl train` key=value overrides (what the slurm recipes append); with a
    critic, its settings too (actor and critic share one layout)."""
    workers = ("actor", "critic") if e.critic else ("actor",)
    out = []
    for w in workers:
        out += [f"{w}.parallel.tensor_model_parallel_size={e.tp}", f"{w}.parallel.pipeline_model_parallel_size={e.pp}",
                f"{w}.parallel.context_parallel_size={e.cp}", f"{w}.parallel.data_parallel_size={e.dp}", f"{w}.gradient_checkpointing={str(e.recompute).lower()}",
                f"{w}.optim.offload={str(e.offload).lower()}"]
        if e.moe:
            out += [f"{w}.parallel.expert_model_parallel_size={e.ep}", f"{w}.parallel.expert_tensor_parallel_size=1"]
    mode = "disaggregated" if e.rollout_gpus else "colocated"
    engines = [f"rollout.expert_parallel_size={e.engine_tp}"] if e.moe else []
    if not e.rollout_gpus and not e.sleep:
        engines.append("trainer.sleep_during_generation=false")
    if e.lora:
        out.append(f"actor.lora.r={e.lora}")
    return out + [f"rollout.mode={mode}", f"rollout.tensor_parallel_size={e.engine_tp}",
                  f"rollout.gpu_memory_utilization={e.mem_fraction_static}", *engines]


def add_plan_command(sub) -> None:
    p = sub.add_parser("plan", help="Recommend parallel layouts with the memory per GPU they need.")
    p.add_argument("--config", help="a run's config: the settings below from it and its key=value overrides "
                                    "(megarl.planner_config); a flag given wins")
    p.add_argument("settings", nargs="*", metavar="key=value", help="overrides of --config, as megarl train takes them")
    p.add_argument("--model", help=f"HF config.json / model directory, or one of: {', '.join(KNOWN_MODELS)}")
    p.add_argument("--nodes", type=int)
    p.add_argument("--gpus-per-node", type=int, help="default 8")
    p.add_argument("--gpu-memory", default="80GB", help="memory of one GPU, e.g. 80GB (binary units)")
    p.add_argument("--max-prompt-length", type=int, help="default 2048")
    p.add_argument("--max-response-length", type=int, help="default 20480")
    p.add_argument("--max-tokens-per-gpu", type=int, help="tokens of one micro-batch (default: one sequence)")
    p.add_argument("--rollout-batch", type=int, help="sequences generated per step (default 8192)")
    p.add_argument("--kl", action="store_true", help="a frozen reference model is on the GPUs")
    p.add_argument("--critic", action="store_true", help="a critic (PPO) shares the GPUs")
    p.add_argument("--lora", type=int, metavar="RANK",
                   help="LoRA adapters of this rank on every linear layer (actor.lora.r), the base frozen")
    p.add_argument("--fp8", action="store_true", help="the actor's GEMMs in FP8 (actor.fp8): TE's FP8 weight caches")
    p.add_argument("--rollout-gpus", type=int,
                   help="GPUs of the engines' own (rollout.mode=disaggregated), the trainer takes the rest; "
                        "0 = engines colocated on the trainer's GPUs")
    p.add_argument("--no-sleep", action="store_true",
                   help="colocated engines next to a trainer that keeps its memory while they generate "
                        "(trainer.sleep_during_generation=false); by default it sleeps")
    p.add_argument("--mean-prompt-length", type=float, default=None,
                   help="mean prompt tokens, for the step-time estimate (default: half the longest)")
    p.add_argument("--mean-response-length", type=float, default=None,
                   help="mean response tokens, for the step-time estimate (default: half the longest)")
    p.add_argument("--gpu", choices=sorted(GPUS), default="H100", help="the GPU the step time is estimated for")
    p.add_argument("--job-time", help="the job's time limit as sbatch --time takes it (24:00:00, 1-00:00:00): a "
                   "warning when a step, or trainer.save_freq steps, would not fit in it")
    p.add_argument("--save-freq", type=int, help="steps between checkpoints (default: --config's trainer.save_freq)")
    p.add_argument("--estimate", action="store_true",
                   help="print only the step-time estimate of the recommended layout; status 1 if none fits")
    p.add_argument("--top", type=int, default=5, help="feasible layouts to show")
    p.add_argument("--json", action="store_true", help="every layout as JSON")
    p.add_argument("--overrides", action="store_true",
                   help="print only the recommended layout as megarl train overrides (for recipes), and its step-time "
                        "estimate on stderr; status 1 if none fits")
    p.set_defaults(func=_plan_command)


def _plan_command(args: argparse.Namespace) -> int:
    settle(args)
    if args.nodes < 1 or args.gpus_per_node < 1:
        raise ValueError("--nodes and --gpus-per-node must be at least 1")
    shape = ModelShape.load(args.model)
    gpu = parse_bytes(args.gpu_memory)
    work = Workload(args.max_prompt_length, args.max_response_length, args.max_tokens_per_gpu, args.rollout_batch,
                    args.kl, args.critic, sleep=not args.no_sleep, lora=args.lora, lora_modules=args.lora_modules,
                    fp8=args.fp8)
    estimates = plan_layouts(shape, args.nodes, args.gpus_per_node, gpu, work, args.rollout_gpus)
    feasible = [e for e in estimates if not e.problems]
    table = render(shape, args.nodes, args.gpus_per_node, gpu, work, estimates, args.top, args.rollout_gpus)
    prompt = args.mean_prompt_length or args.max_prompt_length / 2
    response = args.mean_response_length or args.max_response_length / 2
    step = step_time(shape, feasible[0], args.nodes, args.gpus_per_node, work, prompt, response, args.gpu) \
        if feasible else None
    timing = describe(step, GPUS[args.gpu]) if step else ""
    if step and args.job_time:
        for warning in save_warnings(step.synchronous, args.save_freq, parse_job_time(args.job_time)):
            print(f"megarl plan: warning: {warning}", file=sys.stderr)
    if args.estimate:
        if not feasible:
            print(table, file=sys.stderr)
            return 1
        print(timing)
        return 0
    if not feasible:
        table += "\n\nwould fit with: " + "; or ".join(
            what_would_fit(shape, args.nodes, args.gpus_per_node, gpu, work, args.rollout_gpus))
    if args.overrides:
        if not feasible:
            print(table, file=sys.stderr)
            return 1
        print(" ".join(overrides(feasible[0])))
        print(timing, file=sys.stderr)  # what a step of it should take, for the log of the run it starts
        return 0
    if args.json:
        json.dump([asdict(e) for e in estimates], sys.stdout, indent=1)
        print()
    else:
        print(table + (f"\n{timing}\n  for prompts of {prompt:.0f} and responses of {response:.0f} tokens on average "
                       "(--mean-prompt-length, --mean-response-length)" if timing else ""))
    return 0 if feasible else 1
