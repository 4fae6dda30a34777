"""tools/bench/retrieval.py runs end to end (on a corpus small enough for a test)."""

import importlib.util
from pathlib import Path

import rank_bm25  # noqa: F401  (the bench's baseline, in the dev extra: missing fails here, not skipped)

BENCH = Path(__file__).resolve().parents[1] / "tools" / "bench" / "retrieval.py"


def test_benchmark_runs_and_reports_both_numbers(capsys, tmp_path):
    spec = importlib.util.spec_from_file_location("bench_retrieval", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    argv = ["--docs", "400", "--queries", "30", "--baseline-queries", "10", "--vocab", "2000",
            "--workdir", str(tmp_path)]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "timed on the first 10 of 30 queries" in out and "in batches of 256 for megarl, top-3" in out
    assert out.count("work 10\n") == 6  # 3 timed runs each, the same 10 queries answered
    assert "megarl on all 30 queries:" in out
    assert "top-1 agreement on the 10 shared queries:" in out
    assert "megarl vs rank_bm25:" in out.splitlines()[-1] and "(median of 3 alternating runs" in out
