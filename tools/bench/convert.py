"""Benchmark: checkpoint conversion throughput vs plainly copying the same bytes on the same disk.

Writes an HF checkpoint of a Qwen2-shaped model (random weights, bf16 by default), then, one
run each: copies its safetensors files to a new directory (read + write + fsync through the
process, the baseline; a kernel copy with sendfile is printed too), converts it with `python -m ckpt_convert.hf_to_megatron` and back with
`python -m ckpt_convert.megatron_to_hf`, each conversion in its own process so its peak RSS
can be read (the processes' start-up, mostly imports, is counted; the conversion's own time,
as each converter reports it, is printed too). Prints GB/s of each, their ratio to the copy (target >= 0.5), and each
conversion's peak RSS against the largest tensor of the model.

    python tools/bench/convert.py [--hidden 2048 --layers 8 --vocab 151936 --dtype bfloat16] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megarl.versions import installed_versions


def write_model(path: Path, hidden: int, layers: int, vocab: int, dtype: str) -> int:
    """Save the model; returns its largest tensor's bytes. Runs in a child process: a child's
    peak RSS counts the pages of the parent it was forked from, so the parent stays small."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=hidden // 128, num_key_value_heads=2,
                         tie_word_embeddings=False)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    model = model.to_empty(device="cpu").to(getattr(torch, dtype))
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    model.save_pretrained(path, max_shard_size="2GB")
    return max(p.numel() * p.element_size() for p in model.parameters())


def copy_files(src: Path, dst: Path, kernel: bool) -> float:
    """Seconds to copy the safetensors files and fsync them: through this process in 64 MiB
    reads and writes (as a converter moves bytes), or inside the kernel (sendfile)."""
    dst.mkdir()
    start = time.perf_counter()
    for f in src.glob("*.safetensors"):
        if kernel:
            shutil.copyfile(f, dst / f.name)
        else:
            with open(f, "rb") as a, open(dst / f.name, "wb") as b:
                while chunk := a.read(64 << 20):
                    b.write(chunk)
        fd = os.open(dst / f.name, os.O_RDONLY)
        os.fsync(fd)  # the conversion's writer syncs its files too
        os.close(fd)
    return time.perf_counter() - start


def timed_child(args: list[str]) -> tuple[float, float, int]:
    """(seconds, seconds of the conversion itself, peak RSS in bytes) of `python ARGS` in a
    child process (its own rusage); the converters end with '... in S s)' on stderr."""
    start = time.perf_counter()
    with tempfile.TemporaryFile() as err:  # a file, not a pipe: a full pipe would stall the child
        proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - start
        err.seek(0)
        text = err.read().decode(errors="replace")
    if os.waitstatus_to_exitcode(status):
        raise RuntimeError(f"{args} failed: {text[-2000:]}")
    inside = float(re.findall(r" in ([0-9.]+) s\)", text)[-1])
    return seconds, inside, usage.ru_maxrss * 1024  # KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--dir", help="where to write (default: a temporary directory)")
    parser.add_argument("--write-model", help=argparse.SUPPRESS)  # the child that writes the HF model
    args = parser.parse_args()
    print(installed_versions(), flush=True)
    if args.write_model:
        print(write_model(Path(args.write_model), args.hidden, args.layers, args.vocab, args.dtype))
        return
    root = Path(tempfile.mkdtemp(prefix="megarl-convert-", dir=args.dir))
    try:
        largest = int(subprocess.run(
            [sys.executable, __file__, "--write-model", str(root / "hf"), "--hidden", str(args.hidden), "--layers",
             str(args.layers), "--vocab", str(args.vocab), "--dtype", args.dtype],
            check=True, capture_output=True, text=True).stdout.split()[-1])
        nbytes = sum(f.stat().st_size for f in (root / "hf").glob("*.safetensors"))
        copy_s = copy_files(root / "hf", root / "copy", kernel=False)
        kernel_copy_s = copy_files(root / "hf", root / "kernel_copy", kernel=True)
        to_dist_s, to_dist_inside, to_dist_rss = timed_child(
            ["-m", "ckpt_convert.hf_to_megatron", "--hf", str(root / "hf"), "--out", str(root / "dist")])
        back_s, back_inside, back_rss = timed_child(
            ["-m", "ckpt_convert.megatron_to_hf", "--ckpt", str(root / "dist"), "--out", str(root / "back"),
             "--max-shard-gb", "1"])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gb = nbytes / 1e9
    result = {"model_gb": round(gb, 3), "largest_tensor_gb": round(largest / 1e9, 3),
              "copy_gb_per_s": round(gb / copy_s, 3), "kernel_copy_gb_per_s": round(gb / kernel_copy_s, 3), "hf_to_megatron_gb_per_s": round(gb / to_dist_s, 3),
              "megatron_to_hf_gb_per_s": round(gb / back_s, 3),
              "hf_to_megatron_without_start_up_gb_per_s": round(gb / to_dist_inside, 3),
              "megatron_to_hf_without_start_up_gb_per_s": round(gb / back_inside, 3),
              "hf_to_megatron_peak_rss_gb": round(to_dist_rss / 1e9, 3),
              "megatron_to_hf_peak_rss_gb": round(back_rss / 1e9, 3)}
    print(json.dumps(result, indent=1))
    for name, seconds, inside, rss in (("hf_to_megatron", to_dist_s, to_dist_inside, to_dist_rss),
                                       ("megatron_to_hf", back_s, back_inside, back_rss)):
        print(f"{name} / copy: {copy_s / seconds:.2f}x, without the process start-up {copy_s / inside:.2f}x "
              f"(/ kernel copy: {kernel_copy_s / seconds:.2f}x, {kernel_copy_s / inside:.2f}x); "
              f"peak RSS {rss / largest:.1f}x the largest tensor")


if __name__ == "__main__":
    main()
