"""The journey's last step: the exported model served by SGLang 0.5.23, started as its docs
start it (`python -m sglang.launch_server --model-path DIR`, here with the CPU engine's flags
in place of --tp), generates greedily the tokens HF generates, with HF's log-probs.

    python tests/journey/serve_check.py SGLANG_PYTHON MODEL_DIR
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' helpers
from gpu_harness import wait_healthy  # noqa: E402
from megarl.rollout.engine import SamplingParams  # noqa: E402
from megarl.rollout.http import HTTPEngine  # noqa: E402
from megarl.rollout.sglang_launch import CPU_SERVER_ENV, CPU_SERVER_FLAGS, free_port  # noqa: E402

TOLERANCE = 1e-4  # float32 on both sides; SGLang's CPU kernels differ from HF's in the last bits


def main(sglang_python: str, model_dir: str) -> int:
    port = free_port()
    log = Path(model_dir).parent / "serve_check.log"
    argv = [sglang_python, "-m", "sglang.launch_server", "--model-path", model_dir, "--host", "127.0.0.1",
            "--port", str(port), "--dtype", "float32", *CPU_SERVER_FLAGS, "--max-total-tokens", "4096"]
    with open(log, "wb") as out:
        server = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **CPU_SERVER_ENV})
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(server, url, "SGLang", time.monotonic() + 300)
        except (RuntimeError, TimeoutError) as e:
            raise RuntimeError(f"{e}; its log ends:\n{log.read_text()[-3000:]}") from None
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        prompt = tokenizer.encode("3 + 4 =", add_special_tokens=False)
        params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
        client = HTTPEngine(url)
        out = asyncio.run(client.generate(prompt, params))
        with torch.no_grad():
            hf = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8, min_new_tokens=8)
            logits = model(torch.tensor([prompt + out.token_ids])).logits[0].float()
        want = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].gather(-1, torch.tensor(out.token_ids)[:, None])
        differ = (torch.tensor(out.log_probs) - want.squeeze(-1)).abs().max().item()
        if out.token_ids != hf[0, len(prompt):].tolist() or differ > TOLERANCE:
            print(f"serve_check: SGLang gave {out.token_ids} (HF {hf[0, len(prompt):].tolist()}), log-probs off by "
                  f"{differ:.2e} (at most {TOLERANCE})", file=sys.stderr)
            return 1
        print(f"serve_check: SGLang serves {model_dir}: HF's greedy tokens, log-probs within {differ:.1e}")
        return 0
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
