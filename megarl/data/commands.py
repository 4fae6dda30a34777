"""`megarl data`: the data commands, each writing megarl's train and validation parquet files
from the published data sets (a hub name, or the files downloaded beforehand).

    megarl data dapo-math --out data/dapo [--train BytedTsinghua-SIA/DAPO-Math-17k | --train FILE]
                          [--val BytedTsinghua-SIA/AIME-2024 | --val FILE] [--keep-duplicates] [--val-repeat K]
    megarl data search-r1 --out data/search_r1 (--source FLASHRAG_DIR | --hub RUC-NLPIR/FlashRAG_datasets)
                          [--train-sets name:split,...] [--test-sets name:split,...] [--corpus wiki-18.jsonl]

dapo-math writes OUT/dapo-math-17k.parquet (deduplicated: the published file repeats each prompt
about 100 times; the counts are printed) and OUT/aime-2024.parquet. megarl samples
rollout.val.n answers per validation prompt (32 for avg@32 in the recipes), so --val-repeat
stays 1 unless another tool needs the problems written K times.

search-r1 writes OUT/train.parquet (NQ + HotpotQA train splits) and OUT/test.parquet (NQ,
TriviaQA, PopQA test; HotpotQA, 2Wiki, MuSiQue dev; Bamboogle test), as Search-R1 evaluates. A
local --source holds FlashRAG's layout, DATASET/SPLIT.jsonl (or .parquet); rows {id, question,
golden_answers}. Each row gets the Search-R1 instruction as the user's message and {"target":
golden_answers}; the data_source (the data set's name) routes the reward to exact match.
--corpus names the retrieval corpus the questions are to be answered from: its SHA-256 goes into
both files, and `megarl train` warns when its index was built from another corpus. Main entry
point: `add_data_commands`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megarl.data.prompts import DataError
from megarl.retrieval.corpus import corpus_info


def dapo_math_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--train", default="BytedTsinghua-SIA/DAPO-Math-17k", help="hub dataset or local file")
    parser.add_argument("--val", default="BytedTsinghua-SIA/AIME-2024", help="hub dataset or local file")
    parser.add_argument("--keep-duplicates", action="store_true", help="keep the published repeats")
    parser.add_argument("--val-repeat", type=int, default=1, help="write each AIME problem K times")


def run_dapo_math(args: argparse.Namespace) -> int:
    from megarl.data.prepare import aime_rows, dapo_math_rows, read_source, write_rows  # torch: not for --help

    try:
        train, counts = dapo_math_rows(read_source(args.train), dedupe=not args.keep_duplicates)
        train_path = write_rows(train, Path(args.out) / "dapo-math-17k.parquet")
        print(f"{train_path}: {counts['kept']} prompts ({counts['read']} rows read, {counts['duplicates']} "
              f"duplicates dropped)")
        val = aime_rows(read_source(args.val), repeat=args.val_repeat)
        val_path = write_rows(val, Path(args.out) / "aime-2024.parquet")
        print(f"{val_path}: {len(val) // args.val_repeat} problems x {args.val_repeat}")
    except DataError as e:
        print(f"megarl data dapo-math: {e}", file=sys.stderr)
        return 1
    return 0


def _sets(text: str | None, default: dict[str, str]) -> dict[str, str]:
    if not text:
        return dict(default)
    pairs = [item.split(":") for item in text.split(",") if item]
    if any(len(p) != 2 for p in pairs):
        raise DataError(f"sets {text!r}: use name:split,name:split")
    return dict(pairs)


def _rows(args, name: str, split: str):
    from megarl.data.prepare import read_source

    if args.hub:
        return read_source(args.hub, subset=name, split=split)
    base = Path(args.source) / name
    for suffix in (".jsonl", ".parquet"):
        if (base / f"{split}{suffix}").exists():
            return read_source(str(base / f"{split}{suffix}"))
    raise DataError(f"no {split}.jsonl or {split}.parquet in {base} (FlashRAG layout: DATASET/SPLIT.jsonl)")


def search_r1_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="output directory")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--source", help="local directory in FlashRAG's layout")
    where.add_argument("--hub", help="hub dataset with one subset per QA set, e.g. RUC-NLPIR/FlashRAG_datasets")
    parser.add_argument("--train-sets", help="name:split,... (default nq:train,hotpotqa:train)")
    parser.add_argument("--test-sets", help="name:split,... (default: the seven Search-R1 test sets)")
    parser.add_argument("--corpus", help="the retrieval corpus file (e.g. wiki-18.jsonl) to record in the data "
                        "(a run warns when its index was built from another)")


def run_search_r1(args: argparse.Namespace) -> int:
    if args.corpus and not Path(args.corpus).is_file():
        print(f"megarl data search-r1: --corpus {args.corpus}: no such file", file=sys.stderr)
        return 1
    corpus = corpus_info(args.corpus) if args.corpus else None
    from megarl.data.prepare import SEARCH_R1_TEST, SEARCH_R1_TRAIN, search_r1_rows, write_rows

    try:
        for name, sets in (("train", _sets(args.train_sets, SEARCH_R1_TRAIN)),
                           ("test", _sets(args.test_sets, SEARCH_R1_TEST))):
            rows, counts = [], []
            for dataset, split in sets.items():
                part = search_r1_rows(dataset, split, _rows(args, dataset, split))
                rows += part
                counts.append(f"{dataset} {len(part)}")
            path = write_rows(rows, Path(args.out) / f"{name}.parquet", corpus=corpus)
            print(f"{path}: {len(rows)} questions ({', '.join(counts)})")
    except DataError as e:
        print(f"megarl data search-r1: {e}", file=sys.stderr)
        return 1
    return 0


COMMANDS = {"dapo-math": (dapo_math_arguments, run_dapo_math, "DAPO-Math-17k and AIME-2024 as train and "
                                                                  "validation parquet files"),
            "search-r1": (search_r1_arguments, run_search_r1, "Search-R1's QA sets (FlashRAG) as train and test "
                                                              "parquet files")}


def add_data_commands(sub) -> None:
    data = sub.add_parser("data", help="Write a published data set as megarl's train and validation files.")
    kinds = data.add_subparsers(dest="data_command", metavar="{" + ",".join(COMMANDS) + "}", required=True)
    for name, (arguments, run, text) in COMMANDS.items():
        parser = kinds.add_parser(name, help=text, description=text)
        arguments(parser)
        parser.set_defaults(func=run)
