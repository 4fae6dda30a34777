"""`megarl plan --config RUN.yaml [key=value ...]`: the planner's settings from a run's own
config and overrides, so that a plan and the run it is for agree (the recipes plan this way).

From the config: the model (model.path, when it is a directory with a config.json), the nodes
and GPUs per node (cluster.nnodes, cluster.gpus_per_node), the longest prompt and response
(data.max_prompt_length, rollout.max_response_length), a micro-batch's tokens
(actor.max_tokens_per_gpu), the sequences generated a step ((data.gen_batch_size or
data.train_batch_size) x rollout.n), a reference model (a KL loss or KL in the reward), a critic
(critic.enable), the actor's LoRA rank and layers (actor.lora), FP8 (actor.fp8), whether the trainer sleeps while colocated engines generate, the engines'
own GPUs when rollout.mode=disaggregated with the actor's layout given, and how often it saves
(trainer.save_freq: weighed against --job-time). A flag given on the
command line wins over the config. Main entry point: `settle`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megarl.config_lora import LINEAR_MODULES

# the planner's settings without a config (and what a flag left out means then)
DEFAULTS = {"nodes": None, "gpus_per_node": 8, "max_prompt_length": 2048, "max_response_length": 20480,
            "max_tokens_per_gpu": None, "rollout_batch": 512 * 16, "rollout_gpus": 0, "lora": 0,
            "lora_modules": LINEAR_MODULES, "fp8": False, "save_freq": None}


def from_config(path: str, overrides: list[str]) -> dict:
    """The planner's settings a run's config and overrides give (argparse names)."""
    from megarl.config import load_config

    cfg = load_config(path, overrides, consistent=False)  # the layout is the plan's to give; the run checks all
    d, r, c = cfg.data, cfg.rollout, cfg.cluster
    found = {"nodes": c.nnodes, "max_prompt_length": d.max_prompt_length,
             "max_response_length": r.max_response_length, "max_tokens_per_gpu": cfg.actor.max_tokens_per_gpu,
             "rollout_batch": (d.gen_batch_size or d.train_batch_size) * r.n,
             "kl": cfg.algorithm.use_kl_loss or cfg.algorithm.use_kl_in_reward, "critic": cfg.critic.enable,
             "lora": cfg.actor.lora.r, "lora_modules": cfg.actor.lora.modules(), "fp8": cfg.actor.fp8 is not None,
             "save_freq": cfg.trainer.save_freq}
    if c.gpus_per_node:
        found["gpus_per_node"] = c.gpus_per_node
        found["no_sleep"] = r.mode == "colocated" and cfg.trainer.sleep_during_generation is False
        if r.mode == "disaggregated" and cfg.actor.parallel.data_parallel_size is not None:
            found["rollout_gpus"] = c.nnodes * c.gpus_per_node - cfg.train_world_size()
    if (Path(cfg.model.path) / "config.json").is_file():
        found["model"] = cfg.model.path
    return found


def settle(args: argparse.Namespace) -> None:
    """Fill the settings left out on the command line (None, or False for a switch) from
    --config and its overrides, then from DEFAULTS. ValueError for overrides without a config,
    and for a model or node count that neither gives."""
    if args.settings and not args.config:
        raise ValueError(f"{args.settings[0]!r}: key=value overrides need --config RUN.yaml")
    found = from_config(args.config, args.settings) if args.config else {}
    for name, value in {**DEFAULTS, **found}.items():
        if getattr(args, name, None) in (None, False):
            setattr(args, name, value)
    if args.model is None:
        raise ValueError("which model? Give --model (a model directory, an HF config.json or a known "
                         "name), or --config with a model.path that holds a config.json")
    if args.nodes is None:
        raise ValueError("how many nodes? Give --nodes, or --config with cluster.nnodes")


def parse_job_time(text: str) -> float:
    """Seconds of a slurm time limit as `sbatch --time` takes it: minutes, minutes:seconds,
    hours:minutes:seconds, days-hours, days-hours:minutes or days-hours:minutes:seconds.
    ValueError naming the forms."""
    days, dash, clock = text.strip().rpartition("-") if "-" in text else ("0", "", text.strip())
    try:
        parts = [int(x) for x in clock.split(":")]
        d = int(days)
    except ValueError:
        parts, d = [], -1
    if d < 0 or not 1 <= len(parts) <= 3 or any(x < 0 for x in parts):
        raise ValueError(f"--job-time {text!r}: give slurm's time limit, e.g. 24:00:00, 1-00:00:00 or 90 (minutes)")
    if dash:  # days-hours[:minutes[:seconds]]
        h, m, s = (parts + [0, 0])[:3]
    elif len(parts) == 3:
        h, m, s = parts
    else:  # minutes[:seconds]
        h, (m, s) = 0, (parts + [0])[:2]
    return float(((d * 24 + h) * 60 + m) * 60 + s)
