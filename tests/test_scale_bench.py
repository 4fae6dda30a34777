"""tools/bench/scale.py runs end to end on a step small enough for a test: the driver's data
path through megarl's own code to rank actors that check they were sent their share's rows."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # 30-50 s: Ray, a reward pool and 8 rank actors started
def test_the_bench_runs_a_small_step_and_prints_its_targets_last():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "bench" / "scale.py"), "--prompts", "4", "--steps", "1",
                          "--median-response", "64"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = out.stdout.splitlines()
    assert lines[0].startswith("versions:"), out.stderr[-2000:]
    assert any(line.startswith("warm-up step 0:") for line in lines)  # printed, not timed against the target
    step = next(line for line in lines if line.startswith("step 1:"))
    assert "192 trajectories generated in 1 batches, 64 kept" in step  # 4 prompts x 16, generated 3x
    assert re.search(r"a rank received up to [\d.]+ GiB, 1\.0\dx its share", step)
    targets = lines[-3:]
    assert all(t.startswith("target ") for t in targets) and "each rank receives" in targets[0]
    assert out.returncode == (1 if any("MISSED" in t for t in targets) else 0)
