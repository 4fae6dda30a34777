"""DAPO-Math-17k and AIME-2024 as megarl's train and validation parquet files.

    python tools/prepare_dapo_math.py --out data/dapo \\
        [--train BytedTsinghua-SIA/DAPO-Math-17k | --train dapo-math-17k.parquet] \\
        [--val BytedTsinghua-SIA/AIME-2024 | --val aime-2024.jsonl] [--keep-duplicates] [--val-repeat K]

Writes OUT/dapo-math-17k.parquet (deduplicated: the published file repeats each prompt about
100 times; the counts are printed) and OUT/aime-2024.parquet. megarl samples rollout.val.n
answers per validation prompt (32 for avg@32 in the recipes), so --val-repeat stays 1 unless
another tool needs the problems written K times.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megarl.data.prepare import aime_rows, dapo_math_rows, read_source, write_rows  # noqa: E402
from megarl.data.prompts import DataError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--train", default="BytedTsinghua-SIA/DAPO-Math-17k", help="hub dataset or local file")
    parser.add_argument("--val", default="BytedTsinghua-SIA/AIME-2024", help="hub dataset or local file")
    parser.add_argument("--keep-duplicates", action="store_true", help="keep the published repeats")
    parser.add_argument("--val-repeat", type=int, default=1, help="write each AIME problem K times")
    args = parser.parse_args(argv)
    try:
        train, counts = dapo_math_rows(read_source(args.train), dedupe=not args.keep_duplicates)
        train_path = write_rows(train, Path(args.out) / "dapo-math-17k.parquet")
        print(f"{train_path}: {counts['kept']} prompts ({counts['read']} rows read, {counts['duplicates']} "
              f"duplicates dropped)")
        val = aime_rows(read_source(args.val), repeat=args.val_repeat)
        val_path = write_rows(val, Path(args.out) / "aime-2024.parquet")
        print(f"{val_path}: {len(val) // args.val_repeat} problems x {args.val_repeat}")
    except DataError as e:
        print(f"prepare_dapo_math: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
