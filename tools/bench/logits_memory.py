"""Benchmark: the memory a micro-batch's log-probs and entropy take, forward and backward, at the
real model's vocabulary (SmolLM2: 49,152) and at Qwen's (151,936).

Baseline: the obvious full-tensor formulas (what megarl's torch backend did before
megarl/backends/vocab_logprobs.py): `log_softmax(logits / T).gather(...)` with the entropy beside
it (`entropy_from_logits`). megarl: `token_log_probs_from_logits`, a few tokens at a time, the
gradient written into the logits' memory. Each contender runs in a fresh process: an LM head
(hidden 576, SmolLM2's) over --tokens tokens at T = 0.7, the token-mean log-prob as the loss,
the entropy as a metric, the backward into the head's input and weight; the peak resident
memory above what the process held before the step is its figure. The logits alone are
tokens x vocabulary x 4 bytes. Three alternated repeats; the median ratio baseline / megarl last.

    python tools/bench/logits_memory.py --tokens 2048
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from megarl.versions import installed_versions

CHILD = r"""
import json, resource, sys, psutil, torch
from megarl.algo import entropy_from_logits
from megarl.backends.vocab_logprobs import token_log_probs_from_logits
kind, tokens, vocab = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
hidden = torch.randn(tokens, 576, generator=g).requires_grad_()
weight = (0.05 * torch.randn(576, vocab, generator=g)).requires_grad_()
targets = torch.randint(0, vocab, (tokens,), generator=g)
before = psutil.Process().memory_info().rss
logits = hidden @ weight
if kind == "baseline":
    z = logits.float() / 0.7
    lp = torch.log_softmax(z, -1).gather(-1, targets[:, None])[:, 0]
    with torch.no_grad():
        ent = entropy_from_logits(z)
else:
    lp, ent = token_log_probs_from_logits(logits, targets, temperature=0.7, with_entropy=True)
    ent = ent.detach()
(-lp.mean()).backward()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"peak_over_start": peak - before, "log_prob_sum": float(lp.sum()), "entropy_sum": float(ent.sum())}))
"""


def run(kind: str, tokens: int, vocab: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, kind, str(tokens), str(vocab)], capture_output=True, text=True,
                         timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of the micro-batch (default 2048)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.repeats < 3:
        parser.error("--repeats must be at least 3 (the median of alternated runs)")
    print(installed_versions())
    for vocab in (49_152, 151_936):
        logits_gb = args.tokens * vocab * 4 / 1e9
        peaks = {"baseline": [], "megarl": []}
        for repeat in range(args.repeats):
            order = ("baseline", "megarl") if repeat % 2 == 0 else ("megarl", "baseline")
            results = {kind: run(kind, args.tokens, vocab) for kind in order}
            for kind in order:
                peaks[kind].append(results[kind]["peak_over_start"] / 1e9)
            same = abs(results["baseline"]["log_prob_sum"] - results["megarl"]["log_prob_sum"])
            assert same <= 1e-3 * abs(results["baseline"]["log_prob_sum"]), "the two computed different log-probs"
        ratios = [b / m for b, m in zip(peaks["baseline"], peaks["megarl"])]
        print(f"vocabulary {vocab:,}, {args.tokens} tokens (the logits alone: {logits_gb:.2f} GB): peak memory of the "
              f"step above its start, baseline {statistics.median(peaks['baseline']):.2f} GB, megarl "
              f"{statistics.median(peaks['megarl']):.2f} GB; baseline / megarl {statistics.median(ratios):.2f}x "
              f"(range {min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
