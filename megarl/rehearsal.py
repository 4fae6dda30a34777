"""A run's parallel layout rehearsed in miniature on one CPU machine.

What breaks at scale is mostly a relation between the parallel groups, not their size: more
data-parallel ranks than rows to split (the weights probe's few sequences at DP 32), expert
groups that span data-parallel replicas (whose micro-batch counts must then agree), pipeline
stages, a trainer that sleeps around generation. A rehearsal reads a run's config (a shipped
recipe's, or any user's), works out its layout's relations (`relations`), builds the smallest
layout that keeps them (`miniature`: degrees of 2 where the real one has more, the probe cut
to fewer sequences than the miniature's DP where the real DP outnumbers the probe's), and runs
it: real megatron-core over gloo on a tiny model of the run's family whose shapes divide the
degrees, Ray ranks, the weights probe, the gate and the sync, one step, a checkpoint, and a
resumed second step. It prints the real layout beside the miniature, relation by relation:
kept, or lost and why (what one CPU machine cannot hold).

The rehearsal checks the machinery, not learning: its task is sums whose prompts differ in
length (`rehearsal_rows`) and its reward the response's length, so every step has advantages
and moves the weights.
Main entry points: `relations`, `miniature`, `rehearse` (`megarl rehearse`).
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shape:
    """A megatron actor's layout and what runs around it."""
    tp: int
    pp: int
    vpp: int | None
    cp: int
    dp: int
    ep: int = 1
    etp: int = 1  # resolved: None in the config means TP
    moe: bool = False
    sequence_parallel: bool = False
    distributed_optimizer: bool = True
    recompute: bool = False
    dynamic: bool = False  # micro-batches by a token budget (actor.max_tokens_per_gpu)
    probe_sequences: int = 4
    engines: str = "disaggregated"  # or colocated: on the trainer's GPUs
    lora: str = "off"  # or merged, adapter (actor.lora.sync)
    async_rollouts: bool = False
    partial_rollouts: str = "off"
    fp8: bool = False
    offload: bool = False
    agent: bool = False  # multi-turn rollouts over tools (agent.max_turns > 0)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def ep_spans_dp(self) -> bool:
        """Whether an expert-parallel group reaches over data-parallel replicas: megatron lays the
        experts out as ETP x EP x expert-DP over the ranks of a pipeline stage, a DP replica holds
        TP x CP of them, so a group of EP x ETP wider than that takes ranks of other replicas."""
        return self.moe and self.ep * self.etp > self.tp * self.cp

    def describe(self) -> str:
        vpp = f" (VPP {self.vpp})" if self.vpp else ""
        experts = f", EP {self.ep}, ETP {self.etp}" if self.moe else ""
        return (f"TP {self.tp} x PP {self.pp}{vpp} x CP {self.cp} x DP {self.dp} = {self.world} ranks{experts}")


def shape_of(cfg, moe: bool) -> Shape:
    """The actor's Shape in a run config (its data-parallel size as the run resolves it)."""
    p, a = cfg.actor.parallel, cfg.actor
    dp = cfg.train_world_size() // p.model_parallel_size
    lora = a.lora.sync if a.lora.enabled else "off"
    return Shape(tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
                 vpp=p.virtual_pipeline_model_parallel_size, cp=p.context_parallel_size, dp=dp,
                 ep=p.expert_model_parallel_size if moe else 1,
                 etp=(p.expert_tensor_parallel_size or p.tensor_model_parallel_size) if moe else 1, moe=moe,
                 sequence_parallel=p.sequence_parallel and p.tensor_model_parallel_size > 1,
                 distributed_optimizer=p.use_distributed_optimizer, recompute=a.gradient_checkpointing,
                 dynamic=a.max_tokens_per_gpu is not None, probe_sequences=cfg.sync.probe.sequences,
                 engines=cfg.rollout.mode if cfg.rollout.engine == "sglang" else "embedded",
                 lora=lora, async_rollouts=cfg.trainer.async_rollout.enable,
                 partial_rollouts=cfg.trainer.async_rollout.partial_rollouts,
                 fp8=a.fp8 is not None, offload=a.optim.offload, agent=cfg.agent.max_turns > 0)


def relations(s: Shape) -> dict[str, str]:
    """Each relation of a layout that its miniature must keep, as a short statement of its value."""
    yes = {True: "yes", False: "no"}
    return {
        "DP > probe sequences": f"{yes[s.dp > s.probe_sequences]} ({s.dp} vs {s.probe_sequences})",
        "EP spans DP replicas": (f"{yes[s.ep_spans_dp]} (EP x ETP {s.ep * s.etp} vs TP x CP {s.tp * s.cp})"
                                 if s.moe else "no experts"),
        "TP > 1": yes[s.tp > 1], "PP > 1": yes[s.pp > 1], "virtual pipeline": yes[bool(s.vpp)],
        "CP > 1": yes[s.cp > 1], "DP > 1": yes[s.dp > 1],
        "ETP < TP": yes[s.moe and s.etp < s.tp], "EP > 1": yes[s.ep > 1],
        "sequence parallel": yes[s.sequence_parallel], "distributed optimizer": yes[s.distributed_optimizer],
        "recompute": yes[s.recompute], "dynamic micro-batches": yes[s.dynamic],
        "engines": s.engines, "LoRA": s.lora, "async rollouts": yes[s.async_rollouts],
        "partial rollouts": s.partial_rollouts, "FP8": yes[s.fp8], "optimizer offload": yes[s.offload],
        "agent turns": yes[s.agent],
    }


# what one CPU machine cannot hold, by relation: why the miniature runs without it
CPU_LOSSES = {
    "sequence parallel": "megatron's local layers (no Transformer Engine without a GPU) have no sequence-parallel "
                         "norms: the ranks run without it (results are the same; only activation memory differs)",
    "FP8": "Transformer Engine's FP8 kernels need a GPU",
    "TP > 1": "megatron's MoE layer trains with TP > 1 only under sequence parallelism, which its local layers "
              "(the CPU path) lack: a mixture of experts' miniature is TP 1 (tests/test_megatron_moe.py checks "
              "its forward at TP 2)",
    "ETP < TP": "the miniature of a mixture of experts is TP 1 (see TP > 1)",
    "EP > 1": "expert groups inside one replica need TP x CP > 1 ranks there, and a mixture of experts' miniature "
              "is TP 1 (see TP > 1): the miniature keeps the groups inside the replicas, at EP 1",
    "optimizer offload": "there is no GPU memory to offload from: the optimizer state is in host memory already",
    "LoRA": "adapters alone (actor.lora.sync=adapter) go through SGLang's own LoRA routes; the miniature's "
            "embedded engine takes the merged weights (make test-sglang syncs adapters into SGLang's CPU server)",
    "agent turns": "the rehearsal's task is single-turn arithmetic (no retriever to build): the layout sees token "
                   "rows either way, the agent loop is rehearsed by make test-slow's Search-R1 runs",
    "engines": "engines colocated on the trainer's GPUs release and resume GPU memory, which a CPU has not: the "
               "miniature keeps the trainer's sleep and wake around every generation and sync, the engines apart",
}


def miniature(real: Shape) -> Shape:
    """The smallest layout that keeps `real`'s relations: each degree above 2 cut to 2 (the
    virtual pipeline to 2 chunks a stage); DP 2 where the real one has replicas, with the probe cut
    to one sequence where the real DP outnumbers the probe's; EP as wide as the ranks of a
    pipeline stage where the real groups span replicas, else within one replica (TP x CP / ETP).
    A mixture of experts' miniature is TP 1: megatron trains its MoE layers at TP > 1 only with
    sequence parallelism, which the CPU's local layers do not have."""
    # megatron's MoE layer trains with TP > 1 only under sequence parallelism, which its local
    # layers (the CPU path) lack: a mixture of experts' miniature is TP 1 (CPU_LOSSES)
    tp, pp, cp = 1 if real.moe else min(real.tp, 2), min(real.pp, 2), min(real.cp, 2)
    dp = 1 if real.dp == 1 else 2
    probe = 1 if real.dp > real.probe_sequences else min(real.probe_sequences, 4)
    etp = min(real.etp, tp)
    ep = 1
    if real.moe and real.ep > 1:
        ep = tp * cp * dp // etp if real.ep_spans_dp else max(1, min(real.ep, tp * cp // etp))
    engines = "disaggregated" if real.engines == "colocated" else real.engines
    lora = "merged" if real.lora == "adapter" else real.lora  # adapters alone need SGLang's LoRA routes
    return replace(real, tp=tp, pp=pp, vpp=2 if real.vpp else None, cp=cp, dp=dp, ep=ep, etp=etp,
                   sequence_parallel=False, probe_sequences=probe, engines=engines, lora=lora, fp8=False,
                   offload=False, agent=False)


def compare(real: Shape, mini: Shape) -> list[tuple[str, str, str, str]]:
    """(relation, real, miniature, "kept" or why it is lost) for every relation."""
    r, m = relations(real), relations(mini)

    def same(name: str) -> bool:
        return r[name].split(" (")[0] == m[name].split(" (")[0]

    rows = []
    for name in r:
        if same(name):
            rows.append((name, r[name], m[name], "kept"))
        else:
            rows.append((name, r[name], m[name], "lost: " + CPU_LOSSES.get(name, "not kept by the miniature")))
    return rows


def model_family(model_path: str) -> str:
    """qwen3_moe for a mixture of experts, qwen2 otherwise: from the model's config.json where
    `model_path` holds one, else from the public configs `megarl plan` knows (by name, or by the
    directory's name: models/Qwen3-235B-A22B is Qwen/Qwen3-235B-A22B)."""
    from megarl.models.spec import ModelSpec
    from megarl.planner_models import KNOWN_MODELS

    if (Path(model_path) / "config.json").is_file():
        return "qwen3_moe" if ModelSpec.from_hf(model_path).is_moe else "qwen2"
    name = Path(model_path).name
    known = KNOWN_MODELS.get(model_path) or next((c for k, c in KNOWN_MODELS.items() if k.split("/")[-1] == name), None)
    if known is None:
        raise ValueError(f"model.path {model_path!r}: no config.json there and not a model megarl plan knows "
                         f"({', '.join(KNOWN_MODELS)}); pass --family qwen2 or qwen3_moe")
    return "qwen3_moe" if known.get("num_experts") else "qwen2"


def rehearsal_rows(split: str, count: int) -> list[dict]:
    """Sums a + b in the chat format of a DAPO-Math row, their prompts of 4 to 76 words (a filler
    sentence repeated 0 to 8 times): rows of different lengths, so a token budget packs several
    short ones or one long one and the DP ranks' micro-batch counts differ, as at scale."""
    rows = []
    for i in range(count):
        a, b = i % 10, (i * 7 + 3) % 10
        text = f"What is {a} + {b}?" + " Add the two numbers and give the sum." * ((i * 5 + 2) % 9)
        rows.append({"data_source": "rehearsal", "prompt": [{"role": "user", "content": text}], "ability": "MATH",
                     "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                     "extra_info": {"split": split, "index": i}})
    return rows


def build_inputs(out: Path, mini: Shape, family: str) -> dict[str, str]:
    """A tiny model of `family` whose shapes divide the miniature's degrees (4 heads on 2 KV heads
    for TP 2, layers a multiple of PP x VPP, 8 experts for EP up to 8), a tokenizer for the
    rehearsal's sums, and its train and validation data (`rehearsal_rows`), under `out`."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from megarl.data.tokenizer import train_bpe_tokenizer

    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    paths = {"train": data / "train.parquet", "val": data / "val.parquet"}
    train_rows, val_rows = rehearsal_rows("train", 64), rehearsal_rows("test", 4)
    pq.write_table(pa.Table.from_pylist(train_rows), paths["train"])
    pq.write_table(pa.Table.from_pylist(val_rows), paths["val"])
    tokenizer = train_bpe_tokenizer([r["prompt"][0]["content"] for r in train_rows] + [str(n) for n in range(19)],
                                    300)
    layers = max(2, mini.pp * (mini.vpp or 1))
    eos = tokenizer.eos_token_id
    config = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  tie_word_embeddings=False, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    if family == "qwen3_moe":
        config.update(model_type="qwen3_moe", head_dim=16, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                      router_aux_loss_coef=0.01)
    else:
        config.update(model_type="qwen2")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32)
    model_dir = out / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(model_dir)  # loads as the trainer will
    return {"model": str(model_dir), "train": str(paths["train"]), "val": str(paths["val"])}


def length_reward(data_source, solution_str, ground_truth, extra_info=None):
    """The rehearsal's reward: the response's length / 100 (every group has advantages)."""
    return {"score": len(solution_str) / 100, "acc": False}


def overrides_for(mini: Shape, real: Shape, inputs: dict[str, str], out: Path, steps: int) -> list[str]:
    """The recipe's config turned into its miniature: the layout, the tiny model and data, a few
    samples of a few tokens, Ray ranks on this machine's CPUs."""
    p = "actor.parallel"
    mini_batch = 1  # prompts: a mini-batch of rollout.n = 4 samples splits over DP 2
    kw = [f"model.path={inputs['model']}", "model.dtype=float32",
          f"data.train_files=[{inputs['train']}]", f"data.val_files=[{inputs['val']}]",
          "data.max_prompt_length=96", "data.train_batch_size=2", "data.gen_batch_size=2",
          "data.apply_chat_template=false",
          "rollout.engine=local", "rollout.n=4", "rollout.max_response_length=8", "rollout.val.n=1",
          "rollout.tensor_parallel_size=1", "rollout.expert_parallel_size=1", "agent.max_turns=0",
          "algorithm.overlong.buffer_len=2", "algorithm.dynamic_sampling.enable=false",
          "reward.custom_function=megarl.rehearsal:length_reward", "reward.num_workers=0",
          f"actor.ppo_mini_batch_size={mini_batch}", "actor.ppo_micro_batch_size=1", "actor.optim.lr=1e-3",
          "actor.optim.lr_warmup_steps=0", "actor.optim.offload=false", "actor.fp8=null",
          f"actor.max_tokens_per_gpu={'104' if mini.dynamic else 'null'}",
          f"{p}.tensor_model_parallel_size={mini.tp}", f"{p}.pipeline_model_parallel_size={mini.pp}",
          f"{p}.virtual_pipeline_model_parallel_size={mini.vpp or 'null'}", f"{p}.context_parallel_size={mini.cp}",
          f"{p}.data_parallel_size={mini.dp}", f"{p}.expert_model_parallel_size={mini.ep}",
          f"{p}.expert_tensor_parallel_size={mini.etp if mini.moe else 'null'}",
          f"sync.probe.sequences={mini.probe_sequences}", "sync.probe.tokens=16",
          f"trainer.output_dir={out}", f"trainer.total_training_steps={steps}", "trainer.save_freq=1",
          "trainer.test_freq=0", "trainer.val_before_train=false", "tracking.experiment_name=rehearsal",
          "cluster.launcher=ray", "cluster.ray_address=null", "cluster.nnodes=1", "cluster.gpus_per_node=0"]
    if real.engines == "colocated" and not real.async_rollouts:  # the trainer sleeps around generation, as colocated
        kw.append("trainer.sleep_during_generation=true")
    if mini.lora != real.lora:
        kw.append(f"actor.lora.sync={mini.lora}")
    return kw


class PeakMemory:
    """The machine's used memory (MemTotal - MemAvailable) at its highest while inside, above
    what it was on entry: Ray's rank processes are not this process's children."""

    def __init__(self, every_s: float = 0.5):
        self.every_s, self.peak, self._stop = every_s, 0, threading.Event()

    @staticmethod
    def used() -> int:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        return (int(info["MemTotal"].split()[0]) - int(info["MemAvailable"].split()[0])) * 1024

    def __enter__(self) -> PeakMemory:
        self.start = self.used()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(self.every_s):
            self.peak = max(self.peak, self.used() - self.start)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def layouts(config: str, overrides: list[str], family: str | None = None) -> tuple[Shape, Shape, str]:
    """(the real layout, its miniature, the tiny model's family) of the run `config` + `overrides`."""
    from megarl.config import load_config

    cfg = load_config(config, overrides, consistent=False)  # the real layout is not this machine's to check
    family = family or model_family(cfg.model.path)
    real = shape_of(cfg, moe=family == "qwen3_moe")
    return real, miniature(real), family


def rehearse(config: str, overrides: list[str], out: Path, family: str | None = None) -> dict:
    """Rehearse the run `config` (+ `overrides`) in miniature under `out`: step 1 with the probe,
    the gate and the sync, a checkpoint, then a resumed step 2. Returns what `report` prints."""
    from megarl.checkpoint import latest_checkpoint
    from megarl.config import load_config
    from megarl.train import train

    real, mini, family = layouts(config, overrides, family)
    result = table(config, real, mini, family)
    started = time.perf_counter()
    with PeakMemory() as memory:
        inputs = build_inputs(out / "inputs", mini, family)
        run_dir = out / "run"
        for steps in (1, 2):  # the second run resumes from the first's checkpoint
            train(load_config(config, overrides + overrides_for(mini, real, inputs, run_dir, steps)))
    result["seconds"] = round(time.perf_counter() - started, 1)
    result["peak_memory_gb"] = round(memory.peak / 2**30, 2)
    last = latest_checkpoint(run_dir / "checkpoints")
    result["resumed_to"] = None if last is None else last.name
    if last is None or last.name != "step_000002":
        raise RuntimeError(f"the rehearsal of {config} ended without its step 2 checkpoint (found {last})")
    return result


def table(config: str, real: Shape, mini: Shape, family: str) -> dict:
    """What `report` prints of a layout before (or without) its run."""
    return {"config": config, "family": family, "real": real.describe(), "miniature": mini.describe(),
            "relations": compare(real, mini)}


def report(result: dict) -> str:
    """The rehearsal's table: the real layout beside its miniature, relation by relation."""
    lines = [f"{result['config']} ({result['family']})",
             f"  real:      {result['real']}", f"  miniature: {result['miniature']}"]
    width = max(len(name) for name, *_ in result["relations"])
    for name, real, mini, verdict in result["relations"]:
        lines.append(f"  {name:<{width}}  {real:<28} {mini:<28} {verdict}")
    if "seconds" in result:
        lines.append(f"  ran step 1 (probe, gate, sync), checkpoint, resumed step 2: {result['seconds']:.0f} s, "
                     f"peak memory {result['peak_memory_gb']:.1f} GB above the start")
    return "\n".join(lines)


def add_rehearse_command(sub) -> None:
    p = sub.add_parser("rehearse", help="run a config's parallel layout in miniature on this machine's CPUs",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="the run's YAML (a recipe under examples/, or your own)")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    p.add_argument("--out", default="outputs/rehearsal", help="where the miniature's model, data and run go")
    p.add_argument("--family", choices=["qwen2", "qwen3_moe"], help="the tiny model's family (default: the run's)")
    p.add_argument("--dry-run", action="store_true", help="print the relations kept and lost, run nothing")
    p.set_defaults(func=_rehearse)


def _rehearse(args: argparse.Namespace) -> int:
    if args.dry_run:
        real, mini, family = layouts(args.config, args.overrides, args.family)
        print(report(table(args.config, real, mini, family)))
        return 0
    result = rehearse(args.config, args.overrides, Path(args.out), args.family)
    print(report(result))
    (Path(args.out) / "rehearsal.json").write_text(json.dumps(result, indent=1))
    return 0
