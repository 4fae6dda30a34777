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
/update_weights_from_distributed receives them), each with the pause / flush / resume around
it. One run of each after a warm-up; GB/s and the ratio printed.

    python tools/bench/weight_sync.py [--hidden 1024 --layers 8 --bucket-mb 512] [--ray] [--servers]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from megarl.rollout.local import LocalEngine
from megarl.weights.buckets import group_tensors, hf_tensors, send_flat, unpack_bucket
from megarl.weights.inprocess import load_into_engine
from megarl.versions import installed_versions


def build_model(hidden: int, layers: int, seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=max(hidden // 256, 1),
                      tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg).eval()


def sync_in_process(trainer, engine: LocalEngine, bucket_bytes: int) -> float:
    start = time.perf_counter()
    asyncio.run(load_into_engine(engine, group_tensors(hf_tensors(trainer), bucket_bytes), version=1))
    return time.perf_counter() - start


def sync_through_ray(trainer, engine_model, bucket_bytes: int) -> float:
    import ray

    @ray.remote
    class Trainer:
        def __init__(self, model):
            self.model = model

        def push(self, engine, bucket_bytes):  # as a train rank sends to the embedded engine actor
            ray.get(engine.pause.remote())
            send_flat(group_tensors(hf_tensors(self.model), bucket_bytes), engine.load.remote, ray.get)
            ray.get(engine.resume.remote())

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
    try:
        t, e = Trainer.remote(trainer), Engine.options(max_concurrency=4).remote(engine_model)
        ray.get(t.push.remote(e, bucket_bytes))  # warm-up
        start = time.perf_counter()
        ray.get(t.push.remote(e, bucket_bytes))
        return time.perf_counter() - start
    finally:
        ray.shutdown()


def sync_to_server(trainer, bucket_bytes: int, workdir) -> dict[str, float]:
    """Seconds of a disk sync and of a process-group sync into one embedded engine server."""
    import sys
    import threading
    from pathlib import Path

    from megarl.rollout.http import HTTPEngine
    from megarl.rollout.sglang_launch import ServerProcess, free_port
    from megarl.weights.disk import write_buckets
    from megarl.weights.group import DistributedSender, open_update_group

    workdir = Path(workdir)
    trainer.save_pretrained(workdir / "model")
    server = ServerProcess([sys.executable, "-m", "megarl.rollout.serve", "--model-path", str(workdir / "model")],
                           "engine0", log_dir=str(workdir))
    server.start(timeout_s=300)
    client = HTTPEngine(server.url)
    seconds = {}
    try:
        def disk(version):
            start = time.perf_counter()
            asyncio.run(client.pause())
            directory = workdir / f"v{version}"
            write_buckets(group_tensors(hf_tensors(trainer), bucket_bytes), directory, "rank00000")
            asyncio.run(client.load_from_disk(str(directory), version))
            asyncio.run(client.flush_cache())
            asyncio.run(client.resume())
            return time.perf_counter() - start

        disk(1)  # warm-up
        seconds["disk"] = disk(2)

        port, joined = free_port(), {}
        host = threading.Thread(target=lambda: joined.setdefault(
            "group", open_update_group("gloo", "127.0.0.1", port, 0, 2, "bench")))
        host.start()
        asyncio.run(client.post("/init_weights_update_group",
                                {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                                 "world_size": 2, "group_name": "bench", "backend": "gloo"}))
        host.join()
        sender = DistributedSender(joined["group"], [server.url], "bench")

        def group(version):
            start = time.perf_counter()
            asyncio.run(client.pause())
            sender.send(group_tensors(hf_tensors(trainer), bucket_bytes), version)
            asyncio.run(client.flush_cache())
            asyncio.run(client.resume())
            return time.perf_counter() - start

        group(3)  # warm-up
        seconds["group"] = group(4)
        sender.close()
    finally:
        server.stop()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--bucket-mb", type=int, default=512, help="sync.bucket_mb")
    parser.add_argument("--ray", action="store_true", help="also sync actor to actor through Ray")
    parser.add_argument("--servers", action="store_true", help="also sync into an engine server (disk, gloo group)")
    args = parser.parse_args()
    print(installed_versions(), flush=True)
    trainer, engine_model = build_model(args.hidden, args.layers, 0), build_model(args.hidden, args.layers, 1)
    nbytes = sum(t.numel() * t.element_size() for _, t in hf_tensors(trainer))
    bucket_bytes = args.bucket_mb << 20

    src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(1)
    dst.copy_(src)  # warm-up: pages touched
    start = time.perf_counter()
    dst.copy_(src)
    copy_s = time.perf_counter() - start
    del src, dst

    engine = LocalEngine(engine_model, eos_token_ids=[])
    sync_in_process(trainer, engine, bucket_bytes)  # warm-up
    sync_s = sync_in_process(trainer, engine, bucket_bytes)
    asyncio.run(engine.close())
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(hf_tensors(trainer), hf_tensors(engine_model)))
    gb = nbytes / 1e9
    result = {"weights_gb": round(gb, 3), "bucket_mb": args.bucket_mb, "raw_copy_gb_per_s": round(gb / copy_s, 2),
              "sync_in_process_gb_per_s": round(gb / sync_s, 2)}
    if args.ray:
        result["sync_ray_gb_per_s"] = round(gb / sync_through_ray(trainer, build_model(args.hidden, args.layers, 2),
                                                                  bucket_bytes), 2)
    if args.servers:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            for name, sec in sync_to_server(trainer, bucket_bytes, tmp).items():
                result[f"sync_server_{name}_gb_per_s"] = round(gb / sec, 2)
    print(json.dumps(result, indent=1))
    print(f"in-process sync / raw copy: {copy_s / sync_s:.2f}x")
    if args.ray:
        print(f"Ray actor-to-actor sync / raw copy: {result['sync_ray_gb_per_s'] / result['raw_copy_gb_per_s']:.2f}x")
    if args.servers:
        for name in ("disk", "group"):
            print(f"engine server, {name} / raw copy: "
                  f"{result[f'sync_server_{name}_gb_per_s'] / result['raw_copy_gb_per_s']:.2f}x")


if __name__ == "__main__":
    main()
