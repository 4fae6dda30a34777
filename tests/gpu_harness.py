"""The trainer side of the GPU contract harness (tests/test_gpu_contract.py), on CPU processes.

Train ranks are processes joined in one gloo group, each with a simulated GPU identity and
either megarl's real `MegatronTrainWorker` over a tiny HF model (megatron-core on CPU: its TP
gathers, pipeline stages and export are the ones a GPU run has) or a test double of a rank's
export with mixed dtypes (`StageExport`: every rank of a pipeline stage's DP-0 replica
iterates its buckets in step, with a collective on its TP group per bucket, as the TP gathers
are; DP > 0 yields nothing); `ProcessRanks` is the `TrainRanks` the transports drive.
Engines are tests/sglang_double.py servers behind megarl's real `SGLangFleet`. What runs is
megarl's: `Runtime.sync_weights`, the transports' driver sides, `RankEndpoint` and the senders.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch
from megatron_dist import join, rank_context, rendezvous_store

from megarl.runtime.base import RankEndpoint, Runtime
from megarl.runtime.ray_runtime import RayRuntime
from megarl.weights.buckets import FlatBucket, group_tensors, weight_checksums
from megarl.weights.transport import RankPlace

ROOT = Path(__file__).resolve().parents[1]
NODE = "node0"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Layout:
    """Train ranks in megatron's order (TP fastest, then DP, then PP), one simulated GPU each;
    `ep`: megarl's megatron worker splits a mixture of experts over that many ranks (their
    expert-parallel groups span the data-parallel ranks)."""
    tp: int
    dp: int
    pp: int
    ep: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.dp * self.pp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp rank, dp rank, stage)."""
        return rank % self.tp, rank // self.tp % self.dp, rank // (self.tp * self.dp)

    def places(self, gpus: list[str]) -> list[RankPlace]:
        out = []
        for rank in range(self.world):
            tp, dp, stage = self.coords(rank)
            out.append(RankPlace(rank, NODE, gpus[rank] if gpus else "", stage, tp == 0 and dp == 0))
        return out


def stage_tensors(stage: int) -> dict[str, torch.Tensor]:
    """Each stage's weights: mixed dtypes, an odd-sized bf16 tensor (packed after it, an fp32
    tensor would start at an offset fp32 cannot view); 983,072 bytes at 16-byte alignment."""
    g = torch.Generator().manual_seed(stage)
    return {
        f"model.layers.{stage}.mlp.up_proj.weight": torch.randn(256, 640, generator=g).to(torch.bfloat16),
        f"model.layers.{stage}.input_layernorm.bias": torch.randn(3, generator=g).to(torch.bfloat16),
        f"model.layers.{stage}.router.weight": torch.randn(128, 640, generator=g),
        f"model.layers.{stage}.mlp.down_proj.weight": torch.randn(640, 256, generator=g).to(torch.bfloat16),
        f"model.layers.{stage}.post_attention_layernorm.weight": torch.randn(5, generator=g),
    }


def all_tensors(stages: int) -> dict[str, torch.Tensor]:
    return {k: v for s in range(stages) for k, v in stage_tensors(s).items()}


class StageExport:
    """A TrainWorker's export side, as a megatron rank of `layout` has it."""

    def __init__(self, layout: Layout, rank: int, tp_group):
        self.tp_rank, self.dp_rank, self.pipeline_stage = layout.coords(rank)
        self.is_export_source = self.tp_rank == 0 and self.dp_rank == 0
        self.tp_group = tp_group

    def export_hf_weights(self, bucket_bytes: int):
        if self.dp_rank != 0:
            return
        for bucket in group_tensors(stage_tensors(self.pipeline_stage).items(), bucket_bytes):
            torch.distributed.all_reduce(torch.zeros(1), group=self.tp_group)  # the TP gather: all ranks or none
            yield bucket


class SimHandles:
    """HandleMaker over simulated devices: the bucket's bytes in a file, named with the
    device UUID of the rank that made it (tests/sglang_double.py reads it)."""

    def __init__(self, device: str, directory: str):
        self.device, self.directory, self.count = device, directory, 0

    def serialize(self, bucket: FlatBucket) -> str:
        self.count += 1
        path = Path(self.directory) / f"{self.device}-{os.getpid()}-{self.count}.bin"
        path.write_bytes(bucket.data.numpy().tobytes())
        entries = [(e.name, e.dtype, list(e.shape), e.offset, e.nbytes) for e in bucket.entries]
        return json.dumps({"device": self.device, "path": str(path), "entries": entries})


def _export_side(rank: int, layout: Layout, hf_dir: str | None):
    """This rank's TrainWorker: megarl's megatron worker over `hf_dir`, or the test double."""
    if hf_dir is not None:
        from megatron_cases import worker

        torch.set_num_threads(1)
        return worker(hf_dir, [f"actor.parallel.tensor_model_parallel_size={layout.tp}",
                               f"actor.parallel.pipeline_model_parallel_size={layout.pp}",
                               f"actor.parallel.expert_model_parallel_size={layout.ep}"])
    tp_groups = [torch.distributed.new_group([s * layout.tp * layout.dp + d * layout.tp + t for t in range(layout.tp)])
                 for s in range(layout.pp) for d in range(layout.dp)]
    _, dp, stage = layout.coords(rank)
    return StageExport(layout, rank, tp_groups[stage * layout.dp + dp])


def _rank_main(rank: int, layout: Layout, port: int, conn, hf_dir: str | None) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    join("gloo", port, rank, layout.world)
    try:
        endpoint = RankEndpoint(_export_side(rank, layout, hf_dir))
    except Exception as e:  # the driver's first call raises it
        conn.send(("error", f"rank {rank}: {type(e).__name__}: {e}"))
        return
    while True:
        command, *args = conn.recv()
        if command == "stop":
            return
        try:
            result = {"open": endpoint.open_sender, "push": endpoint.push, "place": endpoint.place,
                      "free_cache": lambda: time.time()}[command](*args)
            conn.send(("ok", result))
        except Exception as e:  # the driver raises it
            conn.send(("error", f"rank {rank}: {type(e).__name__}: {e}"))


class ProcessRanks:
    """TrainRanks over rank processes; `handle_dir` set: each sender makes simulated handles
    on its rank's GPU; `hf_dir` set: the ranks run megarl's megatron worker over that model.
    Every call waits at most `deadline_s` (a deadlock is a TimeoutError)."""

    def __init__(self, layout: Layout, gpus: list[str], handle_dir: str | None = None, deadline_s: float = 60.0,
                 hf_dir: str | None = None):
        self.layout, self.gpus, self.handle_dir, self.deadline_s = layout, gpus, handle_dir, deadline_s
        ctx = rank_context()
        self.store = rendezvous_store()  # held until the ranks stop
        port = self.store.port
        self.conns, self.procs = [], []
        for rank in range(layout.world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, args=(rank, layout, port, child, hf_dir), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        self.freed_at: list[float] = []
        self._places: list[RankPlace] | None = None

    def places(self) -> list[RankPlace]:
        """Each rank's place as the rank itself reports it (its stage, whether it is a source)."""
        if self._places is None:
            self._places = [self._call([r], "place", r, NODE, self.gpus[r] if self.gpus else "")[0]
                            for r in range(self.layout.world)]
        return self._places

    def free_address(self, rank: int) -> tuple[str, int]:
        return "127.0.0.1", free_port()

    def _call(self, ranks, *command) -> list:
        for r in ranks:
            self.conns[r].send(command)
        return [self._answer(r) for r in ranks]

    def _answer(self, rank: int):
        if not self.conns[rank].poll(self.deadline_s):
            raise TimeoutError(f"train rank {rank} did not answer within {self.deadline_s} s")
        status, value = self.conns[rank].recv()
        if status == "error":
            raise RuntimeError(value)
        return value

    def open_senders(self, senders):
        for rank, sender in senders.items():
            if self.handle_dir is not None and hasattr(sender, "handles"):
                sender.handles = SimHandles(f"GPU-{NODE}-{self.gpus[rank]}", self.handle_dir)
            self.conns[rank].send(("open", sender))
        return lambda: [self._answer(r) for r in senders]

    def push(self, bucket_bytes: int, version: int, stage: int | None = None) -> int:
        return sum(self._call(range(self.layout.world), "push", bucket_bytes, version, stage))

    def free_cache(self) -> None:
        self.freed_at.append(max(self._call(range(self.layout.world), "free_cache")))

    def stop(self) -> None:
        for conn, proc in zip(self.conns, self.procs):
            try:
                conn.send(("stop",))
            except OSError:
                pass
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()


class ServerActor:
    """The ServerActor calls SGLangFleet makes, over a local server process."""

    class _Call:
        def __init__(self, fn):
            self.fn = fn

        async def remote(self, *args):
            return self.fn(*args)

    def __init__(self, procs: list[subprocess.Popen], index: int, log_path: Path, argv: list[str] | None = None,
                 env: dict | None = None):
        """`procs[index]`: the server's process, replaced there by a restart (same arguments, same
        port); without `argv` a restart fails, saying so."""
        def tail() -> str:
            return "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])

        def restart(timeout_s: float = 60.0, *_):  # as SGLang's ServerActor: the same command on the same port
            if argv is None:
                raise RuntimeError(f"this harness server cannot be restarted; its log:\n{tail()}")
            old = procs[index]
            if old.poll() is None:
                old.kill()
            old.wait()
            port = int(Path(argv[argv.index("--port-file") + 1]).read_text())
            fixed = [a if i == 0 or argv[i - 1] != "--port" else str(port) for i, a in enumerate(argv)]
            self.restarted_at.append(time.time())
            with open(log_path, "ab") as log:
                procs[index] = subprocess.Popen(fixed, stdout=log, stderr=subprocess.STDOUT, env=env)
            wait_healthy(procs[index], f"http://127.0.0.1:{port}", f"the restarted double of {log_path.stem}",
                         time.monotonic() + timeout_s)

        def gone_within(seconds: float) -> bool:
            try:
                procs[index].wait(timeout=seconds)
            except subprocess.TimeoutExpired:
                return False
            return True

        self.restarted_at: list[float] = []  # when each restart began
        self.alive = self._Call(lambda: procs[index].poll() is None)
        self.gone_within = self._Call(gone_within)
        self.log_tail = self._Call(tail)
        self.restart = self._Call(restart)


def wait_healthy(proc: subprocess.Popen, url: str, name: str, deadline: float) -> None:
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with status {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} did not start")
        time.sleep(0.2)


def start_engines(gpus_per_engine: list[list[str]], collectives: str, holds: list[list[str]] | None = None,
                  token_s: float = 0.0, extra_args: tuple[str, ...] = (), engine_args: list[list[str]] | None = None):
    """A tests/sglang_double.py server per engine, their simulated collectives in the directory
    `collectives`, each new token taking `token_s`; (fleet entries, processes). Each server binds a free port itself and names
    it in a file: a port chosen here could be taken before the server binds it, and /health
    then answered by another process, the dead server found only at the first sync."""
    procs, port_files, argvs, envs = [], [], [], []
    for e, gpus in enumerate(gpus_per_engine):
        port_files.append(Path(collectives) / f"engine{e}.port")
        argv = [sys.executable, str(ROOT / "tests" / "sglang_double.py"), "--port", "0", "--port-file",
                str(port_files[-1]), "--node", NODE, "--collective-dir", collectives, "--token-s", str(token_s),
                *extra_args, *(engine_args[e] if engine_args else [])]
        for hold in (holds[e] if holds else []):
            argv += ["--hold", hold]
        argvs.append(argv)
        envs.append({**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(gpus)})
        with open(Path(collectives) / f"engine{e}.log", "wb") as log:
            procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=envs[-1]))
    deadline = time.monotonic() + 60
    entries = []
    for e, (gpus, proc, port_file) in enumerate(zip(gpus_per_engine, procs, port_files)):
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the SGLang double of engine{e} exited with status {proc.returncode}")
            try:
                url = f"http://127.0.0.1:{int(port_file.read_text())}"
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except (OSError, ValueError, httpx.HTTPError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the SGLang double of engine{e} did not start")
            time.sleep(0.2)
        entries.append((f"engine{e}", ServerActor(procs, e, Path(collectives) / f"engine{e}.log", argvs[e], envs[e]),
                        url, len(gpus), NODE, gpus))
    return entries, procs


def calls(url: str) -> list[dict]:
    return httpx.get(url + "/calls", timeout=10).json()


class Trainer:
    """What Runtime.sync_weights and the phases ask of the driver's worker: the trainer's
    checksums (of the tensors the ranks export), and its sleep and wake, each recorded with
    the time it happened (time.time(), as the engine doubles record their calls)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors
        self.calls: list[tuple[str, float]] = []

    def weight_checksums(self) -> dict[str, str]:
        return weight_checksums(sorted(self.tensors.items()))

    def sleep(self, keep_weights: bool = False) -> float:
        self.calls.append(("sleep all but the weights" if keep_weights else "sleep", time.time()))
        return 0.0

    def wake(self, weights_only: bool = False) -> float:
        self.calls.append(("wake the weights" if weights_only else "wake", time.time()))
        return 0.0


class HarnessRuntime(Runtime):
    """Runtime.sync_weights over the harness's parts; `tensors`: what the ranks export."""

    def __init__(self, cfg, engine, ranks, transport, tensors: dict[str, torch.Tensor]):
        self.cfg, self.engine, self.ranks, self.transport = cfg, engine, ranks, transport
        self.worker = Trainer(tensors)

    @property
    def colocated(self) -> bool:
        return self.cfg.rollout.mode == "colocated" and bool(self.cfg.cluster.gpus_per_node)

    # RayRuntime's own: which tags the engines release for training, and what comes back before
    # generation (a copy here would hide a mismatch between the two)
    release_engine_memory = RayRuntime.release_engine_memory
    resume_engine_memory = RayRuntime.resume_engine_memory

    def shutdown(self) -> None:
        pass
