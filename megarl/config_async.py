"""The `trainer.async_rollout` section of a run's configuration (megarl.config): generating the
next batches while the trainer updates, and what a weight sync does to the generations still
running (megarl.async_rollouts)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megarl.config_loader import Problems, param


@dataclass
class AsyncRolloutConfig:
    enable: bool = param(False, "Generate the next batches while the trainer updates on the current one (off = "
                         "the synchronous loop: generate, then train, then sync).")
    max_staleness: int = param(1, "Weight versions a batch may lag behind the weights it is trained from: batch k "
                               "starts generating once version k - max_staleness is on the engines (1 = one-step "
                               "off-policy; 0 = no overlap, the synchronous result).", ge=0)
    partial_rollouts: Literal["wait", "keep", "abort"] = param(
        "wait", "Generations still running at a weight sync: wait = the sync waits for them to finish; keep = they "
        "go on under the new weights (the embedded engine keeps their caches, SGLang retracts and recomputes "
        "them); abort = they end with the tokens they have and go on afterwards from those tokens under the new "
        "weights. Each token keeps the log-prob and version of the weights that sampled it.")


def check_async_rollout(cfg, problems: Problems) -> None:
    """Rules between trainer.async_rollout and the rest of the run (`cfg`: a RunConfig)."""
    a = cfg.trainer.async_rollout
    if a.enable and cfg.cluster.gpus_per_node and cfg.rollout.mode == "colocated":
        problems.add("trainer.async_rollout.enable", "overlaps generation and training, but rollout.mode=colocated "
                     "gives the engines the trainer's GPUs", "set rollout.mode=disaggregated (engines on GPUs of "
                     "their own) or turn trainer.async_rollout.enable off")
    if a.enable and a.max_staleness > 0 and cfg.algorithm.tis_cap is None:
        problems.add("algorithm.tis_cap", "is off, but trainer.async_rollout trains on samples of older weights "
                     "(max_staleness > 0)", "set algorithm.tis_cap (e.g. 2.0) so the loss corrects for the weights "
                     "that sampled them")
    if a.enable and a.partial_rollouts == "keep" and cfg.sync_transport() == "lora":
        # SGLang serves a kept request with the adapter it named when it came in, and unloads an
        # adapter only once no request holds it: the sync would wait on them, and their later
        # tokens would carry the new version (the server's) while made with the old adapter
        problems.add("trainer.async_rollout.partial_rollouts", "keep lets the generations running at a weight sync "
                     "go on with the LoRA adapter they started with (actor.lora.sync=adapter): each sync would wait "
                     "rollout.sglang.request_timeout_s for them to release the old adapter, and their later tokens "
                     "would be labelled with the new adapter's version", "set trainer.async_rollout."
                     "partial_rollouts=abort (they end with their tokens and go on with the new adapter) or wait, or "
                     "actor.lora.sync=merged (kept generations go on under the new weights)")
