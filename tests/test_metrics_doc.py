"""docs/metrics.md against the code, both ways.

The run: the session's tiny reference run (train_fixtures.tiny_reference_run: 2 steps, the
embedded engine on the CPU, validation before training and after each step). Every metric it
logged to MLflow has a row of the page (a row with a placeholder, `val/pass_at_<n>`, matches by
pattern); every row the page says is logged every step or at validation was logged by it at
those steps; every other row names the setting it needs (a key of the config) and a metric
megarl's source builds, read from the source (ast), not from the page: a literal name, or an
f-string's prefix and suffix around a string literal of the source (`timing/{phase}_s` with
"update_critic"). The source check is on names only: it cannot tell which code path logs them.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "metrics.md"
EVERY_STEP, VALIDATION = "every step", "validation"
# tiny_overrides: 2 steps, trainer.test_freq=1; trainer.val_before_train is on by default (step 0)
RUN_STEPS = {EVERY_STEP: [1, 2], VALIDATION: [0, 1, 2]}
PLACEHOLDER = re.compile(r"<[a-z_]+>")
SETTING = re.compile(r"`([a-z_]+(?:\.[a-z0-9_]+)+)(?:=[^`]*)?`")  # `critic.enable=true`, `algorithm.tis_cap`


@dataclass(frozen=True)
class Row:
    name: str
    logged: str
    cells: tuple[str, ...]

    @property
    def pattern(self) -> re.Pattern:
        return re.compile(".+".join(re.escape(part) for part in PLACEHOLDER.split(self.name)))

    @property
    def conditional(self) -> bool:
        return self.logged not in RUN_STEPS


def page_rows() -> list[Row]:
    """The page's table rows: `| `name` | unit | logged | meaning |`, each under a `## `prefix/``
    heading its name starts with."""
    rows, prefix = [], None
    for line in PAGE.read_text().splitlines():
        heading = re.match(r"## `([a-z_]+/)`", line)
        if heading:
            prefix = heading.group(1)
        if not line.startswith("| `"):
            continue
        cells = tuple(c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|")))
        assert len(cells) == 4, f"docs/metrics.md: a row is | metric | unit | logged | meaning |: {line}"
        name = cells[0].strip("`")
        assert prefix and name.startswith(prefix), f"docs/metrics.md: {name} is not under its own heading ({prefix})"
        rows.append(Row(name, cells[2], cells))
    return rows


def logged_by(out: Path) -> dict[str, list[int]]:
    """{metric: the steps it was logged at} of the run in `out`'s local MLflow store."""
    from mlflow.tracking import MlflowClient

    from megarl.tracking import local_store_uri

    client = MlflowClient(tracking_uri=local_store_uri(out))
    (run,) = client.search_runs([client.get_experiment_by_name("t").experiment_id])
    return {name: sorted(m.step for m in client.get_metric_history(run.info.run_id, name))
            for name in run.data.metrics}


@functools.cache
def source_strings() -> tuple[set[str], set[str]]:
    """(string literals, f-string templates with `{}` for each field) of megarl/**/*.py."""
    literals, templates = set(), set()
    for path in (ROOT / "megarl").rglob("*.py"):
        tree = ast.parse(path.read_text())
        parts = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr):
                templates.add("".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in parts:
                literals.add(node.value)
    return literals, templates


def built_in_source(name: str, literals: set[str], templates: set[str]) -> bool:
    """Whether megarl's source builds the metric `name` (see the module docstring); a name with
    a placeholder must be an f-string of the source, field for placeholder."""
    if PLACEHOLDER.search(name):
        return PLACEHOLDER.sub("{}", name) in templates
    if name in literals:
        return True
    group = name.split("/")[0] + "/"
    for template in templates:
        if template.count("{}") != 1 or not template.startswith(group):
            continue
        prefix, suffix = template.split("{}")
        field = name[len(prefix):len(name) - len(suffix)] if suffix else name[len(prefix):]
        if name.startswith(prefix) and name.endswith(suffix) and field in literals:
            return True
    return False


def config_keys() -> set[str]:
    """Every key of the run's config and every prefix of one (`rollout.val` as `rollout.val.n`)."""
    from megarl.config import load_config
    from megarl.config_loader import flatten_config

    keys = flatten_config(load_config(None, []))
    return {".".join(k.split(".")[:i]) for k in keys for i in range(2, k.count(".") + 2)}


@pytest.fixture(scope="module")
def run_metrics(tiny_reference) -> dict[str, list[int]]:
    return logged_by(tiny_reference)


def test_the_page_has_one_row_per_metric():
    names = [r.name for r in page_rows()]
    assert len(names) > 40
    assert len(set(names)) == len(names), sorted(n for n in names if names.count(n) > 1)


def test_every_metric_the_run_logged_has_one_row(run_metrics):
    rows = page_rows()
    for name in run_metrics:
        matching = [r.name for r in rows if r.pattern.fullmatch(name)]
        assert len(matching) == 1, f"{name}, logged by the tiny run, matches {matching or 'no row'} of docs/metrics.md"


def test_rows_logged_every_step_or_at_validation_were_so_in_the_run(run_metrics):
    for row in page_rows():
        if row.conditional:
            continue
        seen = {name: steps for name, steps in run_metrics.items() if row.pattern.fullmatch(name)}
        assert seen, f"docs/metrics.md: {row.name} is logged '{row.logged}', but the tiny run never logged it"
        for name, steps in seen.items():
            assert steps == RUN_STEPS[row.logged], f"{name} ({row.logged}) was logged at steps {steps}"


def test_conditional_rows_name_their_setting_and_a_metric_the_source_builds():
    literals, templates = source_strings()
    for row in page_rows():
        if not row.conditional:
            continue
        assert SETTING.search(row.logged), (f"docs/metrics.md: {row.name} is logged '{row.logged}': say "
                                            f"'{EVERY_STEP}', '{VALIDATION}', or name the setting as `key=value`")
        assert built_in_source(row.name, literals, templates), f"docs/metrics.md: no code under megarl/ builds {row.name}"


def test_the_settings_the_page_names_are_config_keys():
    known = config_keys()
    for row in page_rows():
        for cell in row.cells[1:]:
            for key in SETTING.findall(cell):
                assert key in known, f"docs/metrics.md: the row of {row.name} names `{key}`, not a config key"


@pytest.mark.parametrize("name, built", [
    ("rollout/engine_restarts", True),        # a literal of megarl/rollout/sglang.py
    ("rollout/engine_restart", False),
    ("timing/update_critic_s", True),         # f"timing/{phase}_s" and "update_critic"
    ("timing/update_critics_s", False),
    ("timing/update_critic", False),          # the suffix is part of the name
    ("critic/vf_loss", True),                 # f"critic/{k}" and "vf_loss"
    ("critic/vf_loss_mean", False),
    ("val/pass_at_<n>", True),                # f"val/pass_at_{v.n}"
    ("val/pass_<n>", False),
])
def test_built_in_source_reads_names_from_the_source(name, built):
    assert built_in_source(name, *source_strings()) is built
