"""tools/mutants.py's own parts: the tables it reads from the docs, and the processes it reaps."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import mutants  # noqa: E402


def test_a_table_is_read_row_by_row_with_escaped_pipes(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("# t\n\n### Equivalent mutants\n\nprose\n\n| where | changed line | why |\n|---|---|---|\n"
                   "| `a.b:f` | `x = y \\| z` | because |\n| `a.b:C.g` | `return 1` | as above |\n\n"
                   "## next\n| `c.d:h` | `no` | not this table |\n")
    assert mutants.listed(doc, "### Equivalent mutants") == {("a.b", "f", "x = y | z"): "because",
                                                            ("a.b", "C.g", "return 1"): "as above"}
    assert mutants.listed(doc, "### Absent") == {} and mutants.listed(tmp_path / "none.md", "### x") == {}


def test_orphans_of_a_run_are_reaped_while_its_live_processes_are_kept(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    live = subprocess.Popen(["sleep", "60"], cwd=work)  # below this process: a worker still running
    # a server whose test process was killed: its parent (the shell) is gone
    orphan = int(subprocess.run(["bash", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"], cwd=work, capture_output=True,
                                text=True, timeout=30).stdout)
    elsewhere = subprocess.run(["bash", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"], cwd=tmp_path,
                               capture_output=True, text=True, timeout=30).stdout
    try:
        assert psutil.pid_exists(orphan)
        mutants.stragglers(work, keep=psutil.Process().pid)
        deadline = time.monotonic() + 10
        while psutil.pid_exists(orphan) and psutil.Process(orphan).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the orphan was not killed"
            time.sleep(0.05)
        assert live.poll() is None and psutil.pid_exists(int(elsewhere))  # not an orphan, and not the run's
        mutants.stragglers(work)  # at the end of a run: everything under it
        assert live.wait(timeout=10) != 0
    finally:
        for pid in (live.pid, orphan, int(elsewhere)):
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass


def test_only_functions_mutmut_mutates_are_drawn_and_a_group_naming_another_is_refused(tmp_path, monkeypatch):
    # the CI sample once drew only a @functools.cache function: mutmut made no mutant of it and
    # stopped on its empty filter, failing the run
    (tmp_path / "m.py").write_text(
        "import functools\n\n"
        "def plain(x):\n    return x + 1\n\n"
        "@functools.cache\ndef cached(x):\n    return x + 1\n\n"
        "class C:\n"
        "    def method(self):\n        return 1\n\n"
        "    @staticmethod\n    def static():\n        return 2\n\n"
        "    @property\n    def prop(self):\n        return 3\n")
    monkeypatch.setattr(mutants, "ROOT", tmp_path)
    assert mutants.functions_of(mutants.Group(("m.py",), ())) == [
        "m.x_plain__mutmut_*", "m.xǁCǁmethod__mutmut_*", "m.xǁCǁstatic__mutmut_*"]
    assert mutants.functions_of(mutants.Group(("m.py",), (), functions=("m.py:plain",))) == ["m.x_plain__mutmut_*"]
    for named in ("m.py:cached", "m.py:absent"):
        with pytest.raises(SystemExit, match=named):
            mutants.functions_of(mutants.Group(("m.py",), (), functions=(named,)))


def test_every_group_names_functions_that_exist_and_are_mutated():
    for name, group in mutants.GROUPS.items():
        patterns = mutants.functions_of(group)  # raises on a named function mutmut leaves alone
        assert patterns, name
        assert all(p.endswith("__mutmut_*") for p in patterns), name
