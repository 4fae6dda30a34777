"""Search-R1's data (FlashRAG QA sets) as megarl's train and test parquet files.

    python tools/prepare_search_r1.py --out data/search_r1 --source FLASHRAG_DIR
    python tools/prepare_search_r1.py --out data/search_r1 --hub RUC-NLPIR/FlashRAG_datasets

Train: NQ + HotpotQA (train splits); test: NQ, TriviaQA, PopQA (test), HotpotQA, 2Wiki,
MuSiQue (dev), Bamboogle (test), as Search-R1 evaluates. A local --source holds FlashRAG's
layout, DATASET/SPLIT.jsonl (or .parquet); rows {id, question, golden_answers}. Each row
gets the Search-R1 instruction as the user's message and {"target": golden_answers}; the
data_source (the data set's name) routes the reward to exact match. --train-sets / --test-sets
choose other sets (name:split, comma-separated). --corpus names the retrieval corpus the
questions are to be answered from (e.g. wiki-18.jsonl): its SHA-256 goes into both files,
and `megarl train` warns when its index was built from another corpus.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megarl.data.prepare import SEARCH_R1_TEST, SEARCH_R1_TRAIN, read_source, search_r1_rows, write_rows  # noqa: E402
from megarl.data.prompts import DataError  # noqa: E402
from megarl.retrieval.corpus import corpus_info  # noqa: E402


def _sets(text: str | None, default: dict[str, str]) -> dict[str, str]:
    if not text:
        return dict(default)
    pairs = [item.split(":") for item in text.split(",") if item]
    if any(len(p) != 2 for p in pairs):
        raise SystemExit(f"sets {text!r}: use name:split,name:split")
    return dict(pairs)


def _rows(args, name: str, split: str):
    if args.hub:
        return read_source(args.hub, subset=name, split=split)
    base = Path(args.source) / name
    for suffix in (".jsonl", ".parquet"):
        if (base / f"{split}{suffix}").exists():
            return read_source(str(base / f"{split}{suffix}"))
    raise DataError(f"no {split}.jsonl or {split}.parquet in {base} (FlashRAG layout: DATASET/SPLIT.jsonl)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--source", help="local directory in FlashRAG's layout")
    where.add_argument("--hub", help="hub dataset with one subset per QA set, e.g. RUC-NLPIR/FlashRAG_datasets")
    parser.add_argument("--train-sets", help="name:split,... (default nq:train,hotpotqa:train)")
    parser.add_argument("--test-sets", help="name:split,... (default: the seven Search-R1 test sets)")
    parser.add_argument("--corpus", help="the retrieval corpus file (e.g. wiki-18.jsonl) to record in the data "
                        "(a run warns when its index was built from another)")
    args = parser.parse_args(argv)
    if args.corpus and not Path(args.corpus).is_file():
        print(f"prepare_search_r1: --corpus {args.corpus}: no such file", file=sys.stderr)
        return 1
    corpus = corpus_info(args.corpus) if args.corpus else None
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
        print(f"prepare_search_r1: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
