"""The training loop: one plain function, the data flow of docs/architecture.md from top to bottom.

    megarl train CONFIG.yaml [key=value ...]

Each step: draw prompts -> n rollouts each (search agent or single turn) -> rewards and
overlong shaping -> dynamic sampling until train_batch_size informative groups -> old /
reference log-probs, values -> advantages -> critic and actor updates -> weight sync to
the engine -> metrics, checkpoint, validation. Main entry point: `train`.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from tqdm import tqdm

from megarl import checkpoint, memory
from megarl.algo import InformativeGroupBuffer, masked_mean
from megarl.async_rollouts import SyncRollouts, start_rollouts
from megarl.backends.packed import PackedBatch
from megarl.backends.epochs import shuffled, update_permutation
from megarl.components import Components, build_components
from megarl.config import RunConfig, TrainWorkerConfig, save_config
from megarl.config_loader import dump_config, flatten_config
from megarl.driver_loop import run_async
from megarl.errors import ComponentDied, RunInputError
from megarl.experience import (EnginesDisagree, Sample, compute_advantages, gate, on_policy_tokens, reward_requests,
                               shape_overlong, to_train_batch)
from megarl.job_time import JobTimeUp, SaveClock
from megarl.rollout.agent import run_trajectories
from megarl.termination import closing, deferred, received, stop_on_signals
from megarl.weights.probe import WrongWeights
from megarl.resume_guard import check_resume
from megarl.run_report import HISTORY_KEYS, PROGRESS_KEYS, ROLLOUT_TABLE_ROWS, TALLIED, per_source_accuracy, plot_curves, \
    rollout_table, step_line, summary, tally_batch, tool_totals, tracking_line
from megarl.tracking import NullTracker, open_tracker

log = logging.getLogger(__name__)


class TrainingStopped(RuntimeError):
    """The run stopped on purpose (e.g. too many bad steps); the last good state is saved."""


@stop_on_signals  # SIGTERM / SIGINT stop it like Ctrl-C, even inside a blocking wait (megarl.termination)
def train(cfg: RunConfig) -> dict[str, float]:
    out = Path(cfg.trainer.output_dir)
    check_output_dir(out)  # before anything starts: a clear message, not a traceback from the first write
    ckpt_root = out / "checkpoints"
    resume_from = _resume_path(cfg, ckpt_root)  # verified before anything is started
    meta = checkpoint.read_meta(resume_from) if resume_from else {}
    params = flatten_config(cfg)
    if resume_from:  # the checkpoint's run, not another one by accident
        check_resume(meta.get("config"), params, resume_from, cfg.trainer.resume_changed_config)
    save_config(cfg, out / "config.yaml")
    c = build_components(cfg)
    step, bad_steps, rewardless_steps, history = meta.get("step", 0), 0, 0, meta.get("history", [])
    status, tracker = "FAILED", NullTracker()
    rollouts = None
    clock = SaveClock.for_run(cfg.trainer)  # saves on time: before the job's end, every N minutes
    try:
        # from step 0 with trainer.resume=auto: the output directory's run, if stopped before its first checkpoint
        rerun = params if not resume_from and cfg.trainer.resume == "auto" else None
        tracker = open_tracker(cfg.tracking, out, run_id=meta.get("run_id"), rerun_params=rerun)
        if (where := tracking_line(cfg.tracking, out, tracker.run_id)) is not None:
            print(where, file=sys.stderr, flush=True)
        if resume_from:
            c.for_training()
            c.worker.load_checkpoint(resume_from)
            c.prompt_order.load_state_dict(meta["sampler"])
            c.sync_weights(version=step)
            print(f"megarl: resumed from {resume_from} (step {step}){_requeued()}", file=sys.stderr, flush=True)
        else:
            tracker.log_params(params)
            tracker.log_text(dump_config(cfg), "config.yaml")
            if cfg.trainer.val_before_train and c.val_records:
                first = validate(c)
                tracker.log_metrics(first, step=0)
                history.append({"step": 0, "val/acc": first["val/acc"]})
        rollouts = start_rollouts(c, collect_samples, step)  # the async producer starts generating here
        progress = tqdm(range(step, c.total_steps), initial=step, total=c.total_steps, desc="megarl", unit="step")
        for step in progress:
            started = time.perf_counter()
            metrics = train_step(c, step, rollouts)
            if metrics.get("actor/skipped_steps", 0) > 0:
                bad_steps += 1
                if bad_steps >= cfg.trainer.max_bad_steps:
                    _save(c, ckpt_root, step + 1, tracker.run_id, history, rollouts)  # skipped steps left the weights good
                    raise TrainingStopped(f"{bad_steps} steps in a row had NaN/inf gradients (trainer.max_bad_steps)"
                                          f"; the last good state is the newest checkpoint in {ckpt_root}")
            else:
                bad_steps = 0
            done = step + 1
            if cfg.trainer.test_freq and c.val_records and (done % cfg.trainer.test_freq == 0 or done == c.total_steps):
                metrics.update(validate(c))
            rollouts.published(done)
            tracker.log_metrics(metrics, step=done)
            rewardless_steps = rewardless_steps + 1 if metrics.get("reward/failure_rate", 0.0) >= 1.0 else 0
            if rewardless_steps >= cfg.trainer.max_rewardless_steps:  # nothing scored: it would learn nothing
                raise TrainingStopped(
                    f"every sample's reward failed in {rewardless_steps} steps in a row (reward/failure_rate 1; "
                    "trainer.max_rewardless_steps): the reward cannot score this data. The log's reward warnings "
                    "name the failures (a bug in a custom function, a dead sandbox, answers it cannot read)")
            if cfg.tracking.log_rollouts_freq and done % cfg.tracking.log_rollouts_freq == 0:
                tracker.log_table(rollout_table(c, c.last_samples), f"rollouts/step_{done:06d}.json")
            history.append({k: metrics[k] for k in HISTORY_KEYS if k in metrics} | {"step": done})
            progress.set_postfix({short: f"{metrics[k]:.3f}" for short, k in PROGRESS_KEYS.items() if k in metrics})
            progress.write(step_line(done, c.total_steps, metrics), file=sys.stderr)
            saved = (cfg.trainer.save_freq and done % cfg.trainer.save_freq == 0) or done == c.total_steps \
                or clock.interval_due()
            if saved:
                _save(c, ckpt_root, done, tracker.run_id, history, rollouts, clock)
            clock.step_took(time.perf_counter() - started)
            if done < c.total_steps and (why := clock.time_up()):
                if not saved:
                    _save(c, ckpt_root, done, tracker.run_id, history, rollouts, clock)
                raise JobTimeUp(f"saved at step {done} and stopped: {why}")
        export_hf(c, out / "hf")
        tracker.log_artifact(plot_curves(history, out / "reward_curve.png"))
        status = "FINISHED"
        return history[-1] if history else {}
    except (KeyboardInterrupt, JobTimeUp):
        status = "KILLED"  # stopped, to be resumed: the rerun continues this MLflow run
        raise
    except ComponentDied as e:
        lost = _lost_parts(c)  # the lost node's other parts, while they can still be asked about
        raise type(e)(f"step {step + 1}, {e}" + (f"\n{lost}" if lost else "")) from e  # WrongWeights stays one
    finally:
        with closing():  # a signal from here on kills the run's processes at once instead
            if rollouts is not None:
                rollouts.close()
            tracker.close(status, stop_signal=received() if status == "KILLED" else None)
            c.close()
        print(summary(status, out, history, cfg.tracking))


def _lost_parts(c: Components) -> str:
    """What the runtime can say of the parts gone after one died; "" when it cannot tell (the
    question must not hide the error that raised it)."""
    try:
        return c.runtime.lost_parts()
    except Exception as e:  # noqa: BLE001 -- best effort, the ComponentDied is what matters
        log.warning("could not ask which parts are gone: %s: %s", type(e).__name__, e)
        return ""


def train_step(c: Components, step: int, rollouts: SyncRollouts | None = None) -> dict[str, float]:
    """One step; its batch from `rollouts` (by default generated now: the synchronous loop)."""
    metrics: dict = {}
    rollouts = rollouts or SyncRollouts(c, collect_samples)
    with _timer(metrics, "rollout"):  # asynchronous: the wait for a batch generated ahead
        samples = rollouts.batch(step, metrics)
    for attempt in range(2):
        c.last_samples = samples[:ROLLOUT_TABLE_ROWS]  # not the whole step's, held until the next step's
        metrics.update(staleness_metrics(samples, step))
        try:
            batch = experience(c, in_update_order(c.cfg, samples, step), metrics, step)
            break
        except EnginesDisagree as e:  # sync.probe.gate: never trained on
            del samples
            if attempt:
                raise WrongWeights(f"{e}, again after the engines were given the trainer's weights "
                                   "once more and the batch was generated anew; the run stopped before training on "
                                   "it (its last checkpoint is good)") from None
            log.warning("sync.probe.gate: step %d: %s; the engines get the trainer's weights again and the batch "
                        "is generated anew", step + 1, e)
            metrics["rollout/gate_regenerations"] = 1
            rollouts.sync_weights(c.runtime.weights_version)  # probed
            with _timer(metrics, "rollout"):
                samples = rollouts.regenerate(step, metrics)
    metrics.update(c.engine_metrics())
    del samples  # the batch holds what the updates need: the trajectories are freed before they run
    metrics["actor/advantage_mean"] = float(masked_mean(batch.advantages, batch.loss_mask))
    updates(c, batch, step, metrics)
    with _timer(metrics, "sync_weights"):
        rollouts.sync_weights(step + 1)
    metrics.update(c.runtime.sleep_metrics())
    trainer_s = sum(metrics.get(f"timing/{k}_s", 0.0) for k in TRAINER_PHASES)
    wall_s, engine_s = rollouts.clock.lap()
    tokens = batch.num_tokens
    metrics.update({"perf/tokens_per_s": tokens / max(wall_s, 1e-9), "perf/step_s": wall_s,
                    "perf/trainer_busy_fraction": min(trainer_s / max(wall_s, 1e-9), 1.0),
                    "perf/engine_busy_fraction": min(engine_s / max(wall_s, 1e-9), 1.0)})
    return metrics


def experience(c: Components, samples: list[Sample], metrics: dict, step: int | None = None) -> PackedBatch:
    """The step's scored samples as the batch the updates take: rows, old and reference
    log-probs, values, advantages and returns (the driver's data path of docs/architecture.md;
    tools/bench/scale.py runs it at a recipe's size). With the trainer's old log-probs and
    sync.probe.gate, EnginesDisagree when those of the tokens sampled with the trainer's weights
    (version `step`) are too far from the engines'."""
    cfg = c.cfg
    batch = to_train_batch(samples, routed_experts=cfg.actor.moe_routing_replay)
    scores = [s.score for s in samples]
    groups = [s.group for s in samples]
    if cfg.algorithm.old_log_probs == "engine":  # the sampling policy's own numbers, no forward pass
        old_log_probs = batch.rollout_log_probs
    else:
        with _timer(metrics, "old_log_prob"):
            old_log_probs, _ = c.worker.compute_log_prob(batch.only())
        differ = (old_log_probs - batch.rollout_log_probs).abs()
        metrics["rollout/logprob_mismatch"] = float(differ[batch.loss_mask].mean())
        if cfg.sync.probe.gate and step is not None:
            gate(differ, on_policy_tokens(samples, batch, step), cfg.gate_bound(), metrics)
        del differ
    ref = c.worker.compute_ref_log_prob(batch.only()) if c.worker.has_reference else None
    if cfg.critic.enable:
        with _timer(metrics, "values"):
            batch = batch.with_fields(values=c.worker.compute_values(batch.only()))
    advantages, returns, adv_metrics = compute_advantages(batch, scores, groups, cfg.algorithm, ref, old_log_probs)
    metrics.update({f"train/{k}": v for k, v in adv_metrics.items()})
    return batch.with_fields(old_log_probs=old_log_probs, ref_log_probs=ref, advantages=advantages, returns=returns)


def actor_fields(algo) -> tuple[str, ...]:
    """The per-token fields the actor's loss reads (megarl.backends.loss): the rest is not sent."""
    return ("old_log_probs", "advantages", *(("rollout_log_probs",) if algo.tis_cap else ()),
            *(("ref_log_probs",) if algo.use_kl_loss else ()))


TRAINER_PHASES = ("old_log_prob", "values", "update_critic", "update_actor", "sync_weights")


def in_update_order(cfg: RunConfig, samples: list[Sample], step: int) -> list[Sample]:
    """The samples in the order the updates cut them into mini-batches (shuffle_mini_batches)
    when the actor and the critic take one order: the batch is built in it, and its forward
    passes are sent in it too (a rank's routing then crosses once a step: RemoteTrainWorker)."""
    if one_update_order(cfg) and cfg.actor.shuffle_mini_batches:
        return [samples[i] for i in update_permutation(len(samples), cfg.trainer.seed, step).tolist()]
    return samples


def one_update_order(cfg: RunConfig) -> bool:
    return len({w.shuffle_mini_batches for w in [cfg.critic] * cfg.critic.enable + [cfg.actor]}) == 1


def updates(c: Components, batch: PackedBatch, step: int, metrics: dict) -> None:
    """The step's updates, the critic's (when on) and the actor's, each sent the fields it reads
    in the order it cuts into mini-batches (shuffle_mini_batches): `batch` as it is when both
    take one order (it was built in it: `in_update_order`), else a copy in each one's order."""
    cfg = c.cfg
    in_order = one_update_order(cfg)

    def ordered(fields: tuple[str, ...], worker: TrainWorkerConfig) -> PackedBatch:
        return batch.only(*fields) if in_order else update_order(batch.only(*fields), worker, cfg, step)

    if cfg.critic.enable:
        with _timer(metrics, "update_critic"):
            critic = c.worker.update_critic(ordered(("values", "returns"), cfg.critic))
        metrics.update({f"critic/{k}": v for k, v in critic.items()})
    with _timer(metrics, "update_actor"):
        actor = c.worker.update_actor(ordered(actor_fields(cfg.algorithm), cfg.actor))
    metrics.update({f"actor/{k}": v for k, v in actor.items()})


def update_order(batch: PackedBatch, worker: TrainWorkerConfig, cfg: RunConfig, step: int) -> PackedBatch:
    """A copy of the batch in the order `worker`'s update cuts it into mini-batches (shuffle_mini_batches)."""
    return shuffled(batch, cfg.trainer.seed, step) if worker.shuffle_mini_batches else batch


def staleness_metrics(samples: list[Sample], step: int) -> dict[str, float]:
    """How many weight versions the trained tokens lag behind the weights they are trained
    from (version `step`), and the generations that went on after a weight sync."""
    lags = [step - np.asarray(t.token_versions, np.int64)[np.asarray(t.loss_mask, np.bool_)]
            for t in (s.trajectory for s in samples)]
    count = sum(len(x) for x in lags)
    return {"rollout/staleness_mean": float(sum(x.sum() for x in lags)) / max(count, 1),
            "rollout/staleness_max": int(max((x.max() for x in lags if len(x)), default=0)),
            "rollout/stale_samples": sum(bool((np.asarray(s.trajectory.token_versions) != step).any()) for s in samples),
            "rollout/partial_continued": sum(s.trajectory.num_continued for s in samples)}


def collect_samples(c: Components, step: int, metrics: dict, generate=None) -> list[Sample]:
    """Generation batches until train_batch_size informative groups (DAPO dynamic sampling).
    `generate`: `rollout` unless given (tools/bench/scale.py gives synthetic trajectories). Of the
    samples a batch generated only the kept are held on to (a recipe's batch of 24,576 samples is
    tens of GB), the rest tallied for the metrics."""
    cfg = c.cfg
    ds = cfg.algorithm.dynamic_sampling
    gen_size = cfg.data.gen_batch_size if ds.enable and cfg.data.gen_batch_size else cfg.data.train_batch_size
    keeper = InformativeGroupBuffer(cfg.data.train_batch_size, ds.max_num_gen_batches)
    tally: dict[str, float] = dict.fromkeys(TALLIED, 0.0)
    batch_index = 0
    while True:
        indices = c.prompt_order.take(gen_size)
        samples, failures = (generate or rollout)(
            c, [c.train_records[i] for i in indices], cfg.rollout.n,
            seed_base=(cfg.trainer.seed * 1_000_003 + step * 1009 + batch_index) * 10_000,
            group_base=(step * 1000 + batch_index) * 100_000)
        metrics["reward/failures"] = metrics.get("reward/failures", 0) + failures
        tally_batch(samples, tally)
        batch_index += 1
        if not ds.enable:
            kept = samples
            break
        metric = [s.acc if ds.metric == "acc" else s.score for s in samples]
        keeper.add(samples, [s.group for s in samples], [float(m) for m in metric])
        del samples, metric
        if keeper.is_full:
            kept = keeper.take()
            break
        memory.give_back()  # the groups dynamic sampling dropped
    memory.give_back()  # those, and the informative groups past the step's (two thirds of a recipe's batch)
    _rollout_metrics(tally, kept, batch_index, metrics)
    metrics["reward/failure_rate"] = metrics["reward/failures"] / max(tally["samples"], 1)
    return kept


def rollout(c: Components, records, n: int, seed_base: int, group_base: int,
            validation: bool = False) -> tuple[list[Sample], int]:
    """(samples, reward calls that failed or timed out): n trajectories per record, scored;
    scores include overlong shaping (not in validation)."""
    prompts = [r.prompt_ids for r in records for _ in range(n)]
    seeds = [seed_base + i for i in range(len(prompts))]
    trajectories = run_async(run_trajectories(c.engine, c.tokenizer, prompts, c.agent_settings(validation),
                                              c.tools, seeds))
    failed = sum(t.num_failed_searches for t in trajectories)
    if failed:
        c.check_retrieval()  # a dead server stops the run with its name; a transient failure is counted
        log.warning("%d of %d searches failed (the model saw 'Search failed: ...')", failed,
                    sum(t.num_searches for t in trajectories))
    samples = [Sample(records[i // n], group_base + i // n, t) for i, t in enumerate(trajectories)]
    return samples, score_samples(c, samples, validation)


SCORED_AT_ONCE = 2048  # samples decoded and scored together: a recipe's generation batch (24,576) is GBs of text


def score_samples(c: Components, samples: list[Sample], validation: bool = False) -> int:
    """Each sample's score and acc from the reward (plus overlong shaping, not in validation);
    returns the reward calls that failed or timed out. Whole groups of about SCORED_AT_ONCE
    samples at a time (a group's reward components see the whole group): only their texts are
    held at once."""
    failed, start = 0, 0
    while start < len(samples):
        end = min(start + SCORED_AT_ONCE, len(samples))
        while end < len(samples) and samples[end].group == samples[end - 1].group:
            end += 1
        failed += _score_part(c, samples[start:end], validation)
        start = end
    return failed


def _score_part(c: Components, samples: list[Sample], validation: bool) -> int:
    with c.reward_lock:  # validation may score while the asynchronous producer does
        results, stats = c.reward_pool.compute(reward_requests(samples, c.tokenizer, c.cfg.reward))
    scores = [r.score for r in results]
    bad = [i for i, x in enumerate(scores) if not math.isfinite(x)]
    if bad:  # a NaN reward would poison every advantage of its group
        log.warning("%d rewards were NaN/inf (first: request %d); scored 0", len(bad), bad[0])
        scores = [x if math.isfinite(x) else 0.0 for x in scores]
    if not validation:
        scores = shape_overlong(scores, [len(s.trajectory.response_ids) for s in samples],
                                c.cfg.rollout.max_response_length, c.cfg.algorithm)
    for sample, result, score in zip(samples, results, scores):
        sample.score, sample.acc = score, bool(result.acc)
    return stats.num_timeouts + stats.num_errors + len(bad)


def validate(c: Components) -> dict[str, float]:
    v = c.cfg.rollout.val
    c.for_generation()
    samples, _ = rollout(c, c.val_records, v.n, seed_base=7_777_777, group_base=0, validation=True)
    by_prompt: dict[int, list[Sample]] = {}
    for s in samples:
        by_prompt.setdefault(s.group, []).append(s)
    return {"val/score": sum(s.score for s in samples) / len(samples),
            "val/acc": sum(s.acc for s in samples) / len(samples),  # = avg@n
            f"val/pass_at_{v.n}": sum(any(s.acc for s in g) for g in by_prompt.values()) / len(by_prompt),
            "val/search_calls_mean": sum(s.trajectory.num_searches for s in samples) / len(samples)} | {
        f"val/tools/{name}/calls_mean": calls / len(samples) for name, calls in tool_totals(samples)["calls"].items()
    } | per_source_accuracy(samples)


def _rollout_metrics(tally: dict[str, float], kept: list[Sample], gen_batches: int, metrics: dict) -> None:
    n = tally["samples"]
    metrics.update({
        "train/reward_mean": sum(s.score for s in kept) / len(kept),
        "train/acc": tally["acc"] / n,
        "train/response_length_mean": tally["response_tokens"] / n,
        "train/kept_groups": len({s.group for s in kept}),
        "train/gen_batches": gen_batches,
        "rollout/search_calls_mean": tally["searches"] / n,
        "rollout/tool_calls_mean": sum(v for k, v in tally.items() if k.startswith("tool_calls/")) / n,
        "rollout/valid_action_rate": tally["valid_actions"] / max(tally["turns"], 1),
        "rollout/failed_searches": int(tally["failed_searches"]),
        "rollout/turns_mean": tally["turns"] / n,
    })
    for key in [k for k in tally if k.startswith("tool_calls/")]:
        name, calls = key.removeprefix("tool_calls/"), tally[key]
        metrics.update({f"rollout/tools/{name}/calls_mean": calls / n,
                        f"rollout/tools/{name}/failures": int(tally[f"tool_failures/{name}"]),
                        f"rollout/tools/{name}/latency_s": tally[f"tool_seconds/{name}"] / max(calls, 1)})


def _save(c: Components, root: Path, step: int, run_id: str | None, history: list, rollouts: SyncRollouts,
          clock: SaveClock | None = None) -> None:
    meta = {"run_id": run_id, "sampler": rollouts.order_state(step), "history": history,  # key as in old checkpoints
            "config": flatten_config(c.cfg)}  # what a resume compares its config with (megarl.resume_guard)
    started = time.perf_counter()
    c.for_training()
    with deferred():  # a first signal waits for the checkpoint to be complete (megarl.termination)
        checkpoint.save_atomically(root, step, c.worker.save_checkpoint, meta)
        checkpoint.prune(root, c.cfg.trainer.max_ckpt_to_keep)
    if clock is not None:
        clock.saved(time.perf_counter() - started)


def export_hf(c: Components, directory: Path) -> Path:
    """The actor as an HF model directory (safetensors, config, tokenizer)."""
    c.for_training()
    c.worker.save_hf(directory)
    c.tokenizer.save_pretrained(directory)
    return directory


def check_output_dir(out: Path) -> None:
    """trainer.output_dir exists (created if not) and a file can be written in it, else
    RunInputError naming the path: a file where a directory should be, no permission, a
    read-only file system."""
    for ancestor in (out, *out.parents):
        if ancestor.exists():
            if not ancestor.is_dir():
                where = "is a file" if ancestor == out else f"is under {ancestor}, which is a file"
                raise RunInputError(f"trainer.output_dir={out} {where}, not a directory; choose another "
                                    f"trainer.output_dir")
            break
    fix = "choose a directory this user can write to, or fix its permissions"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunInputError(f"trainer.output_dir={out} cannot be created ({e.strerror}: {e.filename}); {fix}") from None
    try:
        with tempfile.TemporaryFile(dir=out, prefix=".megarl-write-check-"):
            pass
    except OSError as e:
        raise RunInputError(f"trainer.output_dir={out} is not writable ({e.strerror}); {fix}") from None


def _requeued() -> str:
    """", slurm job J restarted N time(s)" when this is a requeued slurm job (SLURM_RESTART_COUNT)."""
    restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
    if restarts in ("", "0"):
        return ""
    return f", slurm job {os.environ.get('SLURM_JOB_ID', '?')} restarted {restarts} time(s) (requeued)"


def _resume_path(cfg: RunConfig, root: Path) -> Path | None:
    mode = cfg.trainer.resume
    if mode == "disable":
        return None
    if mode == "auto":
        return checkpoint.newest_intact(root)  # a damaged newer one is skipped with a warning
    path = Path(mode)
    checkpoint.verify(path)  # a clear error when it is not a checkpoint or a file of it is damaged
    return path


PHASES = {"rollout": "generating the step's samples", "old_log_prob": "computing the old log-probs",
          "values": "computing the critic's values", "update_critic": "updating the critic",
          "update_actor": "updating the actor", "sync_weights": "syncing the weights to the engines"}


@contextmanager
def _timer(metrics: dict, phase: str):
    """Times a phase of the step (timing/PHASE_s), logs its start (at INFO: MEGARL_LOG_LEVEL), and
    puts it in the message of a part lost during it: the operation the run was in."""
    start = time.perf_counter()
    log.info("%s", PHASES[phase])
    try:
        yield
    except ComponentDied as e:
        raise type(e)(f"while {PHASES[phase]}: {e}") from e
    metrics[f"timing/{phase}_s"] = time.perf_counter() - start

