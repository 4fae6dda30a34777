"""The journey of docs/slurm.md as `make test-journey` runs it (tests/journey/blocks.py): its
marked blocks, in order, each with a replacement in tests/journey/steps.sh exactly where the
docs say it does not run here; a page whose marks do not match its blocks is refused."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "journey"))
from blocks import blocks, script  # noqa: E402

PAGE = (ROOT / "docs" / "slurm.md").read_text()
STEPS = (ROOT / "tests" / "journey" / "steps.sh").read_text()


def test_the_journey_is_the_documented_one_in_order():
    assert [b.name for b in blocks(PAGE)] == ["install", "model", "download", "data", "plan", "mlflow", "submit",
                                              "export", "serve"]


def test_each_block_not_run_here_has_a_replacement_and_no_other_does():
    replaced = set(re.findall(r"^journey_instead_([a-z_]+)\(\)", STEPS, re.M))
    assert replaced == {b.name.replace("-", "_") for b in blocks(PAGE) if b.instead is not None}
    for b in blocks(PAGE):
        if b.instead is not None:  # says why, and what runs in its place
            assert re.match(r"not run (as written )?here \([^)]+\): \S", b.instead), b.instead


def test_the_script_runs_each_block_as_written_between_its_hooks():
    page = ("intro\n\n<!-- journey one -->\n```bash\necho 1\necho 2\n```\n\ntext\n\n"
            "<!-- journey two-b: not run here (needs X): Y instead -->\n```bash\nrm -rf /\n```\n"
            "```bash\nnot marked\n```\n")
    assert script(page) == ("journey_before one\necho 1\necho 2\njourney_after one\n"
                            "journey_before two-b\njourney_instead_two_b  # not run here (needs X): Y instead\n"
                            "journey_after two-b\n")


@pytest.mark.parametrize("page, message", [
    ("<!-- journey one -->\ntext\n```bash\necho\n```\n", "2 journey marks|1 journey marks but 0"),
    ("<!-- journey one -->\n```bash\na\n```\n<!-- journey one -->\n```bash\nb\n```\n", "named twice"),
])
def test_a_mark_without_its_block_or_a_name_used_twice_is_refused(page, message):
    with pytest.raises(ValueError, match=message):
        blocks(page)


def test_the_journey_and_its_hooks_are_valid_bash(tmp_path):
    (tmp_path / "journey.sh").write_text(STEPS + "\n" + script(PAGE))
    checked = subprocess.run(["bash", "-n", str(tmp_path / "journey.sh")], capture_output=True, text=True, timeout=30)
    assert checked.returncode == 0, checked.stderr
