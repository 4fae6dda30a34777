"""The library versions megarl is tested with, the check a run makes of its own, and what
differs between the megatron-core releases it supports.

CI runs the suite in two environments (docs/install.md, "What is tested"): `make test` in .venv
(Python 3.11, megatron-core 0.16.1: the newest release Python 3.11 can install) and `make
test-compat` in .venv-compat (Python 3.12, megatron-core's newest release, the torch and
transformers the gpu extra's SGLang pins: requirements/compat.txt). pyproject.toml's ranges are
what those two environments hold, and `check_environment` reads them from megarl's installed
metadata, so they are written once. Main entry points: `check_environment`, `TESTED_MEGATRON`,
`name_te_general_gemm`.
"""

from __future__ import annotations

import logging
from importlib import metadata

log = logging.getLogger(__name__)

# megatron-core changes its APIs in every minor release: the releases CI runs, exactly
TESTED_MEGATRON = ("0.16.1", "0.19.2")
# (distribution, version) -> why megarl refuses to run on it
BROKEN = {
    ("megatron-core", "0.18.1"): "yanked from the package index (\"wrong version\"); use 0.18.2 or a tested release",
    ("megatron-core", "0.19.1"): "yanked from the package index (\"wrong version\"); use 0.19.2",
}
CHECKED = ("torch", "transformers", "megatron-core", "ray")  # the ranges pyproject.toml states for what CI tests


class UnsupportedVersion(RuntimeError):
    """An installed library release megarl is known not to work with."""


def check_environment(installed=None, requirements=None) -> list[str]:
    """The warnings about this environment's versions of CHECKED (each logged once here): a
    version outside pyproject.toml's range (installed with --no-deps, or a container's own),
    a megatron-core release between the tested ones. UnsupportedVersion for a BROKEN release.
    `installed` (name -> version or None) and `requirements` (megarl's Requires-Dist lines)
    default to this environment's metadata."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    installed = installed if installed is not None else {name: _installed(name) for name in CHECKED}
    if requirements is None:
        requirements = _megarl_requirements()
    ranges = {}
    for line in requirements:
        req = Requirement(line)
        if req.name in CHECKED and not req.marker:
            ranges[req.name] = req.specifier
    warnings = []
    for name in CHECKED:
        version = installed.get(name)
        if version is None:
            continue
        public = Version(version).public  # 0.19.2+f726afc: a build of 0.19.2
        if (name, public) in BROKEN:
            raise UnsupportedVersion(f"{name} {version}: {BROKEN[name, public]}")
        spec = ranges.get(name)
        if spec is not None and not spec.contains(public, prereleases=True):
            warnings.append(f"{name} {version} is outside the range megarl is tested with ({spec}): "
                            "expect errors this version's API causes (docs/install.md)")
        elif name == "megatron-core" and public not in TESTED_MEGATRON:
            warnings.append(f"megatron-core {version} is untested: CI runs megarl on {' and '.join(TESTED_MEGATRON)} "
                            "(docs/install.md); its API changes in every minor release")
    for warning in warnings:
        log.warning("megarl: %s", warning)
    return warnings


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _megarl_requirements() -> list[str]:
    """megarl's Requires-Dist lines ([] when megarl runs from a checkout it was not installed from)."""
    try:
        return metadata.requires("megarl") or []
    except metadata.PackageNotFoundError:
        return []


def name_te_general_gemm(moe_utils) -> None:
    """megatron-core 0.16 defines `moe_utils.te_general_gemm` only when Transformer Engine imports,
    yet its MoE router tests `te_general_gemm is not None` (a NameError without TE); 0.19 defines
    it, None without TE. Defines it as None where it is missing (a run without TE: the CPU)."""
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
