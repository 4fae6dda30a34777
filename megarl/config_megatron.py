"""Rules of the megatron backend's settings (megarl.config's value checks, kept apart to keep
that module short): layouts (expert parallelism included), FP8 and optimizer offload."""

from __future__ import annotations

from dataclasses import asdict

from megarl.config_loader import Problems


def check_megatron(cfg, problems: Problems) -> None:
    """The megatron backend's layout, FP8 and offload rules (`cfg`: a RunConfig)."""
    p, world = cfg.actor.parallel, cfg.train_world_size()
    if cfg.launcher() != "ray":
        problems.add("cluster.launcher", "inprocess cannot run the megatron backend (one process per rank)",
                     "use cluster.launcher=ray or auto")
    if world % p.model_parallel_size:
        problems.add("actor.parallel", f"TP x PP x CP = {p.model_parallel_size} does not divide the "
                     f"{world} train ranks (cluster.nnodes x cluster.gpus_per_node)",
                     "choose parallel sizes whose product divides the number of GPUs")
    expert_tp = p.expert_tensor_parallel_size or p.tensor_model_parallel_size
    experts = expert_tp * p.expert_model_parallel_size * p.pipeline_model_parallel_size
    if (p.expert_model_parallel_size > 1 or p.expert_tensor_parallel_size is not None) and world % experts:
        problems.add("actor.parallel", f"expert TP x EP x PP = {experts} does not divide the {world} train ranks",
                     "choose expert_model_parallel_size (and expert_tensor_parallel_size) to divide world / PP")
    dp = max(world // p.model_parallel_size, 1)
    for name, worker in (("actor", cfg.actor), ("critic", cfg.critic)):
        if name == "critic" and not cfg.critic.enable:
            continue
        _check_fp8_and_offload(name, worker, problems)
        mini = worker.ppo_mini_batch_size * cfg.rollout.n
        if mini % dp:
            problems.add(f"{name}.ppo_mini_batch_size", f"a mini batch of {mini} samples does not split over "
                         f"{dp} data-parallel ranks", "make ppo_mini_batch_size * rollout.n a multiple of DP")
    if cfg.critic.enable and cfg.critic.backend == "megatron":
        if asdict(cfg.critic.parallel) != asdict(p):
            problems.add("critic.parallel", "differs from actor.parallel (actor and critic share one layout)",
                         "give the critic the actor's parallel settings")


def _check_fp8_and_offload(name: str, worker, problems: Problems) -> None:
    """FP8 parameters and optimizer offload on the megatron backend (docs/megatron.md, On GPUs)."""
    fp8_params, distributed = bool(worker.fp8 and worker.fp8_param_gather), worker.parallel.use_distributed_optimizer
    use_distributed = f"set {name}.parallel.use_distributed_optimizer=true"
    if fp8_params and worker.fp8_recipe == "delayed":
        problems.add(f"{name}.fp8_param_gather", "with fp8_recipe=delayed casts the loaded weights to FP8 with the scale "
                     "delayed scaling starts from (1.0): small weights lose their precision or become 0 until the "
                     "first step, and in the frozen reference for good",
                     f"set {name}.fp8_recipe=tensorwise or blockwise (scales from the values), or "
                     f"{name}.fp8_param_gather=false")
    if fp8_params and not distributed:
        problems.add(f"{name}.fp8_param_gather", "needs megatron's distributed optimizer: no other optimizer casts its "
                     "updates back into FP8 parameters", use_distributed)
    if worker.optim.offload and not distributed:
        problems.add(f"{name}.optim.offload", "needs megatron's distributed optimizer: the hybrid device optimizer "
                     "runs on the precision-aware optimizer's path, which only the distributed optimizer has",
                     use_distributed)
    if worker.optim.offload and fp8_params:
        problems.add(f"{name}.optim.offload", "with fp8_param_gather: megatron hands its hybrid optimizer FP8 "
                     "parameter shards only under fp8_recipe=delayed, which megarl refuses there",
                     f"turn off {name}.optim.offload or {name}.fp8_param_gather")
