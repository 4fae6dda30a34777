"""Benchmark: weight sync trainer -> engine vs a raw memory copy of the same bytes.

The sync is what `megarl train` does after every update with the embedded engine: the
trainer's HF tensors grouped into buckets (megarl.weights.buckets.group_tensors), the engine paused,
every bucket copied into the engine's model, the cache flushed, the engine resumed
(`cluster.launcher=inprocess`). With --ray each bucket is also flattened into one buffer
and crosses from a trainer actor to an engine actor through Ray's object store, as with
`cluster.launcher=ray`. The baseline copies one buffer of the
same size (torch `copy_`, the best the memory system does). With --servers the weights go
to one engine server (`python -m megarl.rollout.serve`, SGLang's HTTP API) the two ways the
fleet uses off GPUs: sync.transport=disk (safetensors files, then /update_weights_from_disk)
and sync.transport=nccl (a gloo process group on a CPU machine: flat buckets broadcast while
/update_weights_from_distributed receives them), each inside SGLang's weight-update session
as `megarl train` opens it (pause and open; close, flush the cache and resume). Every
transport is set up first (Ray's actors, the server and its update group), then all are
timed with the copy under the bench protocol (protocol.py): a warm-up of each, then
--repeats (>= 3) timed runs with the contenders' order alternated, equal work (the bytes
each moved) checked; GB/s of each from its median run, then each sync's median ratio to the
copy and its range, the in-process sync's last.

    python tools/bench/weight_sync.py [--hidden 1024 --layers 8 --bucket-mb 512] [--ray] [--servers] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from megarl.rollout.local import LocalEngine
from megarl.weights.buckets import group_tensors, hf_tensors, send_flat, unpack_bucket
from megarl.weights.inprocess import load_into_engine
from megarl.versions import installed_versions

sys.path.insert(0, str(Path(__file__).resolve().parent))
from protocol import compare  # noqa: E402


def build_model(hidden: int, layers: int, seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=max(hidden // 256, 1),
                      tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg).eval()


def counted_buckets(model, bucket_bytes: int, moved: list[int]) -> Iterator[dict[str, torch.Tensor]]:
    """The model's buckets, as every transport is handed them; each bucket's bytes are appended
    to `moved` (a sync's work: the bytes it moved, which must be the copy's)."""
    for bucket in group_tensors(hf_tensors(model), bucket_bytes):
        moved.append(sum(t.numel() * t.element_size() for t in bucket.values()))
        yield bucket


def in_process(trainer, engine: LocalEngine, bucket_bytes: int) -> Callable[[], int]:
    versions = itertools.count(1)

    def sync() -> int:
        moved: list[int] = []
        asyncio.run(load_into_engine(engine, counted_buckets(trainer, bucket_bytes, moved), next(versions)))
        return sum(moved)

    return sync


def through_ray(trainer, engine_model, bucket_bytes: int, stack: ExitStack) -> Callable[[], int]:
    import ray

    @ray.remote
    class Trainer:
        def __init__(self, model):
            self.model = model

        def push(self, engine, bucket_bytes):  # as a train rank sends to the embedded engine actor
            moved = []
            ray.get(engine.pause.remote())
            send_flat(counted_buckets(self.model, bucket_bytes, moved), engine.load.remote, ray.get)
            ray.get(engine.resume.remote())
            return sum(moved)

    @ray.remote
    class Engine:
        def __init__(self, model):
            self.engine = LocalEngine(model, eos_token_ids=[])

        async def pause(self):
            await self.engine.pause()

        async def resume(self):
            await self.engine.resume()

        async def load(self, bucket):
            await self.engine.update_weights([unpack_bucket(bucket)], 1)

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    stack.callback(ray.shutdown)
    t, e = Trainer.remote(trainer), Engine.options(max_concurrency=4).remote(engine_model)
    return lambda: ray.get(t.push.remote(e, bucket_bytes))


def to_server(trainer, bucket_bytes: int, workdir: Path, stack: ExitStack) -> dict[str, Callable[[], int]]:
    """A disk sync and a process-group sync into one embedded engine server, started here and
    stopped by `stack`."""
    import threading

    from megarl.rollout.http import HTTPEngine
    from megarl.rollout.sglang_launch import ServerProcess, free_port
    from megarl.weights.disk import write_buckets
    from megarl.weights.group import DistributedSender, open_update_group

    trainer.save_pretrained(workdir / "model")
    server = ServerProcess([sys.executable, "-m", "megarl.rollout.serve", "--model-path", str(workdir / "model")],
                           "engine0", log_dir=str(workdir))
    server.start(timeout_s=300)
    stack.callback(server.stop)
    client = HTTPEngine(server.url)
    versions = itertools.count(1)  # one engine, loaded both ways: one sequence of versions

    def disk() -> int:
        moved: list[int] = []
        asyncio.run(client.begin_weight_update())
        directory = workdir / "sync"  # every version in the same place: the disk holds one copy
        write_buckets(counted_buckets(trainer, bucket_bytes, moved), directory, "rank00000")
        asyncio.run(client.load_from_disk(str(directory), next(versions)))
        asyncio.run(client.end_weight_update())
        return sum(moved)

    port, joined = free_port(), {}
    host = threading.Thread(target=lambda: joined.setdefault(
        "group", open_update_group("gloo", "127.0.0.1", port, 0, 2, "bench")))
    host.start()
    asyncio.run(client.post("/init_weights_update_group",
                            {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                             "world_size": 2, "group_name": "bench", "backend": "gloo"}))
    host.join()
    sender = DistributedSender(joined["group"], [server.url], "bench")
    stack.callback(sender.close)

    def group() -> int:
        moved: list[int] = []
        asyncio.run(client.begin_weight_update())  # the group's updates are refused outside a session
        sender.send(counted_buckets(trainer, bucket_bytes, moved), next(versions))
        asyncio.run(client.end_weight_update())
        return sum(moved)

    return {"server disk": disk, "server group": group}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--bucket-mb", type=int, default=512, help="sync.bucket_mb")
    parser.add_argument("--ray", action="store_true", help="also sync actor to actor through Ray")
    parser.add_argument("--servers", action="store_true", help="also sync into an engine server (disk, gloo group)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each (alternating), after a warm-up")
    args = parser.parse_args()
    print(installed_versions(), flush=True)
    trainer, engine_model = build_model(args.hidden, args.layers, 0), build_model(args.hidden, args.layers, 1)
    nbytes = sum(t.numel() * t.element_size() for _, t in hf_tensors(trainer))
    bucket_bytes = args.bucket_mb << 20

    src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(1)

    def copy() -> int:  # the baseline: one buffer of the same bytes, torch copy_
        dst.copy_(src)
        return nbytes

    engine = LocalEngine(engine_model, eos_token_ids=[])
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:  # the transports stop before tmp goes
        stack.callback(lambda: asyncio.run(engine.close()))
        contenders = {"copy": copy, "sync": in_process(trainer, engine, bucket_bytes)}
        if args.ray:
            contenders["ray"] = through_ray(trainer, build_model(args.hidden, args.layers, 2), bucket_bytes, stack)
        if args.servers:
            contenders |= to_server(trainer, bucket_bytes, Path(tmp), stack)
        result = compare(contenders, repeats=args.repeats, versions=False, show=lambda line: print(line, flush=True),
                         header=f"{nbytes / 1e9:.3f} GB of weights, {args.bucket_mb} MB buckets, work = bytes moved")
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(hf_tensors(trainer), hf_tensors(engine_model)))
    gb = nbytes / 1e9
    summary = {"weights_gb": round(gb, 3), "bucket_mb": args.bucket_mb}
    summary |= {f"{name.replace(' ', '_')}_gb_per_s": round(gb / statistics.median(seconds), 2)
                for name, seconds in result.seconds.items()}
    print(json.dumps(summary, indent=1))
    for name in [n for n in contenders if n not in ("copy", "sync")]:
        print(result.summary("copy", name))
    print(result.summary("copy", "sync"))  # the headline: the sync `megarl train` runs with an embedded engine


if __name__ == "__main__":
    main()
