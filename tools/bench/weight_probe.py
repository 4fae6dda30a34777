"""Benchmark: what the weights probe (sync.probe) adds to a weight sync.

`megarl train`'s sync with the embedded engine and the torch trainer in one process
(cluster.launcher=inprocess), once with the probe off and once with it on: the trainer's
log-probs of the probe's sequences before it sleeps, the engine's after the sync, the
comparison. The model is a Qwen2 of --hidden x --layers with a 32,000-token vocabulary (the
default: about 150 M parameters, float32), the probe the run's default (4 sequences of 64
tokens). Timed under the bench protocol (protocol.py): a warm-up of each, then --repeats (>= 3)
runs with their order alternated, equal work (the syncs done) checked; the median ratio of the
sync with the probe to the sync without it and its range last, and the probe's own seconds.

    python tools/bench/weight_probe.py [--hidden 1024 --layers 8 --repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from megarl.config import load_config
from megarl.data.tokenizer import train_bpe_tokenizer
from megarl.runtime.inprocess import InProcessRuntime
from megarl.versions import installed_versions

sys.path.insert(0, str(Path(__file__).resolve().parent))
from protocol import Measured, compare  # noqa: E402


def saved_model(directory: Path, hidden: int, layers: int) -> None:
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=max(hidden // 256, 1),
                      tie_word_embeddings=False)
    Qwen2ForCausalLM(cfg).save_pretrained(directory)
    train_bpe_tokenizer(["the quick brown fox jumps over the lazy dog"] * 10, 300).save_pretrained(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(installed_versions(), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        saved_model(Path(tmp), args.hidden, args.layers)
        cfg = load_config(None, [f"model.path={tmp}", "model.dtype=float32", "cluster.launcher=inprocess",
                                 "agent.max_turns=0", f"trainer.output_dir={tmp}/out"])
        runtime = InProcessRuntime(cfg, total_steps=1)
        try:
            generator = torch.Generator().manual_seed(0)
            prompts = [torch.randint(0, 32000, (200,), generator=generator).tolist() for _ in range(16)]
            runtime.install_probe(prompts)
            probe = runtime.probe
            params = sum(p.numel() for p in runtime.engine.model.parameters())
            versions = iter(range(1, 10_000))
            probe_s: list[float] = []

            def without() -> float:
                runtime.probe = None
                runtime.sync_weights(next(versions))
                return 1.0

            def with_probe() -> Measured:
                runtime.probe = probe
                start = time.perf_counter()
                runtime.sync_weights(next(versions))
                seconds = time.perf_counter() - start
                start = time.perf_counter()  # the engine's side of the probe again, untimed above, for its figure
                runtime.check_engine_weights("the bench")
                probe_s.append(time.perf_counter() - start)
                return Measured(1.0, seconds)

            result = compare({"sync": without, "sync+probe": with_probe}, repeats=args.repeats, versions=False,
                             header=f"a sync of {params / 1e6:.0f} M float32 parameters in one process, the probe "
                                    f"{len(probe.sequences)} sequences of {len(probe.sequences[0])} tokens",
                             show=lambda line: print(line, flush=True))
        finally:
            runtime.shutdown()
    print(f"the probe's engine side and comparison alone: median {statistics.median(probe_s):.3f} s")
    ratios = result.ratio("sync+probe", "sync")
    print(f"sync+probe vs sync: {statistics.median(ratios):.2f}x the time (median of {len(ratios)} alternating runs; "
          f"range {min(ratios):.2f}-{max(ratios):.2f}x)")


if __name__ == "__main__":
    main()
