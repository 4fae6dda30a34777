"""`megarl convert`: the command line of the checkpoint conversion library (ckpt_convert/).

    megarl convert hf-to-megatron --hf HF_DIR --out DIST_DIR [--tp N --pp M --ep E]
    megarl convert megatron-to-hf --ckpt DIST_DIR_OR_STEP_DIR --out HF_DIR [--hf-config HF_DIR]

Training needs neither: `megarl train` reads HF model directories, and `megarl export` writes a
run's checkpoint as one. hf-to-megatron is for other Megatron tools; megatron-to-hf for
checkpoints written elsewhere (or a step directory, as `megarl export` does). Main entry point:
`add_convert_command`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def hf_to_megatron_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hf", required=True, help="HF model directory (config.json + safetensors)")
    parser.add_argument("--out", required=True, help="new directory for the distributed checkpoint")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size it is meant for (embedding padding)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size it is meant for (checked)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size it is meant for (checked; MoE)")


def megatron_to_hf_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ckpt", required=True, help="a megarl step_NNNNNN directory or a distributed checkpoint")
    parser.add_argument("--out", required=True, help="HF model directory to write")
    parser.add_argument("--hf-config", help="directory with the model's config.json and tokenizer")
    parser.add_argument("--max-shard-gb", type=float, default=2.0, help="largest safetensors file (GB)")


def run_hf_to_megatron(args: argparse.Namespace) -> int:
    from ckpt_convert.hf_to_megatron import convert
    from megarl.models import UnsupportedModel

    try:
        summary = convert(args.hf, args.out, args.tp, args.pp, ep=args.ep)
    except (FileNotFoundError, FileExistsError, KeyError, ValueError, UnsupportedModel) as e:
        print(f"hf_to_megatron: {e}", file=sys.stderr)
        return 2
    print(f"hf_to_megatron: wrote {args.out} ({summary['bytes_written'] / 1e9:.3f} GB in {summary['seconds']} s)",
          file=sys.stderr)
    return 0


def run_megatron_to_hf(args: argparse.Namespace) -> int:
    from ckpt_convert.megatron_to_hf import convert
    from megarl.checkpoint import CheckpointError

    start = time.perf_counter()
    try:
        out = convert(args.ckpt, args.out, args.hf_config, int(args.max_shard_gb * (1 << 30)))
    except (FileNotFoundError, FileExistsError, KeyError, ValueError, CheckpointError) as e:
        print(f"megatron_to_hf: {e}", file=sys.stderr)
        return 2
    total = json.loads((out / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    print(f"megatron_to_hf: wrote {out} ({total / 1e9:.3f} GB in {time.perf_counter() - start:.3f} s)", file=sys.stderr)
    return 0


KINDS = {"hf-to-megatron": (hf_to_megatron_arguments, run_hf_to_megatron,
                            "an HF checkpoint -> a megatron distributed checkpoint (for other Megatron tools)"),
         "megatron-to-hf": (megatron_to_hf_arguments, run_megatron_to_hf,
                            "a megatron checkpoint (any layout) or a run's step directory -> an HF model directory")}


def add_convert_command(sub) -> None:
    convert = sub.add_parser("convert", help="Convert checkpoints between HF and Megatron formats (training needs "
                                             "none: it reads HF model directories).")
    kinds = convert.add_subparsers(dest="convert_command", metavar="{" + ",".join(KINDS) + "}", required=True)
    for name, (arguments, run, text) in KINDS.items():
        parser = kinds.add_parser(name, help=text)
        arguments(parser)
        parser.set_defaults(func=run)


def module_main(kind: str, argv: list[str] | None) -> int:
    """`python -m ckpt_convert.<module>`: the same as `megarl convert <kind>`."""
    arguments, run, text = KINDS[kind]
    parser = argparse.ArgumentParser(prog=f"megarl convert {kind}", description=text)
    arguments(parser)
    return run(parser.parse_args(argv))
