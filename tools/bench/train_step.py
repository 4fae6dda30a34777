"""Benchmark: forward + backward of the policy loss, megatron backend vs torch backend, on
one device, same model shape, same weights, same batch.

Both models are built first (both stay in memory), then timed under the bench protocol
(protocol.py): a warm-up of each, then --repeats (>= 3) timed runs with the two alternated,
each run --iters steps, equal work (tokens processed) checked; tokens/s and MFU (model FLOPs
utilisation) of each from its median run, then the median megatron / torch ratio and its
range last. The torch backend is the HF model (SDPA attention) with log-softmax over the full
vocabulary; the megatron backend is megatron-core's GPTModel (Transformer Engine layers where
installed, otherwise the local spec) through its forward-backward schedule with the
vocabulary-parallel log-probs. Both compute the same token-mean policy-gradient surrogate.

    python tools/bench/train_step.py --model qwen2.5-0.5b --batch 4 --seq 4096   # one GPU, bf16
    python tools/bench/train_step.py --model tiny --batch 2 --seq 128            # CPU smoke run
    python tools/bench/train_step.py --model-dir build/real-model/smollm2-135m --batch 2 --seq 512  # the real model

MFU = achieved FLOP/s / peak, with model FLOPs per token = 6 N + 12 L H S (N the matmul
parameters incl. the LM head, L layers, H hidden size, S sequence length; the usual
convention, no recomputation counted). Peak: --peak-tflops, default 989 (H100 SXM dense
bf16) on CUDA. On the CPU the peak is measured in the same run: the FLOP/s of a plain float32
torch matmul (2,048 square, all threads), so the CPU's MFU says how close a step comes to the
machine's own matmul rate.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from megarl.versions import installed_versions

sys.path.insert(0, str(Path(__file__).resolve().parent))
from protocol import compare  # noqa: E402

SHAPES = {  # Qwen2.5 shapes (vocabulary, hidden, ffn, layers, heads, kv heads)
    "qwen2.5-0.5b": (151936, 896, 4864, 24, 14, 2),
    "qwen2.5-1.5b": (151936, 1536, 8960, 28, 12, 2),
    "tiny": (1000, 128, 384, 4, 4, 2),
}


def hf_config(name: str) -> dict:
    vocab, hidden, ffn, layers, heads, kv = SHAPES[name]
    return dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=vocab, hidden_size=hidden,
                intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
                hidden_act="silu")


def flops_per_token(cfg: dict, seq: int) -> float:
    h, f, layers, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    kv_dim = h // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    per_layer = h * h * 2 + 2 * h * kv_dim + 3 * h * f  # q, o, k, v, gate, up, down
    return 6 * (layers * per_layer + v * h) + 12 * layers * h * seq


def matmul_flops(device, dtype, size: int = 2048, seconds: float = 3.0) -> float:
    """FLOP/s of a plain (size x size) @ (size x size) torch matmul on `device`: the best of a few
    timed rounds of about `seconds` / 3 each, after a warm-up."""
    import time

    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b
    best = 0.0
    for _ in range(3):
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / 3:
            a @ b
            count += 1
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = max(best, 2 * size ** 3 * count / (time.perf_counter() - start))
    return best


def timed_steps(step: Callable[[], None], iters: int, tokens: int, device) -> Callable[[], int]:
    """A contender: `iters` steps, timed until the device has finished them (so every run
    starts on an idle device); the work is the tokens processed."""
    def run() -> int:
        for _ in range(iters):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return tokens * iters
    return run


def torch_step(model_dir: str, ids: torch.Tensor, dtype, device) -> Callable[[], None]:
    from transformers import AutoModelForCausalLM

    from megarl.backends.torch.logprobs import token_log_probs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).train()
    mask = torch.ones_like(ids)

    def step():
        model.zero_grad(set_to_none=True)
        lp, _ = token_log_probs(model, ids, mask)
        (-lp.sum() / lp.numel()).backward()

    return step


def megatron_step(model_dir: str, ids: torch.Tensor, dtype_name: str) -> tuple[Callable[[], None], str]:
    from megatron.core import parallel_state

    from megarl.backends.batch import TrainBatch
    from megarl.backends.megatron.forward import make_micro_batches, run_schedule
    from megarl.backends.megatron.layers import resolve_impl
    from megarl.backends.megatron.model import Layout, build_model, initialize, load_hf_weights
    from megarl.backends.vocab_logprobs import token_log_probs_from_logits
    from megarl.models import ModelSpec

    spec = ModelSpec.from_hf(model_dir)
    layout = Layout()
    initialize(layout, seed=0)
    impl = resolve_impl("transformer_engine")
    chunks = build_model(spec, layout, dtype=dtype_name, impl=impl)
    load_hf_weights(chunks, spec, model_dir)
    for chunk in chunks:
        chunk.train()
    rows = ids.cpu()
    batch = TrainBatch(rows, torch.ones_like(rows), torch.ones_like(rows))
    micros = make_micro_batches(batch, [list(range(len(rows)))], 1)

    def head(output, micro):
        lp, _ = token_log_probs_from_logits(output, micro.targets.to(output.device), vocab_size=spec.vocab_size,
                                            group=parallel_state.get_tensor_model_parallel_group())
        lp = micro.by_token(lp)
        return -lp.sum() / lp.numel(), {}

    def step():
        for chunk in chunks:
            chunk.zero_grad(set_to_none=True)
        run_schedule(chunks, micros, head, forward_only=False)

    return step, impl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    parser.add_argument("--model-dir", type=Path, help="an HF directory (its weights and shape) instead of --model's "
                        "random weights, e.g. the real model of `make real-model`")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=5, help="steps per timed run (default 5)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each (alternating), after a warm-up")
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    args = parser.parse_args()
    print(installed_versions(), flush=True)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dtype_name = "bfloat16" if cuda else "float32"
    dtype = getattr(torch, dtype_name)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    if cuda:
        torch.cuda.set_device(device)

    cfg = json.loads((args.model_dir / "config.json").read_text()) if args.model_dir else hf_config(args.model)
    name = args.model_dir.name if args.model_dir else args.model
    with tempfile.TemporaryDirectory() as scratch:
        from transformers import AutoConfig, AutoModelForCausalLM

        if args.model_dir:
            model_dir = str(args.model_dir)
        else:
            model_dir = scratch
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=dtype)
            model.save_pretrained(model_dir)
            del model
        ids = torch.randint(0, cfg["vocab_size"], (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
        ids = ids.to(device)
        tokens = args.batch * args.seq
        run_torch = timed_steps(torch_step(model_dir, ids, dtype, device), args.iters, tokens, device)
        megatron, impl = megatron_step(model_dir, ids, dtype_name)
        result = compare({"torch": run_torch, "megatron": timed_steps(megatron, args.iters, tokens, device)},
                         repeats=args.repeats, versions=False, show=lambda line: print(line, flush=True),
                         header=f"{name}, batch {args.batch} x seq {args.seq}, {args.iters} steps per run, "
                                "work = tokens processed")
    step_s = {name: statistics.median(seconds) / args.iters for name, seconds in result.seconds.items()}
    summary = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "model": name, "dtype": dtype_name,
               "tokens_per_step": tokens, "megatron_impl": impl}
    summary |= {f"{name}_tokens_per_s": round(tokens / seconds, 1) for name, seconds in step_s.items()}
    flops = flops_per_token(cfg, args.seq) * tokens
    if cuda:
        peak = args.peak_tflops * 1e12
        summary["peak_tflops"] = args.peak_tflops
    else:  # the machine's own matmul rate, measured now
        peak = matmul_flops(device, dtype)
        summary["peak_tflops_measured_matmul"] = round(peak / 1e12, 4)
    summary |= {f"{name}_mfu": round(flops / seconds / peak, 4) for name, seconds in step_s.items()}
    print(json.dumps(summary, indent=1))
    torch.distributed.destroy_process_group()
    print(result.summary("torch", "megatron"))


if __name__ == "__main__":
    main()
