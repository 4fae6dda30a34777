"""A resume continues the run its checkpoint was trained in, not another one by accident.

Every checkpoint records its run's config (flattened, secrets left out). Resuming with a
config that changes what is learned (the model, the data, the algorithm, the optimizer, the
sampling, the rewards, the seed) is refused before anything starts, naming each changed key
with both values: a rerun of the same output directory with an edited config would otherwise
continue the old run's weights and MLflow run under new params. Keys that only say where and
how the run runs (`OPERATIONAL`: the layout, the cluster, the engines' servers, tracking,
how long to train, how often to save or validate) may change freely: a run is resumed on
another layout, extended by more steps, or moved to another cluster. With
`trainer.resume_changed_config=true` the changed keys are logged and the run resumes.
Checkpoints written before megarl recorded the config are resumed as they are. Main entry
point: `check_resume`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from megarl.errors import RunInputError

log = logging.getLogger(__name__)

# keys (exact, or a prefix ending in ".") a resume may change: where and how the run runs
OPERATIONAL = (
    "trainer.total_training_steps", "trainer.total_epochs", "trainer.save_freq", "trainer.save_interval_min",
    "trainer.save_before_job_end", "trainer.job_end_margin_s", "trainer.test_freq",
    "trainer.max_ckpt_to_keep", "trainer.max_bad_steps", "trainer.max_rewardless_steps", "trainer.resume", "trainer.resume_changed_config",
    "trainer.output_dir", "trainer.val_before_train", "trainer.sleep_during_generation",
    "tracking.", "cluster.", "sync.",
    "actor.parallel.", "actor.max_tokens_per_gpu", "actor.gradient_checkpointing", "actor.reference_offload",
    "actor.optim.offload", "actor.pack_sequences", "actor.transformer_impl",
    "critic.parallel.", "critic.max_tokens_per_gpu", "critic.gradient_checkpointing", "critic.reference_offload",
    "critic.optim.offload", "critic.pack_sequences", "critic.transformer_impl",
    "rollout.engine", "rollout.mode", "rollout.num_engines", "rollout.tensor_parallel_size",
    "rollout.expert_parallel_size", "rollout.nodes_per_engine", "rollout.gpu_memory_utilization",
    "rollout.max_concurrency", "rollout.sglang.", "rollout.val.",
    "data.val_files", "data.val_batch_size",
    "reward.num_workers", "reward.timeout_s", "reward.sandbox_servers", "reward.code_sandbox_url",
    "agent.retrieval.url", "agent.retrieval.host", "agent.retrieval.port", "agent.retrieval.timeout_s",
    "agent.retrieval.max_retries",
)


def operational(key: str) -> bool:
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in OPERATIONAL)


def changed_keys(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The keys, in order, whose values differ between the checkpoint's config and this run's
    (a key only one side has counts), leaving out the operational ones."""
    missing = object()
    return sorted(k for k in set(saved) | set(now)
                  if not operational(k) and saved.get(k, missing) != now.get(k, missing))


def check_resume(saved: dict[str, Any] | None, now: dict[str, Any], checkpoint: Path, forced: bool) -> None:
    """Refuse (RunInputError) a resume from `checkpoint` whose run config `saved` differs from
    this run's `now` in a key that changes what is learned; with `forced`, log them instead."""
    if saved is None:
        log.info("%s records no config (an older megarl wrote it): resumed without comparing configs", checkpoint)
        return
    changed = changed_keys(saved, now)
    if not changed:
        return
    absent = "(not set)"
    lines = "\n".join(f"  {k}: {saved.get(k, absent)!r} -> {now.get(k, absent)!r}" for k in changed)
    if forced:
        log.warning("resuming from %s with a changed config (trainer.resume_changed_config=true):\n%s",
                    checkpoint, lines)
        return
    raise RunInputError(
        f"the config changes what the run at {checkpoint} was learning:\n{lines}\nTo continue it, run with its "
        "config; to start a new run, set another trainer.output_dir (or trainer.resume=disable); to resume with "
        "these changes anyway, set trainer.resume_changed_config=true.")
