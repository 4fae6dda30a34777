"""What a run shows of itself besides its metrics: the progress bar's figures, the closing lines
on the console, a few samples of a step as a table, and the curves as a picture. Main entry
points: `tracking_line`, `step_line`, `summary`, `rollout_table`, `plot_curves`.
"""

from __future__ import annotations

import re
from pathlib import Path

from megarl.components import Components
from megarl.config import TrackingConfig
from megarl.experience import Sample
from megarl.tracking import server_uri, ui_command


PROGRESS_KEYS = {"reward": "train/reward_mean", "acc": "train/acc", "calls": "rollout/tool_calls_mean",
                 "val_acc": "val/acc"}
HISTORY_KEYS = ("train/reward_mean", "train/acc", "rollout/tool_calls_mean", "val/acc", "perf/trainer_offload_s",
                "perf/trainer_onload_s")


def summary(status: str, out: Path, history: list[dict], tracking: TrackingConfig) -> str:
    """The closing lines on the console: first and last val/acc, where everything is."""
    lines = [f"megarl: run {status.lower()}"]
    val = [(h["step"], h["val/acc"]) for h in history if "val/acc" in h]
    if val:
        lines.append(f"  val/acc: {val[0][1]:.3f} at step {val[0][0]} -> {val[-1][1]:.3f} at step {val[-1][0]}")
    slept = [(h["perf/trainer_offload_s"], h.get("perf/trainer_onload_s", 0.0)) for h in history
             if "perf/trainer_offload_s" in h]
    if slept:
        lines.append(f"  trainer asleep while the engines generated: {sum(s[0] for s in slept) / len(slept):.3f} s "
                     f"to sleep, {sum(s[1] for s in slept) / len(slept):.3f} s to wake, a step (mean of {len(slept)})")
    lines += [f"  checkpoints: {out / 'checkpoints'}", f"  HF export:   {out / 'hf'}"]
    if tracking.backend == "mlflow" and server_uri(tracking):
        lines.append(f"  MLflow:      {server_uri(tracking)}")
    elif tracking.backend == "mlflow":
        lines += [f"  MLflow:      {out / 'mlflow.db'} (artifacts in {out / 'mlartifacts'})",
                  f"  view the curves: {ui_command(out)}"]
    return "\n".join(lines)


def tracking_line(tracking: TrackingConfig, out: Path, run_id: str | None) -> str | None:
    """The run's first line on the console, once its MLflow run is open: where to watch it while
    it runs (None without MLflow)."""
    if tracking.backend != "mlflow":
        return None
    if server_uri(tracking):
        return f"megarl: MLflow run {run_id} on {server_uri(tracking)}: watch it there"
    return f"megarl: MLflow run {run_id} in {out / 'mlflow.db'}; watch it while it runs: {ui_command(out)}"


# the step's one line in the console log: (label, metric, format), shown when the step has it
STEP_LINE = (("reward", "train/reward_mean", ".3f"), ("acc", "train/acc", ".3f"),
             ("length", "train/response_length_mean", ".1f"), ("mismatch", "rollout/logprob_mismatch", ".4f"),
             ("tool calls", "rollout/tool_calls_mean", ".2f"), ("val/acc", "val/acc", ".3f"))


def step_line(done: int, total: int, metrics: dict) -> str:
    """A step in one line of the console log: its figures, then its seconds and each phase's
    (the `timing/*_s` metrics, in the order the step ran them)."""
    figures = ", ".join(f"{label} {metrics[key]:{spec}}" for label, key, spec in STEP_LINE if key in metrics)
    phases = ", ".join(f"{key[len('timing/'):-len('_s')]} {value:.1f}" for key, value in metrics.items()
                       if key.startswith("timing/") and key.endswith("_s"))
    seconds = f" | {metrics['perf/step_s']:.1f} s" if "perf/step_s" in metrics else ""
    return f"megarl step {done}/{total}: {figures}{seconds}{f': {phases}' if phases else ''}"


ROLLOUT_TABLE_ROWS = 16


def rollout_table(c: Components, samples: list[Sample], rows: int = ROLLOUT_TABLE_ROWS) -> dict[str, list]:
    """A few samples of the step as columns (prompt, response, score, acc, tool calls)."""
    picked = samples[:rows]
    return {"prompt": [c.tokenizer.decode(s.trajectory.prompt_ids) for s in picked],
            "response": [c.tokenizer.decode(s.trajectory.response_ids) for s in picked],
            "score": [s.score for s in picked], "acc": [bool(s.acc) for s in picked],
            "tool_calls": [sum(s.trajectory.tool_calls.values()) for s in picked]}


def plot_curves(history: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for key in HISTORY_KEYS:
        points = [(h["step"], h[key]) for h in history if key in h]
        if points:
            ax.plot(*zip(*points), marker="o", label=key)
    ax.set_xlabel("step")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def per_source_accuracy(samples: list[Sample]) -> dict[str, float]:
    """val/acc/<source> of each data_source, where the validation data has several (Search-R1's
    seven test sets): an overall accuracy hides one set falling while another rises."""
    by_source: dict[str, list[Sample]] = {}
    for s in samples:
        by_source.setdefault(s.record.data_source, []).append(s)
    if len(by_source) < 2:
        return {}
    return {f"val/acc/{metric_name(source)}": sum(s.acc for s in group) / len(group)
            for source, group in sorted(by_source.items())}


def metric_name(text: str) -> str:
    """`text` as a part of an MLflow metric key (letters, digits, _ - . and space; others become _)."""
    return re.sub(r"[^A-Za-z0-9_\-. ]", "_", text)[:200] or "_"


def tool_totals(samples: list[Sample]) -> dict[str, dict[str, float]]:
    """{"calls" | "failures" | "seconds": {tool: total over the samples}}."""
    totals: dict[str, dict[str, float]] = {"calls": {}, "failures": {}, "seconds": {}}
    for s in samples:
        t = s.trajectory
        for kind, counts in (("calls", t.tool_calls), ("failures", t.tool_failures), ("seconds", t.tool_seconds)):
            for name, value in counts.items():
                totals[kind][name] = totals[kind].get(name, 0) + value
    return totals


TALLIED = ("samples", "acc", "response_tokens", "searches", "valid_actions", "turns", "failed_searches")


def tally_batch(samples: list[Sample], tally: dict[str, float]) -> None:
    """Add a generation batch's counts to `tally` (the step's metrics over every sample generated)."""
    t = [s.trajectory for s in samples]
    for key, value in (("samples", len(t)), ("acc", sum(s.acc for s in samples)),
                       ("response_tokens", sum(len(x.response_ids) for x in t)),
                       ("searches", sum(x.num_searches for x in t)), ("valid_actions", sum(x.num_valid_actions for x in t)),
                       ("turns", sum(x.num_turns for x in t)), ("failed_searches", sum(x.num_failed_searches for x in t))):
        tally[key] += value
    for kind, by_tool in tool_totals(samples).items():
        for name, value in by_tool.items():
            tally[f"tool_{kind}/{name}"] = tally.get(f"tool_{kind}/{name}", 0.0) + value
