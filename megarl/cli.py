"""The `megarl` command line.

    megarl train CONFIG.yaml [key=value ...] [--dry-run]
    megarl retrieval build --corpus FILE --out DIR [--kind bm25|dense]
    megarl retrieval serve --index DIR [--host 127.0.0.1 --port 8000 --topk 3]

Configuration errors are reported (every problem, with its key and fix) before anything
heavy is imported, with exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megarl.config import ConfigError, RunConfig, load_config, save_config
from megarl.config_loader import dump_config
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
    if args.dry_run:
        sys.stdout.write(dump_config(cfg))
        print(f"# config OK{f' ({path})' if path else ''}", file=sys.stderr)
        return 0
    resolved = save_config(cfg, Path(cfg.trainer.output_dir) / "config.yaml")
    print(f"megarl: resolved config saved to {resolved}", file=sys.stderr)
    return run_training(cfg)


def run_training(cfg: RunConfig) -> int:
    # The training loop (megarl/train.py) lands with the end-to-end issue; until then a
    # real run stops here rather than pretending to train.
    print("megarl: the training loop is not part of this release yet; use --dry-run to validate configs.",
          file=sys.stderr)
    return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megarl", description="RL post-training of LLMs (DAPO / GRPO / PPO, Search-R1).")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="Run training from a YAML config with dotted key=value overrides.")
    train.add_argument("items", nargs="*", metavar="CONFIG.yaml | key=value",
                       help="A YAML run file, then overrides such as algorithm.clip_ratio_high=0.28.")
    train.add_argument("--dry-run", action="store_true", help="Validate, print the resolved config and exit.")
    train.set_defaults(func=_train)
    add_retrieval_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"megarl: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR


if __name__ == "__main__":
    sys.exit(main())
