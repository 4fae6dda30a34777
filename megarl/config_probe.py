"""The settings of the weights probe and the step's gate (sync.probe): megarl.weights.probe
checks that the engines serve the trainer's weights after every event that loads or could
lose them; the gate keeps a step's samples out of training when their log-probs say the
engines generated with other weights. Main entry point: `ProbeConfig`."""

from __future__ import annotations

from dataclasses import dataclass

from megarl.config_loader import Problems, param


@dataclass
class ProbeConfig:
    enable: bool = param(
        True, "After every event that loads the engines' weights or could lose them (each sync, an engine restart "
        "and its reload, a resume of released memory, a resume from a checkpoint), compare each engine's log-probs "
        "of a few fixed token sequences with the trainer's. A mismatch reloads the weights once and probes again; "
        "a second one stops the run, naming the engine, the event and the figures.")
    sequences: int = param(4, "Probe sequences, the longest training prompts (their first sync.probe.tokens).", gt=0)
    tokens: int = param(64, "Tokens of each probe sequence at most.", gt=1)
    tolerance: float | None = param(
        None, "The bound: largest mean |engine - trainer| log-prob a probe token (nats) that counts as the same "
        "weights until the first probe has measured the noise floor, and the least tolerance after it; None = by "
        "model.dtype and device: 1e-4 float32 on the CPU, 1e-3 float32 on GPUs, 0.05 bf16 / fp16; 10x that for a "
        "mixture of experts (its routers pick other experts for some tokens); 0.1 more with actor.fp8 (the FP8 "
        "trainer's own gap to a bf16 one, megarl.weights.probe.FP8_GAP).", gt=0)
    noise_multiple: float = param(
        3.0, "k: the first probe (both sides holding the same weights) measures the noise floor, the largest mean "
        "|engine - trainer| log-prob a token of an engine; the tolerance in force from then on is the larger of "
        "sync.probe.tolerance and k x that floor (metrics rollout/probe_noise_floor, rollout/probe_tolerance). "
        "Later probes' noise varies with the weights: k leaves room for it.", ge=1)
    ceiling: float | None = param(
        None, "Largest noise floor (nats a token) the first probe may measure: above it the engines are taken to "
        "serve other weights (loaded once more, then the run stops), not calibrated into acceptance; None = 10x "
        "the bound, at most 2, never below the bound.", gt=0)
    gate: bool = param(
        True, "Each step, before training: where the trainer computes the old log-probs (algorithm.old_log_probs="
        "trainer), rollout/logprob_mismatch over the tokens sampled with the trainer's current weights above "
        "sync.probe.gate_bound means the engines generated with other weights: the samples are dropped, the "
        "engines' weights reloaded and the batch generated again; a second time the run stops by name.")
    gate_bound: float | None = param(
        None, "Largest rollout/logprob_mismatch (mean |engine - trainer| log-prob a sampled token, nats) the gate "
        "passes; None = 10 x the probe's tolerance.", gt=0)


def check_probe(cfg, problems: Problems) -> None:
    p = cfg.sync.probe
    if p.ceiling is not None and p.tolerance is not None and p.ceiling < p.tolerance:
        problems.add("sync.probe.ceiling", f"{p.ceiling:g} is below sync.probe.tolerance={p.tolerance:g}: the first "
                     "probe would refuse noise the bound accepts", "raise sync.probe.ceiling, or leave it unset")
    if cfg.sync.verify and not p.enable and cfg.rollout.engine == "sglang" and cfg.rollout.sglang.server == "sglang":
        problems.add("sync.verify", "on SGLang's own servers is the weights probe (they report no per-tensor "
                     "checksums of HF tensors), which sync.probe.enable=false turns off",
                     "set sync.probe.enable=true, or sync.verify=false")
