"""Benchmark: the libraries megarl chose on three hot paths, each against the standard library
doing the same work, under the bench protocol (protocol.py).

- **Routing replay's experts** (megarl.rollout.sglang_api.decode_routed_experts): SGLang sends an
  answer's experts as base64 text of its int32 array (tokens x layers x top-k); pybase64 against
  `base64.b64decode`, both with validation, on one answer of `--tokens` tokens of Qwen3-30B-A3B
  (48 MoE layers x top-8).
- **A /generate call's JSON** (megarl.rollout.http.HTTPEngine.generate): the request body written
  and the answer read, orjson against `json`, on a Search-R1 turn of the fleet bench's shape
  (`--context` input ids, `--new-tokens` sampled with their log-probs).
- **A checkpoint file's record** (megarl.checkpoint): zlib's CRC32 against sha256, over
  `--megabytes` of random bytes.

Equal work: each side decodes, parses or hashes the same input the same number of times, and the
decoded bytes and parsed objects are checked equal once before the timing.

    python tools/bench/codecs.py [--tokens 6000 --context 1500 --new-tokens 150 --megabytes 256]

Prints the versions first, then each comparison's runs and its median ratio last.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import ssl
import statistics
import zlib

import numpy as np
import orjson
import pybase64
import torch

from megarl.rollout.sglang_api import encode_routed_experts
from megarl.versions import installed_versions
from protocol import compare

LAYERS, TOP_K, EXPERTS = 48, 8, 128  # Qwen3-30B-A3B


def per_call(result, name: str, calls: int, unit: str = "ms", scale: float = 1e3) -> str:
    return f"{name} {statistics.median(result.seconds[name]) / calls * scale:.3f} {unit}"


def routing(tokens: int, answers: int) -> None:
    routed = torch.from_numpy(np.random.default_rng(0).integers(0, EXPERTS, (tokens, LAYERS, TOP_K), dtype=np.int32))
    text = encode_routed_experts(routed)
    assert base64.b64decode(text, validate=True) == pybase64.b64decode(text, validate=True)

    def decode_with(b64decode):
        def run():
            for _ in range(answers):
                b64decode(text, validate=True)
            return answers * len(text)
        return run

    result = compare({"base64": decode_with(base64.b64decode), "pybase64": decode_with(pybase64.b64decode)},
                     versions=False, header=f"routing replay: one answer's experts, {tokens:,} tokens x {LAYERS} x "
                     f"{TOP_K} int32 = {len(text) / 1e6:.1f} MB of base64, decoded {answers} times a run; work = bytes")
    print(f"a {len(text) / 1e6:.1f} MB answer: {per_call(result, 'pybase64', answers)} against "
          f"{per_call(result, 'base64', answers)} (median)")
    print(result.summary("base64", "pybase64"))


def generate_json(context: int, new_tokens: int, calls: int) -> None:
    rng = np.random.default_rng(1)
    body = {"input_ids": rng.integers(0, 151_000, context).tolist(),
            "sampling_params": {"max_new_tokens": 500, "temperature": 1.0, "sampling_seed": 8, "stop": ["</search>"]},
            "return_logprob": True}
    out = rng.integers(0, 151_000, new_tokens).tolist()
    answer = orjson.dumps({"text": "x" * (4 * new_tokens), "output_ids": out, "meta_info": {
        "id": "0-1", "finish_reason": {"type": "stop", "matched": "</search>"}, "prompt_tokens": context,
        "completion_tokens": new_tokens, "cached_tokens": 0, "weight_version": "default",
        "output_token_logprobs": [[float(lp), t, None] for lp, t in zip(-rng.exponential(1.0, new_tokens), out)]}})
    assert json.loads(json.dumps(body)) == orjson.loads(orjson.dumps(body)) and json.loads(answer) == orjson.loads(answer)

    def with_json():
        for _ in range(calls):
            json.dumps(body).encode()
            json.loads(answer)
        return calls

    def with_orjson():
        for _ in range(calls):
            orjson.dumps(body)
            orjson.loads(answer)
        return calls

    result = compare({"json": with_json, "orjson": with_orjson}, versions=False,
                     header=f"/generate: a body of {context:,} input ids written and an answer of {new_tokens} tokens "
                     f"with log-probs ({len(answer) / 1e3:.1f} kB) read, {calls} calls a run; work = calls")
    print(f"a call: {per_call(result, 'orjson', calls, 'us', 1e6)} against {per_call(result, 'json', calls, 'us', 1e6)} "
          "(median)")
    print(result.summary("json", "orjson"))


def checksum(megabytes: int) -> None:
    data = os.urandom(megabytes << 20)

    def crc32():
        zlib.crc32(data)
        return len(data)

    def sha256():
        hashlib.sha256(data).digest()
        return len(data)

    result = compare({"sha256": sha256, "crc32": crc32}, versions=False,
                     header=f"a checkpoint file's record: {megabytes} MB hashed a run, one thread (zlib "
                     f"{zlib.ZLIB_RUNTIME_VERSION}, hashlib on {ssl.OPENSSL_VERSION}); work = bytes")
    rates = {n: len(data) / statistics.median(s) / 1e9 for n, s in result.seconds.items()}
    print(f"crc32 {rates['crc32']:.2f} GB/s against sha256 {rates['sha256']:.2f} GB/s (median)")
    print(result.summary("sha256", "crc32"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=6000, help="tokens of the answer whose experts are decoded")
    parser.add_argument("--answers", type=int, default=20, help="answers decoded a run")
    parser.add_argument("--context", type=int, default=1500, help="input ids of a /generate request")
    parser.add_argument("--new-tokens", type=int, default=150, help="tokens of a /generate answer")
    parser.add_argument("--calls", type=int, default=2000, help="/generate calls a run")
    parser.add_argument("--megabytes", type=int, default=256, help="bytes hashed a run, in MB")
    args = parser.parse_args()
    print(installed_versions(("pybase64", "orjson", "numpy", "torch")), flush=True)
    routing(args.tokens, args.answers)
    generate_json(args.context, args.new_tokens, args.calls)
    checksum(args.megabytes)


if __name__ == "__main__":
    main()
