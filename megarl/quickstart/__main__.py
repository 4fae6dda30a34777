"""Inputs of the CPU quickstarts, built locally: nothing comes from a model hub.

The command line that builds them, before training on them (megarl.quickstart.inputs says
what each command writes):

    python -m megarl.quickstart prepare outputs/quickstart                # Search-R1 + DAPO
    megarl train examples/quickstart/search_r1_tiny.yaml
    python -m megarl.quickstart prepare-math outputs/quickstart_math      # single-turn DAPO math
    megarl train examples/quickstart/dapo_math_tiny.yaml
    python -m megarl.quickstart prepare-code outputs/quickstart_code      # code RL, programs in a sandbox
    megarl train examples/quickstart/code_tiny.yaml
    python -m megarl.quickstart prepare-tools outputs/quickstart_tools    # learning to call a calculator
    megarl train examples/quickstart/tools_tiny.yaml
    python -m megarl.quickstart prepare-real outputs/quickstart_real      # a real model (make real-model)
    megarl train examples/quickstart/real_smollm2.yaml

Main entry point: `main`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace
from pathlib import Path

from megarl.quickstart.inputs import (MathSettings, QuickstartSettings, ToolSettings, prepare, prepare_code,
                                     prepare_math, prepare_tools)
from megarl.quickstart.real_task import write_addition_data


def _search_settings(warmup_steps: int | None, think_words: int = 0) -> QuickstartSettings:
    settings = QuickstartSettings()
    if warmup_steps is not None:
        if warmup_steps < 1:
            raise SystemExit("--warmup-steps must be at least 1")
        settings = replace(settings, read_steps=warmup_steps, mix_steps=warmup_steps)
    if think_words < 0:
        raise SystemExit("--think-words must be 0 (no reasoning) or more")
    if think_words:  # log-normal, sigma 1: a tenth of the sections over 3.6x the median; none over 16x
        settings = replace(settings, think_words=(think_words, 1.0, 16 * think_words))
    return settings


def _math_settings(warmup_steps: int | None) -> MathSettings:
    if warmup_steps is None:
        return MathSettings()
    if warmup_steps < 1:
        raise SystemExit("--warmup-steps must be at least 1")
    return MathSettings(bare_steps=warmup_steps, steps=warmup_steps)


def _tool_settings(tool: str, warmup_steps: int | None) -> ToolSettings:
    if warmup_steps is None:
        return ToolSettings(tool=tool)
    if warmup_steps < 1:
        raise SystemExit("--warmup-steps must be at least 1")
    return ToolSettings(tool=tool, read_steps=warmup_steps, mix_steps=warmup_steps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megarl.quickstart", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="build the search world, index and warmed-up tiny model")
    p.add_argument("out_dir", help="where data/, index/ and model/ go (the quickstart config reads outputs/quickstart)")
    p.add_argument("--force", action="store_true", help="rebuild even when up to date")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="steps of each warm-up phase (default 400 and 300); a few dozen make a model good only "
                        "for smoke runs of the pipeline, such as the slurm test")
    p.add_argument("--think-words", type=int, default=0,
                   help="median words of reasoning (<think> ... </think>) the model learns to write before each "
                        "action, log-normally many (at most 16x): long-tailed response lengths (default 0: none)")
    p.set_defaults(run=lambda a: prepare(a.out_dir, _search_settings(a.warmup_steps, a.think_words), force=a.force))
    m = sub.add_parser("prepare-math", help="build the arithmetic problems and warmed-up tiny model")
    m.add_argument("out_dir", help="where data/ and model/ go (the math config reads outputs/quickstart_math)")
    m.add_argument("--force", action="store_true", help="rebuild even when up to date")
    m.add_argument("--warmup-steps", type=int, default=None,
                   help="steps of each warm-up phase (default 300 and 300); a few dozen make a model good only "
                        "for smoke runs of the pipeline, such as the journey test")
    m.set_defaults(run=lambda a: prepare_math(a.out_dir, _math_settings(a.warmup_steps), force=a.force))
    c = sub.add_parser("prepare-code", help="build the programming problems and warmed-up tiny model")
    c.add_argument("out_dir", help="where data/ and model/ go (the code config reads outputs/quickstart_code)")
    c.add_argument("--force", action="store_true", help="rebuild even when up to date")
    c.set_defaults(run=lambda a: prepare_code(a.out_dir, force=a.force))
    t = sub.add_parser("prepare-tools", help="build the products to compute and a tiny model that calls a tool sometimes")
    t.add_argument("out_dir", help="where data/ and model/ go (the tools config reads outputs/quickstart_tools)")
    t.add_argument("--tool", choices=("calculator", "python"), default="calculator",
                   help="the tool the model learns to call (python: the Python variant, code run in the sandbox)")
    t.add_argument("--force", action="store_true", help="rebuild even when up to date")
    t.add_argument("--warmup-steps", type=int, default=None,
                   help="steps of each warm-up phase (default 400 and 300); a few dozen make a model good only "
                        "for smoke runs of the pipeline")
    t.set_defaults(run=lambda a: prepare_tools(a.out_dir, _tool_settings(a.tool, a.warmup_steps), force=a.force))
    r = sub.add_parser("prepare-real", help="write the single-digit sums of the real-model quickstart (the model: "
                                            "make real-model)")
    r.add_argument("out_dir", help="where data/ goes (the real-model config reads outputs/quickstart_real)")
    r.add_argument("--num-val", type=int, default=20, help="pairs {a, b} held out for validation (default 20 of 45)")
    r.add_argument("--seed", type=int, default=0, help="which pairs are held out (default 0)")
    r.set_defaults(run=lambda a: print(f"single-digit sums in {write_addition_data(Path(a.out_dir) / 'data', a.num_val, a.seed)['train'].parent}"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args.run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
