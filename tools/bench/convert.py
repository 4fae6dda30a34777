"""Benchmark: checkpoint conversion throughput vs plainly copying the same bytes on the same disk.

Writes an HF checkpoint of a Qwen2-shaped model (random weights, bf16 by default), then times,
under the bench protocol (protocol.py: a warm-up, 3 alternating runs, equal bytes checked, the
median ratio last): a copy of its safetensors files to a new directory (read + write through
the process, the baseline; a kernel copy with sendfile too), its conversion with
`python -m ckpt_convert.hf_to_megatron`, and back with `python -m ckpt_convert.megatron_to_hf`.
Every contender's output is fsynced before its clock stops. Each conversion runs in its own
process so its peak RSS can be read (the processes' start-up, mostly imports, is counted; the
conversion's own time, as each converter reports it, is printed too). Prints GB/s of each,
their ratio to the copy (target >= 0.5), and each conversion's peak RSS against the largest
tensor of the model.

    python tools/bench/convert.py [--hidden 2048 --layers 8 --vocab 151936 --dtype bfloat16] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from megarl.versions import installed_versions
from protocol import compare


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


def synced_bytes(directory: Path) -> int:
    """fsync every file below `directory` (each contender's output is on disk when it is done:
    the copy's, and the converters', which do not sync themselves); the bytes of its weights."""
    total = 0
    for f in sorted(directory.rglob("*")):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
            if f.suffix in (".safetensors", ".distcp"):
                total += f.stat().st_size
    return total


def copy_files(src: Path, dst: Path, kernel: bool) -> int:
    """Copy the safetensors files: through this process in 64 MiB reads and writes (as a
    converter moves bytes), or inside the kernel (sendfile); the bytes written."""
    dst.mkdir()
    for f in src.glob("*.safetensors"):
        if kernel:
            shutil.copyfile(f, dst / f.name)
        else:
            with open(f, "rb") as a, open(dst / f.name, "wb") as b:
                while chunk := a.read(64 << 20):
                    b.write(chunk)
    return synced_bytes(dst)


def timed_child(args: list[str]) -> tuple[float, int]:
    """(seconds of the conversion itself, peak RSS in bytes) of `python ARGS` in a child process
    (its own rusage); the converters end with '... in S s)' on stderr."""
    with tempfile.TemporaryFile() as err:  # a file, not a pipe: a full pipe would stall the child
        proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        err.seek(0)
        text = err.read().decode(errors="replace")
    if os.waitstatus_to_exitcode(status):
        raise RuntimeError(f"{args} failed: {text[-2000:]}")
    return float(re.findall(r" in ([0-9.]+) s\)", text)[-1]), usage.ru_maxrss * 1024  # KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each (alternating), after a warm-up")
    parser.add_argument("--dir", help="where to write (default: a temporary directory)")
    parser.add_argument("--write-model", help=argparse.SUPPRESS)  # the child that writes the HF model
    args = parser.parse_args()
    print(installed_versions(), flush=True)
    if args.write_model:
        print(write_model(Path(args.write_model), args.hidden, args.layers, args.vocab, args.dtype))
        return
    root = Path(tempfile.mkdtemp(prefix="megarl-convert-", dir=args.dir))
    inside: dict[str, list[float]] = {"hf_to_megatron": [], "megatron_to_hf": []}  # each converter's own time
    rss: dict[str, int] = {}

    def fresh(name: str) -> Path:
        shutil.rmtree(root / name, ignore_errors=True)  # the last run's output: the disk holds one of each
        return root / name

    def converter(name: str, argv: list[str], out: str) -> Callable[[], int]:
        def run() -> int:
            seconds, rss[name] = timed_child([*argv, "--out", str(fresh(out))])
            inside[name].append(seconds)
            return synced_bytes(root / out)
        return run

    try:
        largest = int(subprocess.run(
            [sys.executable, __file__, "--write-model", str(root / "hf"), "--hidden", str(args.hidden), "--layers",
             str(args.layers), "--vocab", str(args.vocab), "--dtype", args.dtype],
            check=True, capture_output=True, text=True).stdout.split()[-1])
        nbytes = synced_bytes(root / "hf")
        contenders = {
            "copy": lambda: copy_files(root / "hf", fresh("copy"), kernel=False),
            "kernel copy": lambda: copy_files(root / "hf", fresh("kernel_copy"), kernel=True),
            "hf_to_megatron": converter("hf_to_megatron", ["-m", "ckpt_convert.hf_to_megatron", "--hf",
                                                           str(root / "hf")], "dist"),
            "megatron_to_hf": converter("megatron_to_hf", ["-m", "ckpt_convert.megatron_to_hf", "--ckpt",
                                                           str(root / "dist"), "--max-shard-gb", "1"], "back"),
        }
        result = compare(contenders, repeats=args.repeats, work_tolerance=0.01, versions=False,
                         show=lambda line: print(line, flush=True),
                         header=f"model {nbytes / 1e9:.2f} GB ({args.dtype}), largest tensor {largest / 1e9:.2f} GB; "
                                "each contender's output fsynced, work = the weights' bytes written")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for name in contenders:
        print(f"{name}: GB/s " + ", ".join(f"{nbytes / 1e9 / s:.2f}" for s in result.seconds[name]))
    for name in inside:
        # the converter's own time (without its process start-up, mostly imports) is not
        # compared: the copy has no start-up to leave out
        print(f"{name}: without the process start-up GB/s " + ", ".join(f"{nbytes / 1e9 / s:.2f}" for s in inside[name][-args.repeats:])
              + f"; peak RSS {rss[name] / largest:.1f}x the largest tensor ({rss[name] / 1e9:.2f} GB)")
    for name in inside:
        print(result.summary("kernel copy", name))
    for name in inside:
        print(result.summary("copy", name) + " (target >= 0.5x)")

if __name__ == "__main__":
    main()
