"""The runtime interface: where a run's parts live and how the driver reaches them.

`train.py` and `megarl.components` see a `Runtime` and nothing else: its train worker, rollout
engine and reward pool (each behind its typed protocol: `TrainWorker`, `RolloutEngine`,
`RewardComputer`), the retrieval server it hosts, and the two things that involve several
parts at once: the weight sync and the engines' memory release. Two implementations:
`InProcessRuntime` (everything in this process: debugging, tests) and `RayRuntime` (Ray actors
on any number of nodes, the SGLang fleet). The weight sync is written once, here, for both
(docs/architecture.md). Main entry points: `Runtime`, `RankEndpoint`.
"""

from __future__ import annotations

import logging
import os
import threading
from abc import ABC, abstractmethod
from contextlib import contextmanager

import torch

from megarl.backends.base import TrainWorker
from megarl.backends.packed import PackedBatch
from megarl.config import RetrievalConfig, RunConfig
from megarl.driver_loop import run_async
from megarl.http_auth import RETRIEVAL_KEY_ENV, new_api_key
from megarl.reward.pool import RewardComputer
from megarl.rollout.engine import RolloutEngine
from megarl.weights.buckets import verify_engine
from megarl.weights.probe import WeightProbe, WrongWeights, beyond, probe_sequences
from megarl.weights.transport import RankPlace, TrainRanks, WeightSender, WeightTransport

log = logging.getLogger(__name__)


FAILED_PUSH_CLEANUP_S = 30.0  # at most, and no longer than cluster.liveness.timeout_s: the run stops after it


def within(seconds: float, what: str, call, *args) -> bool:
    """call(*args) on a thread, waited for at most `seconds`; False (logged) when it did not
    return or failed. For cleanup that may wait on a lost part or on Ray's control store while it
    stops (a preemption signals every process of a job at once): the caller goes on."""
    def run() -> None:
        try:
            call(*args)
        except Exception as e:  # noqa: BLE001 -- cleanup: the failure that led here is what matters
            log.warning("%s failed: %s: %s", what, type(e).__name__, e)
            done.append(False)
        else:
            done.append(True)

    done: list[bool] = []
    worker = threading.Thread(target=run, name=what, daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        log.warning("%s did not finish within %.0f s (a part lost or stopping); going on", what, seconds)
    return done == [True]


class Runtime(ABC):
    """A run's parts, started by the constructor and stopped by `shutdown` (idempotent)."""

    cfg: RunConfig
    worker: TrainWorker
    engine: RolloutEngine
    reward_pool: RewardComputer
    ranks: TrainRanks  # the train worker group, as the weight transport sees it
    transport: WeightTransport  # sync.transport, feeding `engine`
    retrieval_url: str | None = None  # the retrieval server this runtime hosts, if any
    retrieval_api_key: str | None = None  # and the key it requires (hosted_retrieval_key)
    retrieval_where: str = ""  # how an error names that server's host, e.g. " (Ray actor RetrievalActor)"
    tool_actors: dict = {}  # name -> the Ray actor running that agent tool (agent.tools.NAME.ray); none in-process

    # Whose turn it is on the GPUs. Training: colocated engines have released their memory and
    # the trainer is awake. Generation: the trainer sleeps (trainer.sleep_during_generation) and
    # the engines hold their memory. A weight sync runs in the training phase and ends in the
    # generation phase: the engines' weights come back first (to be loaded), then the trainer
    # sleeps, then the engines take their KV cache and CUDA graphs back.
    _trainer_asleep = False
    _state_asleep = False  # all but its weights (the first part of a colocated sync)

    probe: WeightProbe | None = None  # sync.probe: install_probe
    weights_version = 0  # the version of the trainer's weights the engines were last given
    weight_reloads = 0  # reloads after a failed probe (a metric)
    _first_generation = True

    def for_generation(self) -> None:
        """Before the engines generate: the trainer asleep, the engines' memory back, their
        weights probed where anything could have changed them (sync.probe)."""
        if self.engine_weights_lost():
            # released outside a sync (a checkpoint's save) without a CPU backup: SGLang resumes the
            # weights' memory as fresh pages, so the trainer's weights are loaded again
            self.sync_weights(self.weights_version)  # ends in the generation phase, probed
            return
        if self.cfg.trainer_sleeps() and not self._trainer_asleep:
            self._sleep_trainer()
        resumed = self.resume_engine_memory()
        if resumed or self._first_generation:
            self.check_engine_weights("the engines' memory was resumed" if resumed else "the engines started")
        self._first_generation = False

    def engine_weights_lost(self) -> bool:
        """The engines released their weights' memory outside a weight sync and keep no copy to
        resume them from: what they would generate with is not the trainer's weights. Colocated
        SGLang servers release their weights with the rest (sglang_api.MEMORY_TAGS); started with
        --enable-memory-saver alone they keep no copy, and a resume maps fresh pages."""
        return (getattr(self.engine, "memory_released", False) and self.cfg.sync_transport() != "lora"  # kept
                and "--enable-weights-cpu-backup" not in self.cfg.rollout.sglang.extra_args)

    def install_probe(self, prompts: list[list[int]]) -> None:
        """sync.probe: the probe's sequences from the run's training prompts, and the trainer's
        log-probs of them for the weights it holds now (awake for it)."""
        p = self.cfg.sync.probe
        if not p.enable:
            return
        sequences = probe_sequences(prompts, p.sequences, p.tokens)
        if not sequences:
            log.warning("sync.probe: no training prompt has two tokens to probe with; the engines' weights go "
                        "unchecked")
            return
        self.probe = WeightProbe(sequences, self.cfg.probe_tolerance(), p.noise_multiple, self.cfg.probe_ceiling())
        if self._trainer_asleep:
            self.for_training()
        self.probe.expect(trainer_log_probs(self.worker, sequences), self.weights_version)
        if hasattr(self.engine, "probe"):  # a fleet probes the engines it restarts itself
            self.engine.probe = self.probe

    def check_engine_weights(self, event: str) -> None:
        """The weights probe after `event`: an engine that disagrees with the trainer gets the
        trainer's weights again (one sync) and is probed again; if it still disagrees the run
        stops (WrongWeights), naming the engine, the event and the figures. The first probe
        calibrates the tolerance (WeightProbe.calibrate) on a floor measured after the reload
        where the first look exceeded the bound: what the engines started with may have been
        wiped, half loaded, or the base model of a resumed run; what the trainer just pushed is
        not. The second look is judged by the ceiling then, the tolerance afterwards."""
        probe = self.probe
        if probe is None:
            return
        found = run_async(probe.measure(self.engine))
        bad = beyond(found, probe.tolerance)
        if bad:
            log.warning("sync.probe: after %s, %s; loading the trainer's weights (version %d) again", event,
                        "; ".join(m.describe(probe.tolerance) for m in bad), self.weights_version)
            self.weight_reloads += 1
            self.sync_weights(self.weights_version, check=False)
            found = run_async(probe.measure(self.engine))
            limit, name = (probe.tolerance, "tolerance") if probe.floor is not None else (probe.ceiling, "ceiling")
            bad = beyond(found, limit)
            if bad:
                hint = ("" if probe.floor is not None else
                        f"; sync.probe.ceiling={limit:.3g} is the largest noise floor the first probe takes for "
                        "rounding and routing noise: a larger one means the engines compute with other weights "
                        "than those pushed (a weight conversion or transport fault, an engine built from another "
                        "config). If this model's engines are known to differ this much, raise sync.probe.ceiling")
                raise WrongWeights(f"{bad[0].engine} serves other weights than the trainer's (version "
                                   f"{self.weights_version}) after {event}, and again after they were loaded once "
                                   "more: " + "; ".join(m.describe(limit, name) for m in bad) + hint
                                   + ". The run stopped before training on its samples; its last checkpoint is good")
        if probe.floor is None and found:
            floor = max(m.mean_abs for m in found)
            probe.calibrate(floor)
            log.info("sync.probe: noise floor %.3g a token after %s; tolerance %.3g from now on (the larger of "
                     "sync.probe.tolerance=%.3g and sync.probe.noise_multiple=%g x the floor)", floor, event,
                     probe.tolerance, probe.bound, probe.multiple)

    def for_training(self) -> None:
        """Before the trainer computes or saves: the engines' memory released, the trainer awake."""
        self.release_engine_memory()
        if self._trainer_asleep or self._state_asleep:
            self._trainer_asleep = self._state_asleep = False
            self._count("perf/trainer_onload_s", self.worker.wake())

    def sleep_metrics(self) -> dict[str, float]:
        """Seconds the trainer spent going to sleep and waking since the last call (one step's)."""
        taken, self._sleep_s = getattr(self, "_sleep_s", {}), {}
        return taken

    def _sleep_trainer(self) -> None:
        self._count("perf/trainer_offload_s", self.worker.sleep())
        self._trainer_asleep = True

    @contextmanager
    def _trainer_weights_away(self):
        """While an engine (re)starts in a sync, before the push: the trainer's weights off the GPU
        too (SGLang sizes a starting engine's KV cache from the memory free then), back after."""
        if not self._state_asleep or self._trainer_asleep:
            yield
            return
        self._count("perf/trainer_offload_s", self.worker.sleep())
        try:
            yield
        finally:
            self._count("perf/trainer_onload_s", self.worker.wake(weights_only=True))

    def _count(self, name: str, seconds: float) -> None:
        if not hasattr(self, "_sleep_s"):
            self._sleep_s = {}
        self._sleep_s[name] = self._sleep_s.get(name, 0.0) + seconds

    def sync_weights(self, version: int, check: bool = True) -> None:
        """Trainer weights -> engine, with decoding paused around it; then, with
        sync.verify, the engine's checksums against the trainer's, and with `check` the weights
        probe (sync.probe). Starts in the training phase, ends in the generation phase (the
        trainer asleep where it sleeps)."""
        self.for_training()
        if self.cfg.trainer_sleeps():  # all but the weights it pushes off the GPU before the engines' weights return
            self._count("perf/trainer_offload_s", self.worker.sleep(keep_weights=True))
            self._state_asleep = True
            if hasattr(self.engine, "around_restart"):  # an engine restarted meanwhile starts next to nothing
                self.engine.around_restart = self._trainer_weights_away
        self.ranks.free_cache()  # before colocated engines take their memory back
        run_async(self.engine.begin_weight_update())
        checksums, pushed = None, False
        try:
            self.transport.connect(self.ranks)
            bucket_bytes = self.cfg.sync.bucket_mb << 20
            if self.transport.stages_in_turn:
                for stage in sorted({p.stage for p in self.ranks.places()}):
                    self.ranks.push(bucket_bytes, version, stage)
            else:
                self.ranks.push(bucket_bytes, version)
            self.transport.finish(version)
            checksums = self.worker.weight_checksums() if self.cfg.sync.verify and self.cfg.engines_report_checksums() \
                else None
            self.weights_version = version
            if self.probe is not None:  # the trainer's log-probs for the weights it pushed, before it sleeps
                self.probe.expect(trainer_log_probs(self.worker, self.probe.sequences), version)
            if self.cfg.trainer_sleeps():  # its memory freed before the engines take their KV cache back
                self._sleep_trainer()
            pushed = True
        finally:
            # the push's buffers (and the CUDA IPC memory the engines have closed) back to the
            # device before colocated engines take their KV cache and CUDA graphs back; after a
            # failed push only for a bounded time: a rank may still be inside it (a collective
            # with a lost engine), and a call queued behind it would wait for ever while the rank
            # answers its pings
            if pushed:
                self.ranks.free_cache()
                run_async(self.engine.end_weight_update())
            else:
                within(min(FAILED_PUSH_CLEANUP_S, self.cfg.cluster.liveness.timeout_s),
                       "the cleanup after a failed weight push", self._after_push)
        restarted = getattr(self.engine, "need_weights", None)
        if restarted:  # restarted at the sync's end with nothing kept to reload: a second sync for them
            log.warning("engines %s restarted at the end of the weight sync: syncing version %d again",
                        sorted(restarted), version)
            restarted.clear()
            self.sync_weights(version, check)
            return
        if checksums is not None:
            run_async(verify_engine(self.engine, checksums))
        self._first_generation = False  # the sync's probe checks what the engines started with, too
        if check:
            self.check_engine_weights(f"the weight sync to version {version}")

    def _after_push(self) -> None:
        self.ranks.free_cache()
        run_async(self.engine.end_weight_update())

    @abstractmethod
    def release_engine_memory(self) -> None:
        """Engines on the trainer's GPUs give their memory to the trainer (once: nothing when
        they have); nothing where they share no device. Part of `for_training`."""

    def resume_engine_memory(self) -> bool:
        """Engines on the trainer's GPUs take back what they released (nothing when they hold
        it, or share no device); whether they did. Part of `for_generation`."""
        return False

    def check_retrieval(self) -> None:
        """ComponentDied when the retrieval server this runtime hosts is gone."""

    def lost_parts(self) -> str:
        """After a part failed: which parts are gone, by node ("" when none, or unknown)."""
        return ""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every part this runtime started; safe to call twice."""


def trainer_log_probs(worker: TrainWorker, sequences: list[list[int]]) -> list[torch.Tensor]:
    """The trainer's log-prob of each token after the first of each sequence, at temperature 1 (the
    weights probe: megarl.weights.probe); the trainer awake."""
    batch = PackedBatch.from_sequences([s[:1] for s in sequences], [s[1:] for s in sequences],
                                       [[1] * (len(s) - 1) for s in sequences])
    log_probs, _ = worker.compute_log_prob(batch, False, 1.0, True)
    return list(log_probs.float()[batch.loss_mask].split([len(s) - 1 for s in sequences]))


def hosted_retrieval_key(r: RetrievalConfig) -> str:
    """The key of the retrieval server a runtime starts (it always takes one, whatever address
    it binds): agent.retrieval.api_key, else $MEGARL_RETRIEVAL_API_KEY, else a fresh one."""
    return r.api_key or os.environ.get(RETRIEVAL_KEY_ENV) or new_api_key()


class RankEndpoint:
    """One train rank's side of the weight sync: the sender the transport gave it, and the
    push (every rank exports, for the collectives; a rank with a sender sends)."""

    def __init__(self, worker: TrainWorker):
        self.worker = worker
        self.sender: WeightSender | None = None

    def open_sender(self, sender: WeightSender) -> None:
        self.close()
        sender.open()
        self.sender = sender

    def push(self, bucket_bytes: int, version: int, stage: int | None = None) -> int:
        """Export and send this rank's buckets; nothing when `stage` is another stage's."""
        if stage is not None and stage != self.worker.pipeline_stage:
            return 0
        buckets = self.worker.export_hf_weights(bucket_bytes)
        if self.sender is None:
            if self.worker.is_export_source:
                raise RuntimeError("weight sync: this source rank has no sender (the transport did not connect)")
            for _ in buckets:  # the TP gathers need every rank
                pass
            return 0
        return self.sender.send(buckets, version)

    def place(self, rank: int, node: str, gpu: str) -> RankPlace:
        return RankPlace(rank, node, gpu, self.worker.pipeline_stage, self.worker.is_export_source)

    @staticmethod
    def free_cache() -> None:
        """The allocator's cached blocks back to the device (the training peak stays
        reserved otherwise, and a colocated engine resuming its memory may not fit)."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.ipc_collect()  # memory shared with the engines through CUDA IPC that they have let go

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None
