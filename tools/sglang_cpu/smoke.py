"""Smoke test of the real SGLang server on the CPU, in the venv `make sglang-env` builds:

    .venv-sglang/bin/python tools/sglang_cpu/smoke.py [--model qwen2|qwen3|qwen3_moe|all]

First checks the two helpers of the sgl_kernel stand-in (tools/sglang_cpu/sgl_kernel) against
the semantics of SGLang's triton kernels. Then, for each model: builds a tiny random one (and a
tiny byte-level BPE tokenizer) in a temporary folder, starts `python -m sglang.launch_server` on
it (SGLang's CPU engine, torch-native attention, on 127.0.0.1), asks POST /generate for 8 greedy
tokens with their log-probs, and checks them against transformers on the same weights: the same
token ids (greedy `generate`) and log-probs within --atol of a transformers forward pass. Prints
the server's start time and resident memory, stops the server (its whole process group) and
exits non-zero on any mismatch.

With --routed-experts the MoE model's server also runs with --enable-return-routed-experts and
meta_info["routed_experts"] must equal transformers' router top-k. SGLang 0.5.23's CPU engine
does not start so: it pins that host buffer with CUDA (sglang/srt/state_capturer/base.py,
`pin_memory=True` in BaseHostCache); with that one argument off it passes.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import torch
import transformers

from megarl.data.tokenizer import train_bpe_tokenizer

# the tiny models: hidden 64, 2 layers, 4 attention heads, 2 KV heads
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=320, max_position_embeddings=1024,
              rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
              initializer_range=0.2)  # larger than usual, so greedy choices have clear margins
MODELS = {
    "qwen2": (transformers.Qwen2Config, {}),
    "qwen3": (transformers.Qwen3Config, {}),
    "qwen3_moe": (transformers.Qwen3MoeConfig,
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)),
}
PROMPT = "The quick brown fox jumps over the lazy dog. Search: who wrote the tiny model?"


def build_model(name: str, folder: Path) -> None:
    texts = [PROMPT, "the tiny model answers questions about search results", "0123456789 + - * /"] * 20
    tokenizer = train_bpe_tokenizer(texts, vocab_size=300)
    config_cls, extra = MODELS[name]
    config = config_cls(**COMMON, **extra, bos_token_id=tokenizer.eos_token_id,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def check_sgl_kernel_standins() -> None:
    """The two helpers of tools/sglang_cpu/sgl_kernel against the semantics of SGLang's triton
    kernels (serving a model, as below, only imports them)."""
    import sgl_kernel

    req_to_token = torch.zeros(4, 10, dtype=torch.int32)
    sgl_kernel.assign_req_to_token_pool_cpu(torch.tensor([2, 0, 3]), req_to_token, torch.tensor([1, 0, 5]),
                                            torch.tensor([4, 2, 5]), torch.arange(100, 105), 10)
    expected = torch.zeros(4, 10, dtype=torch.int32)
    expected[2, 1:4] = torch.tensor([100, 101, 102])
    expected[0, 0:2] = torch.tensor([103, 104])
    assert torch.equal(req_to_token, expected), req_to_token

    buffers = [torch.randn(20, 2, 8), torch.randn(20, 3, 4).to(torch.bfloat16)]
    before = [b.clone() for b in buffers]
    src, tgt = torch.tensor([1, 2, 3]), torch.tensor([2, 3, 19])  # overlapping rows
    sgl_kernel.copy_all_layer_kv_cache_cpu(torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64),
                                           torch.tensor([b.stride(0) * b.element_size() for b in buffers]),
                                           tgt, src)
    for buf, old in zip(buffers, before):
        old[tgt] = old[src].clone()
        assert torch.equal(buf, old)
    print("sgl_kernel stand-ins: PASS")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, payload: dict | None = None, timeout: float = 120.0):
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read() or b"null")


def tree_rss_mb(pid: int) -> tuple[float, float]:
    """(RSS of the launcher process, RSS of it and all its children) in MiB."""
    proc = psutil.Process(pid)
    procs = [proc, *proc.children(recursive=True)]
    rss = [p.memory_info().rss for p in procs if p.is_running()]
    return rss[0] / 2**20, sum(rss) / 2**20


def stop(server: subprocess.Popen) -> None:
    """SIGTERM the server's process group (launcher, scheduler, detokenizer), SIGKILL what is left."""
    def group_alive() -> bool:
        try:
            os.killpg(server.pid, 0)
            return True
        except ProcessLookupError:
            return False

    for sig in (signal.SIGTERM, signal.SIGKILL):
        if group_alive():
            os.killpg(server.pid, sig)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            server.poll()  # reap the launcher
            if not group_alive():
                return
            time.sleep(0.2)


def run(name: str, args: argparse.Namespace, work: Path) -> bool:
    """Serve the model built in work/name, generate, compare with transformers; PASS or FAIL printed."""
    folder = work / name
    port = free_port()
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(folder),
           "--device", "cpu", "--attention-backend", "torch_native", "--dtype", args.dtype,
           "--host", "127.0.0.1", "--port", str(port), "--max-total-tokens", "32768",
           "--sleep-on-idle", "--random-seed", "0"]
    routed = name == "qwen3_moe" and args.routed_experts
    if routed:
        cmd.append("--enable-return-routed-experts")
    log_path = work / f"{name}.server.log"
    print(f"[{name}] {' '.join(cmd[1:])}\n[{name}] server log: {log_path}", flush=True)
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1")
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def fail(why: str) -> bool:
        print(f"[{name}] FAIL: {why}; the end of the server's log:\n"
              + log_path.read_text(errors="replace")[-4000:], flush=True)
        return False

    try:
        deadline = t0 + args.deadline
        while True:
            if server.poll() is not None:
                return fail(f"the server exited with code {server.returncode}")
            if time.monotonic() > deadline:
                return fail(f"not healthy within {args.deadline:.0f} s")
            try:
                http(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except OSError:
                time.sleep(0.5)
        start_s = time.monotonic() - t0

        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        prompt_ids = tokenizer(PROMPT)["input_ids"]
        payload = {"input_ids": prompt_ids, "return_logprob": True,
                   "sampling_params": {"temperature": 0, "max_new_tokens": args.new_tokens, "ignore_eos": True}}
        if routed:
            payload["return_routed_experts"] = True
        t1 = time.monotonic()
        try:
            out = http(f"http://127.0.0.1:{port}/generate", payload)
        except OSError as e:
            return fail(f"POST /generate: {e}")
        gen_s = time.monotonic() - t1
        launcher_mb, total_mb = tree_rss_mb(server.pid)
    finally:
        stop(server)

    meta = out["meta_info"]
    got_ids = list(out["output_ids"])
    got_logprobs = [lp for lp, _tok, _text in meta["output_token_logprobs"]]

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # as ignore_eos: always max_new_tokens tokens
    prompt = torch.tensor([prompt_ids])
    with torch.no_grad():
        ref = model.generate(prompt, do_sample=False, max_new_tokens=args.new_tokens,
                             min_new_tokens=args.new_tokens, pad_token_id=tokenizer.pad_token_id)
        ref_ids = ref[0, len(prompt_ids):].tolist()
        # log-probs of the server's tokens under transformers, one forward pass over prompt + output
        full = torch.tensor([prompt_ids + got_ids])
        forward = model(full, output_router_logits=True) if routed else model(full)
        logp = torch.log_softmax(forward.logits[0].float(), dim=-1)
        positions = torch.arange(len(prompt_ids) - 1, full.shape[1] - 1)
        ref_logprobs = logp[positions, torch.tensor(got_ids)].tolist()
        top2 = logp[positions].topk(2, dim=-1).values
        margin = float((top2[:, 0] - top2[:, 1]).min())

    max_err = max(abs(a - b) for a, b in zip(got_logprobs, ref_logprobs))
    ok = got_ids == ref_ids and len(got_logprobs) == len(ref_logprobs) and max_err <= args.atol
    print(f"[{name}] start {start_s:.1f} s, generate {gen_s:.2f} s, server RSS {launcher_mb:.0f} MiB "
          f"(launcher) / {total_mb:.0f} MiB (all its processes)")
    print(f"[{name}] sglang ids       {got_ids}\n[{name}] transformers ids {ref_ids}")
    print(f"[{name}] max |logprob diff| {max_err:.2e} (tolerance {args.atol:g}); smallest top-1/top-2 "
          f"log-prob margin {margin:.3f}")
    if routed:
        experts = meta.get("routed_experts")
        if experts is None:
            print(f"[{name}] FAIL: meta_info has no routed_experts (keys: {sorted(meta)})")
            ok = False
        else:
            # int32 [tokens, layers, top-k] for every token but the last; transformers: the top-k of
            # each layer's router logits (compared as sets: the order within the top-k is free)
            top_k = MODELS[name][1]["num_experts_per_tok"]
            got = torch.frombuffer(bytearray(base64.b64decode(experts)), dtype=torch.int32)
            got = got.view(-1, COMMON["num_hidden_layers"], top_k).sort(-1).values
            ref = torch.stack([r.topk(top_k, dim=-1).indices for r in forward.router_logits], 1)
            ref = ref[: full.shape[1] - 1].sort(-1).values.int()
            same = got.shape == ref.shape and bool((got == ref).all())
            print(f"[{name}] routed_experts {tuple(got.shape)} (tokens x layers x top-k), "
                  f"{'equal to' if same else 'DIFFERENT from'} transformers' router top-{top_k}")
            ok = ok and same
    print(f"[{name}] {'PASS' if ok else 'FAIL'}", flush=True)
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=[*MODELS, "all"], default="qwen2")
    parser.add_argument("--dtype", default="float32", help="the server's --dtype (transformers runs float32)")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--atol", type=float, default=5e-3, help="tolerance on the log-probs")
    parser.add_argument("--deadline", type=float, default=180.0, help="seconds for the server to become healthy")
    parser.add_argument("--routed-experts", action="store_true",
                        help="qwen3_moe: also ask for the routed experts (--enable-return-routed-experts)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (models, server logs)")
    args = parser.parse_args()
    check_sgl_kernel_standins()
    names = list(MODELS) if args.model == "all" else [args.model]
    work = Path(tempfile.mkdtemp(prefix="sglang-cpu-smoke-"))
    try:
        for name in names:  # one at a time: each seeds torch's generator
            build_model(name, work / name)
        with ThreadPoolExecutor(len(names)) as pool:  # the servers start side by side (mostly imports)
            results = dict(zip(names, pool.map(lambda name: run(name, args, work), names)))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print("smoke: " + ", ".join(f"{n} {'PASS' if ok else 'FAIL'}" for n, ok in results.items()))
    sys.exit(0 if all(results.values()) else 1)


if __name__ == "__main__":
    main()
