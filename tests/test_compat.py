"""The versions megarl is tested with (megarl.compat): pyproject.toml's ranges are what CI's two
environments hold, a run warns about a version outside them or an untested megatron-core release
and refuses one known to be broken; this environment is one CI tests."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

import pytest

from megarl.cli import EXIT_CONFIG_ERROR, main
from megarl.compat import TESTED_MEGATRON, UnsupportedVersion, check_environment

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.megatron  # the environment test runs in both of CI's environments (make test-compat)
REQUIRES = ["torch>=2.13.0a0,<2.15", "megatron-core>=0.16.1,<0.20", "ray[default]>=2.60,<3", "transformers>=5.19,<6",
            "faiss-cpu>=1.8; extra == 'dense'"]
TESTED = {"torch": "2.13.0", "transformers": "5.24.0", "megatron-core": "0.16.1", "ray": "2.60.0"}


def test_the_tested_versions_pass_without_a_word(caplog):
    assert check_environment(TESTED, REQUIRES) == []
    newest = {"torch": "2.14.1", "transformers": "5.19.0", "megatron-core": "0.19.2+f726afc", "ray": "2.60.0"}
    assert check_environment(newest, REQUIRES) == []  # a local build label is the release it builds
    assert check_environment({**TESTED, "torch": "2.13.0a0+nv26.06"}, REQUIRES) == []  # an NGC container's torch
    assert check_environment({**TESTED, "ray": None}, REQUIRES) == []  # not installed: nothing to say
    assert caplog.records == []


@pytest.mark.parametrize("name, version, words", [
    ("megatron-core", "0.17.1", "megatron-core 0.17.1 is untested: CI runs megarl on 0.16.1 and 0.19.2"),
    ("megatron-core", "0.20.0", "megatron-core 0.20.0 is outside the range megarl is tested with (<0.20,>=0.16.1)"),
    ("torch", "2.12.0", "torch 2.12.0 is outside the range megarl is tested with (<2.15,>=2.13.0a0)"),
    ("torch", "2.15.0a0+nv26.10", "torch 2.15.0a0+nv26.10 is outside the range"),
    ("transformers", "4.57.1", "transformers 4.57.1 is outside the range megarl is tested with (<6,>=5.19)"),
    ("ray", "2.40.0", "ray 2.40.0 is outside the range megarl is tested with (<3,>=2.60)"),
])
def test_a_version_ci_does_not_run_is_named_with_what_it_does(name, version, words, caplog):
    warnings = check_environment({**TESTED, name: version}, REQUIRES)
    assert len(warnings) == 1 and warnings[0].startswith(words)
    assert [r.getMessage() for r in caplog.records] == [f"megarl: {warnings[0]}"]


@pytest.mark.parametrize("version", ["0.18.1", "0.19.1"])
def test_a_yanked_megatron_core_release_is_refused(version):
    with pytest.raises(UnsupportedVersion, match=rf"megatron-core {version}: yanked from the package index"):
        check_environment({**TESTED, "megatron-core": version}, REQUIRES)


def test_the_command_line_refuses_a_broken_release_before_the_run(monkeypatch, capsys):
    from importlib import metadata

    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "0.19.1" if name == "megatron-core" else real(name))
    assert main(["train", "trainer.total_training_steps=1", "--dry-run"]) == EXIT_CONFIG_ERROR
    assert capsys.readouterr().err.startswith("megarl: megatron-core 0.19.1: yanked from the package index")


def _ranges() -> dict[str, str]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {m["name"]: m["spec"] for d in deps if (m := re.match(r"(?P<name>[a-z-]+)(\[[a-z]+\])?(?P<spec>\S*)", d))}


def test_pyprojects_ranges_are_the_two_environments():
    from packaging.specifiers import SpecifierSet

    ranges = _ranges()
    compat = dict(line.split("==") for line in (ROOT / "requirements/compat.txt").read_text().splitlines()
                  if line and not line.startswith("#"))
    assert set(compat) == {"megatron-core", "torch", "transformers"}
    for name, version in compat.items():  # the second environment: inside the ranges, at their top for megatron
        assert SpecifierSet(ranges[name]).contains(version), (name, version, ranges[name])
    assert ranges["megatron-core"] == f">={TESTED_MEGATRON[0]},<0.20"  # the first environment: the lowest
    assert compat["megatron-core"] == TESTED_MEGATRON[-1]
    assert ranges["torch"].startswith(">=2.13.0a0,")  # .venv's CPU wheel (TORCH_SPEC), and NGC's builds of it
    assert compat["transformers"] == ranges["transformers"].split(",")[0].removeprefix(">=") + ".0"


def test_this_environment_is_one_ci_tests():
    # make test (.venv) and make test-compat (.venv-compat) run this: both hold tested versions
    assert check_environment() == []
    if sys.version_info < (3, 12):  # no megatron-core after 0.16.1 installs on Python 3.11
        from importlib import metadata

        assert metadata.version("megatron-core") == TESTED_MEGATRON[0]
