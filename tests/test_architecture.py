"""The shape of the package (docs/architecture.md): no import circle anywhere in megarl/
(function-level and type-only imports included), no module importing from a layer above
its own, and no source file over 500 lines. Imports are read from the source (ast), so a
circle that Python happens to tolerate at run time still fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megarl"

# Lowest first. A module may import from its own layer and the layers below it. The longest
# matching prefix decides a module's layer.
LAYERS = [
    ("foundations", ["megarl", "megarl.errors", "megarl.config_loader", "megarl.versions", "megarl.termination",
                     "megarl.driver_loop", "megarl.memory"]),
    ("domain", ["megarl.algo", "megarl.models", "megarl.retrieval", "megarl.reward", "megarl.tools", "megarl.weights",
                "megarl.data.prompts", "megarl.data.tokenizer", "megarl.data"]),
    ("config", ["megarl.config", "megarl.config_algorithm", "megarl.config_cluster", "megarl.config_async",
                "megarl.config_megatron", "megarl.config_rollout"]),
    ("parts", ["megarl.backends", "megarl.rollout", "megarl.tracking", "megarl.checkpoint"]),
    ("runtime", ["megarl.runtime"]),
    ("loop", ["megarl.components", "megarl.experience", "megarl.export", "megarl.async_rollouts", "megarl.run_report",
              "megarl.train"]),
    ("commands", ["megarl.cli", "megarl.convert_command", "megarl.planner", "megarl.planner_config",
                  "megarl.planner_models", "megarl.planner_time", "megarl.preflight", "megarl.quickstart",
                  "megarl.data.prepare", "megarl.data.commands", "megarl.retrieval.commands", "megarl.rehearsal"]),
]


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The megarl modules `name` imports anywhere in its source (resolved to modules)."""
    def resolve(target: str) -> str | None:
        while target and target not in known:
            target = target.rpartition(".")[0]
        return target or None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {resolve(a.name) for a in node.names if a.name.split(".")[0] == "megarl"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "megarl":
                continue
            for alias in node.names:  # `from megarl.weights import disk` imports the module megarl.weights.disk
                full = f"{target}.{alias.name}"
                found.add(full if full in known else resolve(target))
    found.discard(None)
    found.discard(name)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path (first module repeated at the end), or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for start in sorted(edges):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def layer_of(module: str) -> int:
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    assert best is not None, f"{module} is in no layer of tests/test_architecture.py: place it"
    return best


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_import_reader_sees_function_level_and_relative_imports(tmp_path, monkeypatch):
    source = "import os\ndef f():\n    from megarl.config import RunConfig\n    from . import b\n"
    path = tmp_path / "a.py"
    path.write_text(source)
    known = {"megarl.x.a": path, "megarl.x.b": path, "megarl.config": path}
    assert imports_of("megarl.x.a", path, known) == {"megarl.config", "megarl.x.b"}


def test_no_import_circle_in_megarl():
    cycle = find_cycle(graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_no_module_imports_from_a_layer_above_its_own():
    upward = [f"{m} ({LAYERS[layer_of(m)][0]}) imports {d} ({LAYERS[layer_of(d)][0]})"
              for m, deps in sorted(graph().items()) for d in sorted(deps) if layer_of(d) > layer_of(m)]
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize("folder", ["megarl", "ckpt_convert", "tools", "tests"])
def test_no_file_over_500_lines(folder):
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / folder).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 500}
    assert not long, f"split these by concern: {long}"


def test_the_readme_stays_under_16_kb():
    size = len((ROOT / "README.md").read_bytes())
    assert size < 16_000, f"README.md is {size} bytes: 16 KB is the bar; move detail to docs/"
