"""The `actor.lora` section of a run's configuration (megarl.config): low-rank adapters trained
on a frozen base model, named as PEFT names them (`r`, `lora_alpha`, `lora_dropout`,
`target_modules`), so that an adapter megarl exports loads with `peft` as it was trained.

With `r` > 0 the base model's weights take no gradient and have no optimizer state; each
targeted linear layer W gets A (r x in) and B (out x r), B starting at zero, and computes
W x + (lora_alpha / r) B A x. The KL reference is the same model with the adapters off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megarl.config_loader import Problems, param

# The linear layers of the Llama / Qwen family, by their HF names (PEFT's target_modules)
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
LINEAR_MODULES = ATTENTION_MODULES + MLP_MODULES
ALL_LINEAR = "all-linear"  # PEFT's shorthand: every linear layer but the LM head
# how megatron splits each module's layer at TP: column-parallel by output rows, row-parallel by input columns
SPLIT = {"q_proj": "column", "k_proj": "column", "v_proj": "column", "o_proj": "row", "gate_proj": "column",
         "up_proj": "column", "down_proj": "row"}


def module_shape(spec, name: str) -> tuple[int, int]:
    """(in, out) of HF linear module `name`, whole, for a model of `spec` (a megarl.models.ModelSpec)."""
    h, f = spec.hidden_size, spec.ffn_hidden_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, f),
            "up_proj": (h, f), "down_proj": (f, h)}[name]


@dataclass
class LoraConfig:
    r: int = param(0, "LoRA rank (PEFT's r): 0 = off, every weight trains; > 0 = the base model frozen (no "
                   "gradients, no optimizer state), adapters of this rank trained on target_modules.", ge=0)
    lora_alpha: float = param(16.0, "PEFT's lora_alpha: the adapters' update is scaled by lora_alpha / r.", gt=0.0)
    lora_dropout: float = param(0.0, "Dropout on an adapter's input in the updates (PEFT's lora_dropout); log-probs "
                                "are taken without it.", ge=0.0, lt=1.0)
    target_modules: list[str] = param(
        help="The linear layers given adapters, by their HF names (PEFT's target_modules): q_proj, k_proj, v_proj, "
        "o_proj, gate_proj, up_proj, down_proj, or [all-linear] for all of them.",
        factory=lambda: list(LINEAR_MODULES))
    sync: Literal["merged", "adapter"] = param(
        "merged", "What reaches the engines after an update: merged = the base plus (lora_alpha / r) B A, as whole "
        "HF tensors, through sync.transport as without LoRA (an engine needs no LoRA support); adapter = the "
        "adapters alone (sync.transport=lora): SGLang's own servers keep the base, start with LoRA on and serve "
        "each request with the newest adapter.")

    @property
    def enabled(self) -> bool:
        return self.r > 0

    @property
    def scaling(self) -> float:
        return self.lora_alpha / self.r

    def modules(self) -> tuple[str, ...]:
        """The targeted HF module names, in LINEAR_MODULES' order ([all-linear] expanded)."""
        wanted = set(LINEAR_MODULES) if ALL_LINEAR in self.target_modules else set(self.target_modules)
        return tuple(m for m in LINEAR_MODULES if m in wanted)


def peft_config(lora: LoraConfig):
    """PEFT's LoraConfig for `lora`'s settings (B initialised to zero: the adapted model starts as the
    base): what the torch backend adapts its model with and what an adapter directory's
    adapter_config.json says."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(r=lora.r, lora_alpha=lora.lora_alpha, lora_dropout=lora.lora_dropout,
                          target_modules=list(lora.modules()), bias="none", task_type="CAUSAL_LM")


def check_lora(cfg, problems: Problems) -> None:
    """Rules between actor.lora and the rest of the run (`cfg`: a RunConfig)."""
    if cfg.critic.enable and cfg.critic.lora.enabled:
        problems.add("critic.lora.r", "is set, but the critic trains every weight (LoRA is for the actor)",
                     "set critic.lora.r=0")
    lora = cfg.actor.lora
    if not lora.enabled:
        return
    if lora.sync == "adapter" and cfg.rollout.engine != "sglang":
        problems.add("actor.lora.sync", "adapter needs engine servers that serve LoRA (rollout.engine=sglang); the "
                     "embedded engine takes merged weights", "use actor.lora.sync=merged or rollout.engine=sglang")
    elif lora.sync == "adapter" and cfg.sync.transport not in ("auto", "lora"):
        problems.add("sync.transport", f"{cfg.sync.transport} moves whole weights, and actor.lora.sync=adapter "
                     "sends the adapters alone", "use sync.transport=auto (lora) or actor.lora.sync=merged")
    unknown = [m for m in lora.target_modules if m not in LINEAR_MODULES and m != ALL_LINEAR]
    if unknown:
        problems.add("actor.lora.target_modules", f"names {unknown}, which are not linear layers megarl adapts",
                     f"use some of {list(LINEAR_MODULES)}, or [{ALL_LINEAR}]")
    elif not lora.target_modules:
        problems.add("actor.lora.target_modules", "is empty, so no weight would train",
                     f"name the layers to adapt, e.g. [{ALL_LINEAR}], or set actor.lora.r=0")
