"""megarl beside Hugging Face TRL's GRPOTrainer (trl 1.16.0) on the same DAPO work: seconds per step,
where each spends them, and the validation accuracy each reaches.

    make bench-trl-env                                   # once: .venv-trl, TRL's own venv
    python tools/bench/vs_trl.py [--seeds 5] [--steps 20]
    python tools/bench/vs_trl.py --side megarl --switch step-tokens --label step_tokens   # one switch

--side runs one side only (the other side's figures can be read back with --compare, a results file
of an earlier run); --override changes a setting for both sides (the learning rate, say);
--megarl-override adds key=value overrides to megarl's run only (TRL reads the
overrides both share), to switch one megarl setting at a time; --switch NAME runs megarl through
tools/bench/megarl_switched.py with one of the settings megarl has no key for switched to TRL's.
Each invocation writes its per-seed figures to OUT/results/LABEL.json (--label; default the sides
and the date) and keeps its runs' directories under OUT/runs/LABEL/.

The work is `make quickstart-math`'s: the warmed-up tiny model and arithmetic problems of
`python -m megarl.quickstart prepare-math` (built once, under --out), examples/quickstart/dapo_math_tiny.yaml
with dynamic sampling and dual clip off (TRL has neither). megarl runs in its default runtime
(`megarl train`, the Ray launcher); TRL runs in .venv-trl (tools/bench/trl_side.py), reading the same
config and calling megarl's reward, overlong shaping, optimizer and schedule. Both train on the same
prompts in the same order (megarl's PromptOrder for the seed; checked against what each side logged),
128 samples and two optimizer steps per step, and save a checkpoint every --save-every steps.

Seconds per step: the steady-state mean (steps 2..N, leaving out step 1 and the steps that follow a
checkpoint save) from each side's own per-step clock, and the whole run's wall time from the launch of
its process to its exit, with the start-up (launch to the start of step 1: imports, Ray, model load)
and the end (last step to exit: final save, export, shutdown) shown apart. The sides alternate which
runs first from seed to seed; the ratio printed last (TRL s/step over megarl's: > 1 means megarl is
faster) is the median over seeds with its range, as tools/bench/protocol.py prints it.

Validation: one evaluator for both sides (`evaluate`): each saved checkpoint as an HF model, sampled
with transformers' generate as the config's rollout.val asks (avg@n at its temperature and top_p, the
same sampling seed for every model), scored by megarl's reward's accuracy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import time
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRL_PYTHON = ROOT / ".venv-trl" / "bin" / "python"  # make bench-trl-env (TRL_VENV=...: --trl-python)
TRL_PACKAGES = ("torch", "transformers", "trl", "accelerate", "datasets", "numpy", "safetensors")
SWITCHES = ("adv-eps", "step-tokens", "generate", "trl-draws", "none")  # tools/bench/megarl_switched.py's
EVAL_SEED = 7_777_777  # one sampling seed for every evaluated model: differences come from the weights
NOT_EQUAL = """settings that could not be made equal:
  - generation: megarl's embedded engine vs TRL's transformers generate (the engines are what is compared;
    --switch generate samples megarl's rollouts with generate)
  - phases: megarl's rollout is generation and reward together (it does not time them apart)
  - megarl validates nothing in the run either (test_freq=0); both are evaluated afterwards by one evaluator
  - megarl checkpoints hold weights, optimizer and data order; TRL's weights, optimizer, scheduler, RNG
  - megarl logs every step's metrics to its MLflow store (its default); TRL logs to the console only
  - advantage: megarl (r - mean) / (std + 1e-6), TRL (r - mean) / (std + 1e-4) (both Bessel-corrected std;
    --switch adv-eps gives megarl TRL's)
  - token-mean: megarl divides each mini-batch's loss by its own loss tokens, TRL 'dapo' by the step's loss
    tokens / mini-batches (its generation batch's mean); equal when the mini-batches hold as many tokens
    (--switch step-tokens gives megarl TRL's)
  - the random draws: each side its own (--switch trl-draws has megarl take TRL's, and run TRL's run)
  - dual clip: megarl's is set out of reach (algorithm.clip_ratio_c=1e9); TRL has none
  - the megarl run's own data order: TRL is fed megarl's order (shuffle_dataset=False), not its own
  - old log-probs: megarl takes the engine's (--old-log-probs engine, its default here: exact in float32 on
    the CPU, docs/training.md); TRL computes them with a forward pass of the generation batch, as megarl does
    with --old-log-probs trainer"""


@dataclass
class SideRun:
    """One side's run of one seed: per-step seconds (whole steps and phases), times, checkpoints."""
    step_s: list[float]
    phases: dict[str, list[float]]
    launch: float  # time.time() when its process was started
    loop_start: float  # ... when its step 1 began
    last_step_end: float
    exit: float
    checkpoints: dict[int, Path] = field(default_factory=dict)  # step -> HF model directory
    val: dict[int, float] = field(default_factory=dict)
    # per step, what each side logged of its samples: the mean reward (overlong shaping included) and length
    reward: list[float] = field(default_factory=list)
    length: list[float] = field(default_factory=list)


def side_record(r: SideRun, keep: list[int]) -> dict:
    """What the results file keeps of one side's run of one seed."""
    return {"s_per_step_steady": steady_mean(r.step_s, keep), "wall_s": r.exit - r.launch,
            "startup_s": r.loop_start - r.launch, "end_s": r.exit - r.last_step_end, "step_s": r.step_s,
            "phases_steady": {p: steady_mean(v, keep) for p, v in r.phases.items()},
            "val": {str(s): a for s, a in r.val.items()}, "reward": r.reward, "length": r.length}


def steps_alike(a: dict, b: dict, reward_tol: float = 5e-4, length_tol: float = 5e-3) -> int:
    """How many first steps two results records logged the same mean reward and length (to the digits TRL
    prints): two runs that took the same samples."""
    steps = 0
    for ra, rb, la, lb in zip(a.get("reward", []), b.get("reward", []), a.get("length", []), b.get("length", [])):
        if abs(ra - rb) > reward_tol or abs(la - lb) > length_tol:
            break
        steps += 1
    return steps


def collapsed(val: dict[int, float]) -> bool:
    """The run's final validation accuracy is under half its start (step 0)."""
    return val[max(val)] < 0.5 * val[0]


def step_intervals(begin: float, ends: list[float]) -> list[float]:
    """Seconds of each step from the time training began and the end time of every step."""
    times = [begin, *ends]
    return [b - a for a, b in zip(times, times[1:])]


def steady_steps(steps: int, save_every: int) -> list[int]:
    """The 1-based steps whose times are averaged: not step 1 (warm-up, first allocations) and not a
    step that follows a checkpoint save (the save falls into it on both sides)."""
    return [s for s in range(2, steps + 1) if not (save_every and (s - 1) % save_every == 0)]


def steady_mean(values: list[float], steps: list[int]) -> float:
    return statistics.mean(values[s - 1] for s in steps)


def run_overrides(world: Path, out: Path, seed: int, steps: int, save_every: int,
                  old_log_probs: str = "engine") -> list[str]:
    """The megarl run's overrides of the quickstart config (the TRL side reads the same)."""
    return [f"model.path={world / 'model'}", f"data.train_files=[{world / 'data' / 'train.parquet'}]",
            f"data.val_files=[{world / 'data' / 'val.parquet'}]", f"trainer.output_dir={out}",
            f"trainer.seed={seed}", f"trainer.total_training_steps={steps}", f"trainer.save_freq={save_every}",
            f"trainer.max_ckpt_to_keep={steps // save_every + 1}", "trainer.resume=disable",
            "trainer.test_freq=0", "trainer.val_before_train=false",
            "algorithm.dynamic_sampling.enable=false", "algorithm.clip_ratio_c=1e9",
            f"algorithm.old_log_probs={old_log_probs}"]


def prompt_order(cfg, num_prompts: int, steps: int) -> list[list[int]]:
    """The prompt indices megarl trains on at each step (its PromptOrder, seeded by trainer.seed)."""
    from megarl.data.prompts import PromptOrder

    order = PromptOrder(num_prompts, cfg.trainer.seed, cfg.data.shuffle)
    return [order.take(cfg.data.train_batch_size) for _ in range(steps)]


def run(cmd: list[str], log: Path, timeout_s: float) -> tuple[float, float]:
    """Run cmd with its output in `log`; (launch, exit) as time.time(). A failure shows the log's tail.
    Python may keep the bytecode it compiles (PYTHONDONTWRITEBYTECODE is dropped, as make does):
    `make setup` installs without compiling ahead, and with that variable set every process of a
    run compiles torch and the rest again; megarl's start-up (its Ray workers each import torch)
    measured 86 s that way against 31 s."""
    launch = time.time()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    with open(log, "w") as fh:
        try:
            done = subprocess.run(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout_s, env=env)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"{cmd[:4]}... ran past {timeout_s:.0f} s; its log: {log}") from None
    if done.returncode:
        raise SystemExit(f"{cmd[:4]}... failed ({done.returncode}):\n{log.read_text()[-3000:]}")
    return launch, time.time()


def mlflow_metrics(db: Path) -> dict[str, dict[int, tuple[float, float]]]:
    """{key: {step: (value, time.time() it was logged)}} from a run's local MLflow store (the last
    value of a step when it was logged more than once)."""
    with closing(sqlite3.connect(db)) as con:
        rows = con.execute("SELECT key, step, value, timestamp FROM metrics ORDER BY timestamp").fetchall()
    out: dict[str, dict[int, tuple[float, float]]] = {}
    for key, step, value, ms in rows:
        out.setdefault(key, {})[step] = (value, ms / 1000)
    return out


MEGARL_PHASES = ("rollout", "old_log_prob", "update_actor", "sync_weights")


def fresh(out: Path) -> Path:
    """An empty run directory: a run left there would be resumed, or its MLflow runs read as this one's."""
    shutil.rmtree(out, ignore_errors=True)
    out.with_suffix(".log").unlink(missing_ok=True)
    return out


def megarl_step_to_hf(step_dir: Path, base_model: Path, out: Path) -> Path:
    """A megarl (torch backend) checkpoint's actor as an HF model directory. Not megarl.export's
    export_checkpoint: it rejects this model's checkpoints (tied embeddings, which the checkpoint holds
    once, as lm_head.weight, and which it loads with load_state_dict); safetensors' load_model ties them."""
    import torch
    from safetensors.torch import load_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    load_model(model, step_dir / "actor.safetensors")  # strict: every weight of the model, nothing else
    model.save_pretrained(out)
    eval_tokenizer(base_model).save_pretrained(out)
    return out


def run_megarl(config: str, overrides: list[str], out: Path, steps: int, groups: int, base_model: Path,
               timeout_s: float, switch: str | None = None) -> SideRun:
    """`megarl train`, or with `switch` tools/bench/megarl_switched.py's run with that setting switched."""
    fresh(out)
    start = ["-m", "megarl.cli", "train"] if switch is None else [str(ROOT / "tools" / "bench" / "megarl_switched.py"),
                                                                     switch]
    launch, end = run([sys.executable, *start, config, *overrides], out.with_suffix(".log"), timeout_s)
    m = mlflow_metrics(out / "mlflow.db")
    step_s = [m["perf/step_s"][s][0] for s in range(1, steps + 1)]
    if any(m["train/kept_groups"][s][0] != groups or m["train/gen_batches"][s][0] != 1 for s in range(1, steps + 1)):
        raise AssertionError(f"megarl trained on other than {groups} prompt groups of one generation batch a step")
    phases = {p: [m.get(f"timing/{p}_s", {}).get(s, (0.0,))[0] for s in range(1, steps + 1)] for p in MEGARL_PHASES}
    phases["other"] = [t - sum(phases[p][i] for p in MEGARL_PHASES) for i, t in enumerate(step_s)]
    ckpts = {}
    for step_dir in sorted((out / "checkpoints").glob("step_*")):
        step = int(step_dir.name.split("_")[1])
        ckpts[step] = megarl_step_to_hf(step_dir, base_model, out / "hf_steps" / f"step_{step}")
    return SideRun(step_s, phases, launch, m["perf/step_s"][1][1] - step_s[0], m["perf/step_s"][steps][1], end,
                   ckpts, reward=[m["train/reward_mean"][s][0] for s in range(1, steps + 1)],
                   length=[m["train/response_length_mean"][s][0] for s in range(1, steps + 1)])


def megarl_trained_prompts(out: Path) -> dict[int, list[str]]:
    """{step: prompt texts} from the rollout tables megarl logged (tracking.log_rollouts_freq)."""
    tables = {}
    for path in out.glob("mlartifacts/**/rollouts/step_*.json"):
        table = json.loads(path.read_text())
        column = table["columns"].index("prompt")
        tables[int(path.stem.split("_")[1])] = [row[column] for row in table["data"]]
    return tables


def run_trl(python: Path, config: str, overrides: list[str], rows: list[dict], out: Path, seed: int, steps: int,
            save_every: int, timeout_s: float) -> tuple[SideRun, dict]:
    fresh(out).mkdir(parents=True)
    prompts = out / "prompts.json"
    prompts.write_text(json.dumps(rows))
    launch, end = run([str(python), str(ROOT / "tools" / "bench" / "trl_side.py"), "--config", config,
                       "--prompts", str(prompts), "--out", str(out), "--seed", str(seed), "--steps", str(steps),
                       "--save-every", str(save_every), *overrides], out.with_suffix(".log"), timeout_s)
    side = json.loads((out / "trl_side.json").read_text())
    step_s = step_intervals(side["train_begin"], side["step_ends"])
    names = ("generate", "reward", "score", "train")
    phases = {p: [s.get(p, 0.0) for s in side["phase_s"]] for p in names}
    phases["other"] = [t - sum(phases[p][i] for p in names) for i, t in enumerate(step_s)]
    ckpts = {int(k): Path(v) for k, v in side["checkpoints"].items()}
    logged = [x for x in side["log_history"] if "reward" in x]  # one entry a generation batch
    return SideRun(step_s, phases, launch, side["train_begin"], side["step_ends"][-1], end, ckpts,
                   reward=[x["reward"] for x in logged], length=[x["completions/mean_length"] for x in logged]), side


def evaluate(model_dir: Path, cfg, val_records, n: int) -> float:
    """avg@n accuracy: n samples per validation prompt at rollout.val's temperature and top_p, at most
    rollout.max_response_length new tokens, scored by the run's reward (its acc)."""
    import torch
    from transformers import AutoModelForCausalLM

    from megarl.reward.scoring import RewardRequest, score_one

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, cfg.model.dtype)).eval()
    tok = eval_tokenizer(model_dir)
    prompts = [r.prompt_ids for r in val_records for _ in range(n)]
    width = max(map(len, prompts))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    v = cfg.rollout.val
    torch.manual_seed(EVAL_SEED)
    with torch.no_grad():
        gen = model.generate(input_ids=ids, attention_mask=mask, do_sample=v.temperature > 0, temperature=v.temperature
                             or None, top_p=v.top_p, top_k=max(v.top_k, 0), max_new_tokens=cfg.rollout.max_response_length,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    correct = 0
    for i, row in enumerate(gen[:, width:].tolist()):
        response = row[:row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row
        record = val_records[i // n]
        correct += score_one(cfg.reward, RewardRequest(record.data_source, tok.decode(response, skip_special_tokens=True),
                                                       record.ground_truth, record.extra_info)).acc
    return correct / len(prompts)


def eval_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def trl_versions(python: Path) -> str:
    code = f"from megarl.versions import installed_versions; print(installed_versions({TRL_PACKAGES!r}))"
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    return done.stdout.strip() or f"(could not read: {done.stderr.strip()[-300:]})"


def fmt(values: list[float]) -> str:
    return " ".join(f"{v:.3f}" for v in values)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=5, help="runs of each side (at least 5 for the target)")
    p.add_argument("--first-seed", type=int, default=0, help="the seeds are first-seed .. first-seed + seeds - 1")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-every", type=int, default=5, help="checkpoint (and evaluate) every k steps")
    p.add_argument("--config", default="examples/quickstart/dapo_math_tiny.yaml")
    p.add_argument("--out", default="outputs/bench_vs_trl", help="world/ and one directory per run go here")
    p.add_argument("--val-n", type=int, default=None, help="samples per validation prompt; default rollout.val.n")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one run may take")
    p.add_argument("--trl-python", type=Path, default=TRL_PYTHON, help="the Python of TRL's venv")
    p.add_argument("--old-log-probs", choices=("engine", "trainer"), default="engine",
                   help="megarl's algorithm.old_log_probs (engine: the engine's log-probs, exact in float32 on the CPU)")
    p.add_argument("--side", choices=("both", "megarl", "trl"), default="both", help="which side(s) to run")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="an override of the config for both sides (repeatable), e.g. actor.optim.lr=3e-4")
    p.add_argument("--megarl-override", action="append", default=[], metavar="KEY=VALUE",
                   help="an override of megarl's run only (repeatable): one setting switched, e.g. to TRL's")
    p.add_argument("--switch", choices=SWITCHES, default=None,
                   help="megarl's run through tools/bench/megarl_switched.py with this setting switched to TRL's "
                        "(in-process launcher; none: the same launcher, nothing switched)")
    p.add_argument("--label", default=None, help="name of the results file, OUT/results/LABEL.json")
    p.add_argument("--compare", type=Path, default=None,
                   help="a results file of an earlier run whose side(s) this run did not run, compared with")
    args = p.parse_args(argv)
    if args.side != "megarl" and not args.trl_python.exists():
        raise SystemExit(f"{args.trl_python} is missing: build TRL's venv with `make bench-trl-env`")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the evaluator's model loads, not figures

    from megarl.config import load_config
    from megarl.data.prompts import load_prompts
    from megarl.quickstart.inputs import prepare_math
    from megarl.versions import installed_versions

    versions = {"megarl": installed_versions()}
    print(f"megarl venv: {versions['megarl']}")
    if args.side != "megarl":
        versions["trl"] = trl_versions(args.trl_python)
        print(f"TRL venv:    {versions['trl']}", flush=True)
    out = (ROOT / args.out).resolve()
    world = prepare_math(out / "world")
    base = load_config(str(ROOT / args.config), run_overrides(world, out, 0, args.steps, args.save_every,
                                                                    args.old_log_probs) + args.override
                       + args.megarl_override)
    tok = eval_tokenizer(world / "model")
    d = base.data
    train, _ = load_prompts(d.train_files, tok, prompt_key=d.prompt_key, max_prompt_length=d.max_prompt_length,
                            apply_chat_template=d.apply_chat_template)
    val, _ = load_prompts(d.val_files, tok, prompt_key=d.prompt_key, max_prompt_length=d.max_prompt_length,
                          apply_chat_template=d.apply_chat_template)
    n_val = args.val_n or base.rollout.val.n
    samples = d.train_batch_size * base.rollout.n
    print(f"work: {d.train_batch_size} prompts x G={base.rollout.n} = {samples} samples a step in "
          f"{d.train_batch_size // base.actor.ppo_mini_batch_size} optimizer steps, {args.steps} steps, "
          f"{base.rollout.max_response_length} new tokens at most; val: avg@{n_val} of {len(val)} prompts at "
          f"T={base.rollout.val.temperature}, top_p={base.rollout.val.top_p} (evaluator seed {EVAL_SEED})")
    if args.override:
        print(f"both sides: {' '.join(args.override)}")
    if args.megarl_override or args.switch:
        print(f"megarl's run only: {' '.join(args.megarl_override)}"
              + (f" switched to TRL's: {args.switch} (tools/bench/megarl_switched.py)" if args.switch else ""))
    print(NOT_EQUAL, flush=True)
    step0 = evaluate(world / "model", base, val, n_val)
    keep = steady_steps(args.steps, args.save_every)
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    label = args.label or f"{args.side}_{time.strftime('%Y%m%d_%H%M%S')}"
    runs_dir = out / "runs" / label  # each run's directory (logs, MLflow store, checkpoints) kept per label
    runs_dir.mkdir(parents=True, exist_ok=True)
    ran = ("megarl", "trl") if args.side == "both" else (args.side,)
    results: dict[str, dict[int, SideRun]] = {side: {} for side in ran}
    for seed in seeds:
        overrides = run_overrides(world, runs_dir / f"megarl_seed{seed}", seed, args.steps, args.save_every,
                                  args.old_log_probs) + args.override  # TRL's too
        cfg = load_config(str(ROOT / args.config), overrides)
        order = prompt_order(cfg, len(train), args.steps)
        rows = [{"prompt": tok.decode(train[i].prompt_ids), "data_source": train[i].data_source,
                 "ground_truth": train[i].ground_truth, "extra_info": train[i].extra_info}
                for step in order for i in step]
        sides = ["megarl", "trl"] if seed % 2 == 0 else ["trl", "megarl"]
        for side in (s for s in sides if s in ran):
            print(f"seed {seed}: running {side}...", flush=True)
            run_dir = runs_dir / f"{side}_seed{seed}"
            if side == "megarl":
                r = run_megarl(str(ROOT / args.config), overrides + args.megarl_override, run_dir, args.steps,
                               d.train_batch_size, world / "model", args.timeout, args.switch)
                logged = megarl_trained_prompts(run_dir)
                for step, texts in logged.items():  # the table's first rows: the step's first prompts, n each
                    want = [tok.decode(train[i].prompt_ids) for i in order[step - 1] for _ in range(cfg.rollout.n)]
                    assert texts == want[:len(texts)], f"megarl trained step {step} on other prompts than expected"
                checked = f"megarl's logged prompts of steps {sorted(logged)} match the order"
            else:
                r, side_json = run_trl(args.trl_python, str(ROOT / args.config), overrides, rows, run_dir, seed,
                                       args.steps, args.save_every, args.timeout)
                got = side_json["prompts"]
                assert got == [[train[i].prompt_ids for i in step] for step in order], \
                    "TRL generated from other prompts (or token ids) than megarl's order"
                assert side_json["samples_per_step"] == samples, side_json["samples_per_step"]
                assert side_json["max_new_tokens"] == cfg.rollout.max_response_length
                checked = f"TRL's prompt token ids of all {len(got)} steps match"
            assert len(r.step_s) == args.steps, f"{side} ran {len(r.step_s)} steps, not {args.steps}"
            r.val = {0: step0} | {s: evaluate(path, cfg, val, n_val) for s, path in sorted(r.checkpoints.items())}
            results[side][seed] = r
            print(f"seed {seed} {side}: {steady_mean(r.step_s, keep):.3f} s/step steady, wall {r.exit - r.launch:.1f} s "
                  f"(start-up {r.loop_start - r.launch:.1f} s, end {r.exit - r.last_step_end:.1f} s); {checked}",
                  flush=True)
            print(f"  s/step: {fmt(r.step_s)}")
            print("  val:    " + ", ".join(f"{s}: {a:.3f}" for s, a in r.val.items()), flush=True)
    record = {"label": label, "date": time.strftime("%Y-%m-%d %H:%M"), "argv": sys.argv[1:] if argv is None else argv,
              "versions": versions, "old_log_probs": args.old_log_probs, "override": args.override,
              "megarl_override": args.megarl_override, "switch": args.switch,
              "steps": args.steps, "save_every": args.save_every, "val_n": n_val,
              "sides": {side: {str(seed): side_record(r, keep) for seed, r in runs.items()}
                        for side, runs in results.items()}}
    path = out / "results" / f"{label}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))
    print(f"\nper-seed results: {path}")
    report(results, keep, args.compare)


def read_results(path: Path) -> dict[str, dict[int, dict]]:
    """{side: {seed: record}} of a results file."""
    sides = json.loads(path.read_text())["sides"]
    return {side: {int(seed): rec for seed, rec in runs.items()} for side, runs in sides.items()}


def report(results: dict[str, dict[int, SideRun]], keep: list[int], compare: Path | None = None) -> None:
    print(f"\n=== summary; steady state = steps {keep} ===")
    for side, runs in results.items():
        print(f"{side}:")
        print("  s/step (steady) per seed: " + fmt([steady_mean(r.step_s, keep) for r in runs.values()]))
        print("  wall s per seed:          " + " ".join(f"{r.exit - r.launch:.1f}" for r in runs.values()))
        print("  start-up s per seed:      " + " ".join(f"{r.loop_start - r.launch:.1f}" for r in runs.values())
              + ("  (imports, Ray, actors, model load)" if side == "megarl" else "  (imports, model load)"))
        print("  end s per seed:           " + " ".join(f"{r.exit - r.last_step_end:.1f}" for r in runs.values()))
        mean_step = statistics.mean(steady_mean(r.step_s, keep) for r in runs.values())
        print("  phases, mean s/step over steady steps and seeds:")
        for phase in next(iter(runs.values())).phases:
            mean = statistics.mean(steady_mean(r.phases[phase], keep) for r in runs.values())
            print(f"    {phase:<14} {mean:7.3f} s  {mean / mean_step:5.1%}")
    vals = {side: {seed: r.val for seed, r in runs.items()} for side, runs in results.items()}
    if compare is not None:
        for side, runs in read_results(compare).items():
            if side not in vals:
                vals[side] = {seed: {int(s): a for s, a in rec["val"].items()} for seed, rec in runs.items()}
                print(f"{side}: from {compare}")
    for side, by_seed in vals.items():
        steps = sorted(next(iter(by_seed.values())))
        print(f"{side} val acc per seed (steps " + ", ".join(map(str, steps)) + "):")
        for seed, val in by_seed.items():
            print(f"    seed {seed}: " + fmt([val[s] for s in steps]) + ("  collapsed" if collapsed(val) else ""))
        print("    mean:   " + fmt([statistics.mean(v[s] for v in by_seed.values()) for s in steps])
              + f"  ({sum(map(collapsed, by_seed.values()))} of {len(by_seed)} collapsed: final under half the start)")
    if set(vals) != {"megarl", "trl"}:
        return
    records = {side: {seed: side_record(r, keep) for seed, r in runs.items()} for side, runs in results.items()}
    if compare is not None:
        records = read_results(compare) | records
    alike = {s: steps_alike(records["megarl"][s], records["trl"][s]) for s in sorted(set(records["megarl"])
                                                                                     & set(records["trl"]))}
    if any(alike.values()):
        print("steps whose mean reward and length megarl logged as TRL did (the same samples), per seed: "
              + ", ".join(f"{s}: {n}" for s, n in alike.items()))
    common = sorted(set(vals["megarl"]) & set(vals["trl"]))
    last = max(vals["megarl"][common[0]])
    final = {side: statistics.mean(vals[side][s][last] for s in common) for side in vals}
    falls = {side: sum(collapsed(vals[side][s]) for s in common) for side in vals}
    met = final["megarl"] >= final["trl"] and falls["megarl"] <= falls["trl"]
    print(f"\nfinal val acc (step {last}, mean of seeds {common}): megarl {final['megarl']:.3f}, TRL {final['trl']:.3f}; "
          f"collapsed: megarl {falls['megarl']}, TRL {falls['trl']} -> target (megarl's mean >= TRL's, no more "
          f"collapses): {'met' if met else 'missed'}")
    if "trl" not in results or "megarl" not in results:
        return
    pairs = [(results["trl"][s], results["megarl"][s]) for s in common]
    ratios = [steady_mean(t.step_s, keep) / steady_mean(m.step_s, keep) for t, m in pairs]
    walls = [(t.exit - t.launch) / (m.exit - m.launch) for t, m in pairs]
    wall = statistics.median(walls)
    print(f"wall time ratio (TRL / megarl, whole runs): median {wall:.2f}x "
          f"(range {min(walls):.2f}-{max(walls):.2f}x) -> target on the CPU (a whole run no slower, >= 1x): "
          f"{'met' if wall >= 1 else 'missed'}")
    median = statistics.median(ratios)
    print(f"megarl vs TRL, s/step ratio (TRL s/step / megarl s/step, steady state): {median:.2f}x (median of "
          f"{len(ratios)} alternating runs; range {min(ratios):.2f}-{max(ratios):.2f}x) -> target on the CPU "
          f"(>= 1.2x; the 2x target waits for a GPU): {'met' if median >= 1.2 else 'missed'}")


if __name__ == "__main__":
    main()
