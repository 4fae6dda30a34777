"""The megatron backend's optimizer state in checkpoints (megarl.backends.megatron.worker's
save_checkpoint and load_checkpoint): megatron's sharded state dict of a trained part (its model
chunks and optimizer, `part` a worker `_Part`), laid out so that it reshards onto any layout, and
its loading where megatron 0.16 needs help (torch Adam on the CPU, a chain of optimizers that
differs from the saved one). Main entry points: `sharded_state`, `load_optimizer_state`.
"""

from __future__ import annotations

import torch


def model_key(part, i: int) -> str:
    return "model" if len(part.chunks) == 1 else f"model{i}"


# the optimizer's state laid out per parameter in its full shape (gathered on DP rank 0 while
# saving), so a checkpoint reshards onto any TP/PP/DP layout; and under the same keys whether the
# optimizer is one or, with expert parallelism, megatron's chain of two (dense and expert
# parameters), so that it also reshards onto another EP size
OPTIMIZER_SHARDING = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}


def sharded_state(part, loading: bool, adapters_only: bool = False) -> dict:
    """megatron's sharded state dict of the part: its chunks and the optimizer; `adapters_only`:
    of the chunks, the LoRA adapters alone (megarl.backends.megatron.lora: the base is frozen)."""
    _materialise_optimizer_state(part.optimizer)  # also a never-stepped optimizer saves and loads
    state = {model_key(part, i): chunk.sharded_state_dict() for i, chunk in enumerate(part.chunks)}
    if adapters_only:
        state = {key: {k: v for k, v in chunk.items() if ".lora." in k} for key, chunk in state.items()}
    model_state = state["model"] if len(part.chunks) == 1 else state
    state["optimizer"] = part.optimizer.sharded_state_dict(model_state, is_loading=loading,
                                                           metadata=OPTIMIZER_SHARDING)
    return state


def _materialise_optimizer_state(optimizer) -> None:
    """Give a fresh torch Adam (megatron without Apex or Transformer Engine, as on CPU) its
    state tensors and step counts (zeros: the same as no state): megatron reads the step
    from the state when saving it or loading into it, which fails on an optimizer that
    never stepped."""
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        if inner.state and all("step" in s for s in inner.state.values()):
            continue
        opt.init_state_fn(inner, opt.config)
        for state in inner.state.values():
            state.setdefault("step", torch.tensor(0.0))


def load_optimizer_state(optimizer, state: dict) -> None:
    """optimizer.load_state_dict(state), also for torch Adam (no Apex or Transformer Engine,
    as on CPU), where megatron (0.16) loads one step tensor into every parameter's state
    (torch Adam increments each in place, so a shared one would count every parameter: each
    gets its own copy) and then copies the checkpoint's tensors over every state entry,
    although the checkpoint has no per-parameter step (the step is kept as loaded)."""
    from megatron.core.optimizer import distrib_optimizer

    chain = [o for o in getattr(optimizer, "chained_optimizers", [optimizer])
             if isinstance(o, distrib_optimizer.DistributedOptimizer)]
    torch_adam = not distrib_optimizer.HAVE_APEX_OR_TE
    for opt in chain if torch_adam else []:
        def keep_step(model_param, tensors, opt=opt, original=opt._set_main_param_and_optimizer_states):
            group, order = opt.model_param_group_index_map[model_param]
            own = opt.optimizer.state[opt.optimizer.param_groups[group]["params"][order]]
            original(model_param, {**tensors, "step": own["step"]} if "step" in own else tensors)

        opt._set_main_param_and_optimizer_states = keep_step
    optimizer.load_state_dict(_fit_chain(optimizer, state))
    for opt in chain if torch_adam else []:
        del opt._set_main_param_and_optimizer_states  # back to the class's method
        for param_state in opt.optimizer.state.values():
            if "step" in param_state:
                param_state["step"] = param_state["step"].clone()


def _fit_chain(optimizer, loaded: dict) -> dict:
    """A loaded optimizer state for `optimizer`, also when it was saved by a differently chained
    one: with expert parallelism megatron chains two optimizers (dense and expert parameters,
    entries 0 and 1 of the state), without it there is one. The tensors are where the current
    optimizer asked for them (the keys are the same: OPTIMIZER_SHARDING); the rest (parameter
    groups, settings megarl sets every step anyway) is the current optimizers' own, with the
    saved step count (megatron keeps one step for every group)."""
    chain = getattr(optimizer, "chained_optimizers", [optimizer])
    # the saved common parts: one per chained optimizer (entries 0, 1, ...), or one at the top
    saved_chain = [loaded[k] for k in sorted(k for k in loaded if isinstance(k, int))
                   if isinstance(loaded[k], dict) and "optimizer" in loaded[k]]
    if (len(chain) == 1 and not saved_chain) or (len(chain) > 1 and len(saved_chain) == len(chain)):
        return loaded  # saved as it is now
    saved = saved_chain or [loaded]
    if not all(isinstance(part.get("optimizer"), dict) and "param_groups" in part["optimizer"] for part in saved):
        raise ValueError("this checkpoint was saved with another expert-parallel size; loading it needs megatron's "
                         "distributed optimizer (actor.parallel.use_distributed_optimizer=true) on both sides")
    steps = {g["step"] for part in saved for g in part["optimizer"]["param_groups"] if g.get("step") is not None}
    if len(steps) > 1:
        raise ValueError(f"the checkpoint's optimizers are at different steps {sorted(steps)}")

    def common(opt) -> dict:
        own = opt.state_dict()
        for group in own["optimizer"]["param_groups"]:
            if steps:
                group["step"] = next(iter(steps))
        own["param_state_sharding_type"] = saved[0]["param_state_sharding_type"]
        return own

    if len(chain) == 1:
        return {**common(chain[0]), "param_state": loaded["param_state"]}
    return {i: {**common(opt), "param_state": loaded[i]["param_state"]} for i, opt in enumerate(chain)}
