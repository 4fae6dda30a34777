"""The driver's data path at a recipe's size: from finished trajectories to what each train rank
receives, with megarl's own code and no model.

    python tools/bench/scale.py                    # DAPO-32B: 512 prompts x 16, responses to 20,480
    python tools/bench/scale.py --variant moe30b --prompts 16   # Qwen3-30B-A3B with routing replay
    python tools/bench/scale.py --prompts 128      # a quarter of the step, where memory is short

The trajectories are synthetic (the engines' part): response lengths log-normal, capped at the
recipe's maximum; each response ends in "Answer: N", right for a share of each group's samples
(some groups all right, so dynamic sampling drops them and draws again). The driver then runs
what `megarl train` runs after generation (megarl.train: score_samples, the informative-group
buffer, experience, updates) and calls rank actors through megarl's RemoteTrainWorker:
old log-probs, then the actor update. The rank actors run no model: each measures what it
received, works out the rows its data-parallel rank trains on as the Megatron backend does (a
contiguous share of every mini-batch) and plans their token-budget micro-batches
(megarl.backends.megatron.forward.plan_micro_batches).

It prints, per step, the driver's wall time and peak memory (above what it held before the
step's trajectories existed) against the step's raw token data (each generated
token's id as int32, its log-prob as float32, its loss-mask byte, and with routing replay its
experts as int16), and each rank's bytes received against its share (its rows' raw data). The
peak is printed two ways: resident (the kernel's high-water mark, VmHWM, reset as the step
starts; sampled every 10 ms where it cannot be reset), and the driver's own memory (anonymous
pages, RssAnon sampled every 10 ms: what it allocates), which leaves out the pages of Ray's object store that the shares were written to
(one shared mapping of the node's store, bounded and spilled by Ray, whose pages stay counted in
a process once it has touched them; the shares' bytes are the ranks' figure). Targets, last:
each rank at most its share + 5%; the driver's own peak at most 2x the raw data (every step);
its time under 2% of the recipe's estimated step time (`megarl plan`'s estimate for the recipe's
layout at the bench's mean lengths), the slowest of the timed steps that follow a warm-up step
(the first step touches the pages of Ray's object store the driver later reuses; it is printed,
not timed against the target). Exit status 1 when one is missed.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import ray
import torch


from megarl.config import RunConfig
from megarl.config_loader import load_config
from megarl.data.prompts import PromptRecord
from megarl.data.tokenizer import train_bpe_tokenizer
from megarl.experience import Sample
from megarl.reward.pool import RewardPool
from megarl.rollout.agent import TokenRow, Trajectory
from megarl.rollout.token_rows import VersionRuns
from megarl.runtime.ray_proxies import RemoteTrainWorker
from megarl.runtime.stored_rows import fetched
from megarl.train import collect_samples, experience, in_update_order, score_samples, updates
from megarl.versions import installed_versions

RECIPES = {"dapo32b": ("examples/dapo/dapo_qwen2.5_32b.yaml", "Qwen2.5-32B", 8, (8, 2, 4)),
           "moe30b": ("examples/dapo/dapo_qwen3_30b_a3b.yaml", "Qwen3-30B-A3B", 8, (4, 1, 8))}
ROUTING_WIDTH = 48 * 8  # Qwen3-30B-A3B: 48 MoE layers x top-8


class Peak:
    """The process's largest memory while running, two ways: resident (all its pages in memory,
    Ray's object store pages it wrote to included: the store is one shared mapping, its pages
    stay counted once touched), the kernel's high-water mark (/proc's VmHWM, reset at the start
    and at each phase through clear_refs; sampled where that cannot be reset), and its own
    (anonymous pages: its heap, arrays and tensors; /proc's RssAnon, sampled every `every_s`)."""

    def __init__(self, every_s: float = 0.01):
        self.proc, self.every_s, self._stop = psutil.Process(), every_s, threading.Event()
        self.peak = self.peak_own = 0
        self.phases: dict[str, tuple[int, int]] = {}  # phase -> the largest (resident, own) while it ran
        self._phase_peak = (0, 0)
        self.high_water = False  # whether resident is VmHWM (else sampled)
        self._lock = threading.Lock()  # the sampling thread's takes against a phase's end

    def phase(self, name: str) -> None:
        """The phase that ended now: remember the largest sizes since the previous one ended."""
        with self._lock:
            self._take(self.sizes())
            self.phases[name] = self._phase_peak
            self._reset_high_water()
            self._phase_peak = self.sizes()

    def sizes(self) -> tuple[int, int]:
        """(resident, own) bytes now; resident is the high-water mark since its reset when kept."""
        info = self.proc.memory_info()
        resident, anon = info.rss, info.rss - info.shared
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f)
            anon = int(fields["RssAnon"].split()[0]) * 1024
            if self.high_water:
                resident = max(resident, int(fields["VmHWM"].split()[0]) * 1024)
        except (OSError, KeyError, ValueError):
            pass
        return resident, anon

    def _reset_high_water(self) -> None:
        try:
            with open(f"/proc/{self.proc.pid}/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the resident size now (Linux 4.0+)
            self.high_water = True
        except OSError:
            self.high_water = False

    def _take(self, now: tuple[int, int]) -> None:
        self.peak, self.peak_own = max(self.peak, now[0]), max(self.peak_own, now[1])
        self._phase_peak = (max(self._phase_peak[0], now[0]), max(self._phase_peak[1], now[1]))

    def __enter__(self):
        self._reset_high_water()
        self._take(self.sizes())
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(self.every_s):
            with self._lock:
                self._take(self.sizes())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._take(self.sizes())


def raw_bytes(t: Trajectory) -> int:
    """A trajectory's raw token data: id int32, log-prob float32, mask byte; routing int16."""
    tokens = len(t.prompt_ids) + len(t.response_ids)
    return 9 * tokens + sum(r.numel() * 2 for r in t.routed_experts)


def tensor_bytes(obj) -> int:
    """The bytes of every tensor reachable from `obj` through dataclass fields, tuples and lists."""
    if isinstance(obj, torch.Tensor):
        return obj.untyped_storage().nbytes()
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(x) for x in obj)
    if hasattr(obj, "__dataclass_fields__"):
        return sum(tensor_bytes(getattr(obj, f)) for f in obj.__dataclass_fields__)
    return 0


@ray.remote(num_cpus=0)
class RankStandIn:
    """A train rank that runs no model: it keeps what it was sent and answers as a rank would."""

    def __init__(self, dp_rank: int, dp_size: int, max_tokens: int):
        self.dp_rank, self.dp_size, self.max_tokens = dp_rank, dp_size, max_tokens
        self.received: list[tuple[str, int, list[int]]] = []  # (method, bytes received, its rows' lengths)

    def ping(self) -> int:
        return 0

    def run(self, method: str, *args):
        from megarl.backends.megatron.forward import plan_micro_batches
        from megarl.backends.packed import DataShare

        if method == "data_parallel":
            return self.dp_rank, self.dp_size
        args = fetched(args)  # as a rank does: the share's routing read from the object store
        share = args[0]
        if not isinstance(share, DataShare) or (share.dp_rank, share.dp_size) != (self.dp_rank, self.dp_size):
            raise ValueError(f"rank of DP {self.dp_rank}/{self.dp_size} was sent {type(share).__name__}")
        lengths = share.batch.lengths.tolist()
        self.received.append((method, tensor_bytes(args), lengths))
        plan_micro_batches(lengths, micro_batch_size=1, max_tokens=self.max_tokens)  # the rank's first step
        if method == "compute_log_prob":
            return torch.zeros(share.batch.num_tokens), None
        return {"loss": 0.0}

    def report(self) -> list[tuple[str, int, list[int]]]:
        out, self.received = self.received, []
        return out


def expected_shares(lengths: list[int], method: str, dp_size: int, mini_rows: int, per_token: int,
                    routing_width: int):
    """Each DP rank's rows (their lengths) and their raw bytes, worked out from the whole batch's
    row lengths as the Megatron backend takes them: a contiguous part of every mini-batch for an
    update, of the whole batch for a forward pass. Raw: `per_token` bytes a token, routing int16 a
    position."""
    n = len(lengths)
    if method == "compute_log_prob":
        bounds = [n * r // dp_size for r in range(dp_size + 1)]
        rows = [list(range(bounds[r], bounds[r + 1])) for r in range(dp_size)]
    else:
        rows = [[] for _ in range(dp_size)]
        for start in range(0, n, mini_rows):
            share = min(mini_rows, n - start) // dp_size
            for r in range(dp_size):
                rows[r] += range(start + r * share, start + (r + 1) * share)
    return [([lengths[i] for i in part], sum(lengths[i] * per_token + (lengths[i] - 1) * 2 * routing_width
                                              for i in part)) for part in rows]


class PromptOrder:
    """The records in turn (what megarl.data's sampler gives the loop)."""

    def __init__(self, size: int):
        self.size, self.next = size, 0

    def take(self, n: int) -> list[int]:
        out = [(self.next + i) % self.size for i in range(n)]
        self.next += n
        return out


@dataclass
class Driver:
    """What megarl.train's functions read of `Components` on this path."""

    cfg: RunConfig
    tokenizer: object
    reward_pool: RewardPool
    worker: RemoteTrainWorker
    reward_lock: threading.Lock
    train_records: list[PromptRecord]
    prompt_order: PromptOrder


def synthetic_samples(args, cfg: RunConfig, tokenizer, gen: np.random.Generator, records: list[PromptRecord],
                      group_base: int) -> list[Sample]:
    """One generation batch: n trajectories of each record, as the agent loop leaves them."""
    cap = cfg.rollout.max_response_length
    right, wrong = tokenizer.encode("\nAnswer: 7"), tokenizer.encode("\nAnswer: 3")
    samples = []
    for g, record in enumerate(records):
        p_right = 1.0 if gen.random() < args.solved_fraction else 0.5
        for _ in range(cfg.rollout.n):
            length = min(cap, max(len(right), int(np.exp(np.log(args.median_response) + args.sigma * gen.normal()))))
            tail = right if gen.random() < p_right else wrong
            ids = np.concatenate([gen.integers(5, tokenizer.vocab_size, length - len(tail)), tail]).astype(np.int32)
            positions = len(record.prompt_ids) + length - 1
            routed = ([torch.from_numpy(gen.integers(0, 128, (positions, ROUTING_WIDTH), dtype=np.int16))]
                      if args.variant == "moe30b" else [])
            t = Trajectory(record.prompt_ids, response_ids=TokenRow("i", ids.tobytes()),
                           loss_mask=TokenRow("b", b"\x01" * length),
                           rollout_log_probs=TokenRow("f", gen.uniform(-3, 0, length).astype(np.float32).tobytes()),
                           token_versions=VersionRuns([0] * length), num_turns=1, routed_experts=routed)
            samples.append(Sample(record, group_base + g, t))
    return samples


def one_step(args, d: Driver, gen: np.random.Generator, step: int) -> dict:
    """megarl.train's collect_samples (the engines' part synthetic, not timed), experience and
    the actor update's transfer."""
    cfg = d.cfg
    gc.collect()
    before, before_own = Peak().sizes()
    engines = {"s": 0.0, "raw": 0, "generated": 0}

    def generate(c, records, n, seed_base, group_base, validation=False):
        start = time.perf_counter()
        samples = synthetic_samples(args, cfg, d.tokenizer, gen, records, group_base)
        engines["s"] += time.perf_counter() - start
        engines["raw"] += sum(raw_bytes(s.trajectory) for s in samples)
        engines["generated"] += len(samples)
        return samples, score_samples(c, samples)

    with Peak() as peak:
        start = time.perf_counter()
        metrics: dict = {}
        kept = collect_samples(d, step, metrics, generate)
        peak.phase("generate and score")
        batch = experience(d, in_update_order(cfg, kept, step), metrics)
        peak.phase("batch, old log-probs, advantages")
        width = ROUTING_WIDTH if cfg.actor.moe_routing_replay else 0
        mini = cfg.actor.ppo_mini_batch_size * cfg.rollout.n
        tokens = sum(len(s.trajectory.prompt_ids) + len(s.trajectory.response_ids) for s in kept)
        responses = [len(s.trajectory.response_ids) for s in kept]
        n_kept = len(kept)
        del kept  # as megarl.train's train_step does
        updates(d, batch, step, metrics)
        peak.phase("update's shares")
        driver_s = time.perf_counter() - start - engines["s"]
    expected = {"compute_log_prob": expected_shares(batch.lengths.tolist(), "compute_log_prob", args.dp, mini, 5, width),
                "update_actor": expected_shares(batch.lengths.tolist(), "update_actor", args.dp, mini, 13, width)}
    raw = engines["raw"]
    measure = "VmHWM" if peak.high_water else "sampled"
    print(f"  peak by phase, resident ({measure}; in brackets its own, RssAnon): " + ", ".join(
        f"{k} +{(v - before) / 2**30:.2f} GiB (+{(own - before_own) / 2**30:.2f})" for k, (v, own) in peak.phases.items()))
    return {"driver_s": driver_s, "peak": peak.peak - before, "peak_own": peak.peak_own - before_own, "measure": measure, "raw": raw, "gen_batches": int(metrics["train/gen_batches"]),
            "expected": expected,
            "kept": n_kept, "generated": engines["generated"], "tokens": tokens,
            "mean_response": sum(responses) / len(responses), "max_response": max(responses)}


def rank_figures(reports: list, expected: dict, dp: int, ranks: int) -> tuple[float, int]:
    """(the largest bytes received over the rank's share, the most bytes a rank received); each
    rank must have been sent exactly its share's rows."""
    worst, most = 0.0, 0
    for rank, report in enumerate(reports):
        for method, got, lengths in report:
            rows, share = expected[method][rank * dp // ranks]
            if lengths != rows:
                raise AssertionError(f"rank {rank} was sent other rows than its share for {method}")
            worst, most = max(worst, got / share), max(most, got)
    return worst, most


def estimated_step_s(model: str, nodes: int, layout: tuple[int, int, int], cfg: RunConfig, prompt: float,
                     response: float) -> float:
    """`megarl plan`'s estimate of the recipe's step on its layout, at these mean lengths."""
    from megarl.planner import Workload, plan_layouts, step_time
    from megarl.planner_models import ModelShape

    shape = ModelShape.load(model)
    work = Workload(cfg.data.max_prompt_length, cfg.rollout.max_response_length, cfg.actor.max_tokens_per_gpu,
                    512 * cfg.rollout.n)
    layouts = [e for e in plan_layouts(shape, nodes, 8, 80 << 30, work) if not e.problems]
    tp, pp, dp = layout
    chosen = next((e for e in layouts if (e.tp, e.pp, e.dp) == (tp, pp, dp)), layouts[0])
    return step_time(shape, chosen, nodes, 8, work, prompt, response).synchronous


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", choices=sorted(RECIPES), default="dapo32b",
                   help="moe30b: the Qwen3-30B-A3B recipe with routing replay on")
    p.add_argument("--prompts", type=int, default=512, help="prompts a step (the recipe's train_batch_size: 512)")
    p.add_argument("--prompt-length", type=int, default=256)
    p.add_argument("--median-response", type=int, default=4096)
    p.add_argument("--sigma", type=float, default=1.0, help="of the log-normal response lengths")
    p.add_argument("--solved-fraction", type=float, default=0.2,
                   help="groups whose samples are all right (dynamic sampling drops them)")
    p.add_argument("--ranks", type=int, default=8, help="rank actors (the recipe's DP groups, 2 ranks each)")
    p.add_argument("--steps", type=int, default=2, help="timed steps, after the warm-up step")
    p.add_argument("--warmup-steps", type=int, default=1,
                   help="steps run first and printed, not timed against the target (Ray's object store pages "
                        "are first touched then)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    print(installed_versions(), flush=True)
    path, model, nodes, layout = RECIPES[args.variant]
    overrides = [f"data.train_batch_size={args.prompts}", f"data.gen_batch_size={3 * args.prompts}",  # as the recipe's
                 "reward.num_workers=2"]
    if args.variant == "moe30b":
        overrides.append("actor.moe_routing_replay=true")
    if args.prompts < 32:  # the recipes' mini-batch: 32 prompts
        overrides.append(f"actor.ppo_mini_batch_size={args.prompts}")
    cfg = load_config(RunConfig, Path(__file__).resolve().parents[2] / path, overrides)
    dp = layout[2]
    if args.ranks % dp:
        raise SystemExit(f"--ranks {args.ranks}: give a multiple of the recipe's {dp} data-parallel ranks")
    print(f"recipe {path}: {args.prompts} prompts x {cfg.rollout.n} (generated {cfg.data.gen_batch_size} at a time, "
          f"dynamic sampling), responses log-normal (median "
          f"{args.median_response}, sigma {args.sigma}) capped at {cfg.rollout.max_response_length}; {args.ranks} rank "
          f"actors over {dp} data-parallel ranks", flush=True)
    tokenizer = train_bpe_tokenizer([f"Answer: {i} what is {i} plus {i}" for i in range(2000)], 1000)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=int(os.environ.get("MEGARL_BENCH_OBJECT_STORE", 6 << 30)))
    args.dp = dp
    actors = [RankStandIn.remote(r * dp // args.ranks, dp, cfg.actor.max_tokens_per_gpu or 1 << 30)
              for r in range(args.ranks)]
    ray.get([a.ping.remote() for a in actors])
    with RewardPool(cfg.reward, num_workers=2) as pool:
        gen = np.random.default_rng(args.seed)
        records = [PromptRecord(gen.integers(5, tokenizer.vocab_size, args.prompt_length).tolist(), "math_dapo", "7",
                                {}, index=i) for i in range(4 * args.prompts)]
        d = Driver(cfg, tokenizer, pool, RemoteTrainWorker(actors, False, cfg.cluster.liveness, {
            "actor": cfg.actor.ppo_mini_batch_size * cfg.rollout.n}), threading.Lock(), records,
            PromptOrder(len(records)))
        results = []
        for step in range(args.warmup_steps + args.steps):
            r = one_step(args, d, gen, step)
            r["warmup"] = step < args.warmup_steps
            reports = ray.get([a.report.remote() for a in actors])
            r["rank_ratio"], r["rank_bytes"] = rank_figures(reports, r.pop("expected"), dp, args.ranks)
            results.append(r)
            print(f"{'warm-up ' if r['warmup'] else ''}step {step}: {r['generated']} trajectories generated in {r['gen_batches']} batches, {r['kept']} kept, "
                  f"{r['tokens'] / 1e6:.1f}M tokens (mean response {r['mean_response']:.0f}, longest "
                  f"{r['max_response']}); driver {r['driver_s']:.1f} s, peak +{r['peak'] / 2**30:.2f} GiB resident "
                  f"({r['measure']}), +{r['peak_own'] / 2**30:.2f} GiB its own (RssAnon), against {r['raw'] / 2**30:.2f} GiB raw "
                  f"({r['peak'] / r['raw']:.2f}x, {r['peak_own'] / r['raw']:.2f}x); a rank received up to "
                  f"{r['rank_bytes'] / 2**30:.2f} GiB, {r['rank_ratio']:.2f}x its share", flush=True)
    ray.shutdown()
    mean_response = sum(r["mean_response"] for r in results) / len(results)
    scale = 512 / args.prompts  # the driver's work grows with the step's tokens
    step_s = estimated_step_s(model, nodes, layout, cfg, args.prompt_length, mean_response)
    driver_s = max(r["driver_s"] for r in results if not r["warmup"]) * scale
    worst_rank = max(r["rank_ratio"] for r in results)
    worst_peak = max(r["peak_own"] / r["raw"] for r in results)
    worst_resident = max(r["peak"] / r["raw"] for r in results)
    checks = [(f"each rank receives at most its share + 5%: up to {worst_rank:.2f}x", worst_rank <= 1.05),
              (f"driver's peak memory (its own, RssAnon; resident with the object store's pages, "
               f"{results[-1]['measure']}, {worst_resident:.2f}x) at "
               f"most 2x the raw token data: {worst_peak:.2f}x", worst_peak <= 2.0),
              (f"driver's time under 2% of the estimated step ({step_s:.0f} s for 512 prompts at these lengths): "
               f"{driver_s:.1f} s{' (scaled to 512 prompts)' if scale != 1 else ''} = {100 * driver_s / step_s:.2f}%",
               driver_s < 0.02 * step_s)]
    for text, ok in checks:
        print(f"target {'met' if ok else 'MISSED'}: {text}")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
