"""Turning YAML and ``key=value`` overrides into a checked dataclass tree.

Generic over the schema (`megarl.config.RunConfig` is the one we use): unknown keys get the
nearest valid key as a suggestion, values are checked against the field's annotation and its
declared bounds, and then the schema's own `check_consistency` runs. Every problem found is
reported together in one `ConfigError`, before any heavy work starts.

Schemas declare their fields with `param` (help text and bounds). This module imports nothing
of megarl, so that any package (the reward workers, for one) can define its own section of
the run config with it.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import tempfile
import types
import typing
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal

import yaml


def param(default: Any = None, help: str = "", *, factory=None, ge=None, gt=None, le=None, lt=None,
          secret: bool = False):
    """A documented dataclass field: `help` says its meaning and unit; the bounds (>=, >, <=, <)
    are checked by `check_ranges`. Give mutable defaults as `factory`. A `secret` (an API key)
    is left out of every dump of the config (`config_to_dict`: saved config, tracker params) and
    of its repr."""
    meta = {"help": help, "ge": ge, "gt": gt, "le": le, "lt": lt, "secret": secret}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta, repr=not secret)
    return dataclasses.field(default=default, metadata=meta, repr=not secret)


class ConfigError(ValueError):
    """A bad run configuration: the message lists every problem with its key and its fix."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        lines = [f"invalid config ({len(problems)} problem{'s' if len(problems) > 1 else ''}):"]
        lines += [f"  - {p}" for p in problems]
        super().__init__("\n".join(lines))


@dataclass(frozen=True)
class Problem:
    key: str
    what: str
    fix: str

    def __str__(self) -> str:
        return f"{self.key}: {self.what}\n      fix: {self.fix}"


class Problems:
    """Collects problems so that the user sees all of them at once."""

    def __init__(self) -> None:
        self.items: list[Problem] = []

    def add(self, key: str, what: str, fix: str) -> None:
        self.items.append(Problem(key, what, fix))

    def raise_if_any(self) -> None:
        if self.items:
            raise ConfigError(self.items)


@dataclass(frozen=True)
class _Override:
    """A command-line value: the raw text (for str fields) and its YAML reading (for the rest)."""

    text: str
    value: Any


def parse_override(item: str) -> tuple[str, _Override]:
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError([Problem(item, "is not a key=value override", "write e.g. algorithm.clip_ratio_high=0.28")])
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError as e:
        if text.lstrip()[:1] in ("[", "{"):  # a list or a mapping cut short: never a plain string
            raise ConfigError([Problem(key, f"{text!r} is not a YAML {'list' if text.lstrip()[0] == '[' else 'mapping'} "
                                            f"({getattr(e, 'problem', None) or e})",
                                       "close it: e.g. data.train_files=[a.parquet,b.parquet] or "
                                       "agent.tools={python: {}}, quoted in the shell")]) from None
        value = text
    return key, _Override(text, value)


def read_yaml(path: str | os.PathLike) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError([Problem(str(path), "config file not found", "pass the path of an existing YAML file")])
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError([Problem(str(path), f"is not valid YAML ({e})", "fix the YAML syntax at the position shown")])
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([Problem(str(path), f"holds a {type(data).__name__}, not a mapping of sections",
                                   "write sections such as 'algorithm:' at the top level")])
    return data


def load_config(schema: type, path: str | os.PathLike | None, overrides: list[str], consistent: bool = True):
    """YAML file (optional) + overrides -> an instance of `schema`, fully validated (each field;
    with `consistent`, the rules across fields too)."""
    raw = read_yaml(path) if path is not None else {}
    for item in overrides:
        key, value = parse_override(item)
        _set_dotted(raw, key.split("."), value)
    problems = Problems()
    cfg = _build(schema(), raw, "", problems, valid_keys=sorted(dotted_keys(schema)))
    check_ranges(cfg, "", problems)
    problems.raise_if_any()  # rules across fields assume each field is well-formed
    if consistent:
        cfg.check_consistency(problems)
        problems.raise_if_any()
    return cfg


def _set_dotted(tree: dict, parts: list[str], value: Any) -> None:
    for part in parts[:-1]:
        child = tree.get(part)
        if not isinstance(child, dict):
            child = tree[part] = {}
        tree = child
    tree[parts[-1]] = value


def dotted_keys(schema: type, prefix: str = "") -> list[str]:
    """Every valid dotted key of a schema, sections included."""
    keys = []
    for f in fields(schema):
        key = prefix + f.name
        keys.append(key)
        tp = _hints(schema)[f.name]
        if is_dataclass(tp):
            keys += dotted_keys(tp, key + ".")
    return keys


def _hints(schema: type) -> dict[str, Any]:
    return typing.get_type_hints(schema)


def _suggest(key: str, valid_keys: list[str]) -> str:
    close = difflib.get_close_matches(key, valid_keys, n=1, cutoff=0.6)
    if not close:  # the right leaf under the wrong section, e.g. clip_ratio_high at top level
        leaf = key.rsplit(".", 1)[-1]
        close = [k for k in valid_keys if k.rsplit(".", 1)[-1] == leaf][:1]
    if not close:
        leaves = {k.rsplit(".", 1)[-1]: k for k in valid_keys}
        near = difflib.get_close_matches(key.rsplit(".", 1)[-1], list(leaves), n=1, cutoff=0.75)
        close = [leaves[near[0]]] if near else []
    return f"did you mean '{close[0]}'?" if close else "remove it (see `megarl train --dry-run` for the valid keys)"


def _build(node: Any, raw: Any, prefix: str, problems: Problems, valid_keys: list[str]):
    """Apply `raw` onto `node` (a dataclass holding the defaults, which may differ from the
    class defaults, e.g. the critic's learning rate) and return it."""
    schema = type(node)
    if isinstance(raw, _Override):
        raw = raw.value
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        problems.add(prefix.rstrip(".") or "<root>", f"must be a mapping of keys, got {raw!r}", "write it as a YAML section")
        return node
    hints = _hints(schema)
    names = {f.name for f in fields(schema)}
    for key, value in raw.items():
        full = f"{prefix}{key}"
        if key not in names:
            problems.add(full, "unknown key", _suggest(full, valid_keys))
            continue
        tp = hints[key]
        if is_dataclass(tp):
            setattr(node, key, _build(getattr(node, key), value, full + ".", problems, valid_keys))
        else:
            ok, converted, expected = _coerce(value, tp)
            if ok:
                setattr(node, key, converted)
            else:
                shown = value.text if isinstance(value, _Override) else value
                problems.add(full, f"expects {expected}, got {shown!r} ({type(_plain(value)).__name__})",
                             f"give {expected}")
    return node


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, _Override) else value


def _coerce(value: Any, tp: Any) -> tuple[bool, Any, str]:
    """(ok, converted value, description of the expected type) for one annotated field."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        expected = " or ".join(_coerce(None, a)[2] for a in inner) + " or null"
        if _plain(value) is None:
            return True, None, expected
        for a in inner:
            ok, converted, _ = _coerce(value, a)
            if ok:
                return True, converted, expected
        return False, None, expected
    text = value.text if isinstance(value, _Override) else None
    value = _plain(value)
    if tp is Any:  # an extension's own settings: checked by the extension
        return True, value, "any value"
    if origin is Literal:
        expected = "one of " + ", ".join(repr(a) for a in args)
        if text is not None and text in args:
            return True, text, expected
        return (value in args and not isinstance(value, bool)), value, expected
    if tp is bool:
        return isinstance(value, bool), value, "true or false"
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value, "an integer"
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value), "a number"
        if isinstance(value, str):  # PyYAML reads 1e-6 (no dot) as a string
            try:
                return True, float(value), "a number"
            except ValueError:
                pass
        return False, None, "a number"
    if tp is str:
        if text is not None:
            return True, text, "a string"
        return isinstance(value, str), value, "a string"
    if origin is list:
        (item_tp,) = args
        expected = f"a list of {_plural(item_tp)}"
        if item_tp is str and isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            return False, None, expected
        out = []
        for item in value:
            ok, converted, _ = _coerce(item, item_tp)
            if not ok:
                return False, None, expected
            out.append(converted)
        return True, out, expected
    if origin is dict:
        key_tp, val_tp = args
        expected = f"a mapping of {_plural(key_tp)} to {_plural(val_tp)}"
        if not isinstance(value, dict):
            return False, None, expected
        out = {}
        for k, v in value.items():
            ok_k, k2, _ = _coerce(k, key_tp)
            ok_v, v2, _ = _coerce(v, val_tp)
            if not (ok_k and ok_v):
                return False, None, expected
            out[k2] = v2
        return True, out, expected
    raise TypeError(f"config schema uses an unsupported annotation {tp!r}")


def _plural(tp: Any) -> str:
    return {int: "integers", float: "numbers", str: "strings", bool: "booleans", Any: "values"}.get(tp, str(tp))


def check_ranges(cfg: Any, prefix: str, problems: Problems) -> None:
    """Check every field's declared bounds (`param(ge=..., gt=..., le=..., lt=...)`)."""
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        key = prefix + f.name
        if is_dataclass(value):
            check_ranges(value, key + ".", problems)
            continue
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        m = f.metadata
        bounds = [("ge", ">=", lambda v, b: v >= b), ("gt", ">", lambda v, b: v > b),
                  ("le", "<=", lambda v, b: v <= b), ("lt", "<", lambda v, b: v < b)]
        failed = [f"{sym} {m[name]}" for name, sym, ok in bounds if m.get(name) is not None and not ok(value, m[name])]
        if failed:
            allowed = " and ".join(f"{sym} {m[name]}" for name, sym, _ in bounds if m.get(name) is not None)
            problems.add(key, f"{value} is out of range", f"use a value {allowed}")


def config_to_dict(cfg: Any) -> dict:
    """The config as plain data, each secret field null (a secret set in the config stays in the
    file it came from; reloading this dump leaves the field unset)."""
    out = dataclasses.asdict(cfg)
    _drop_secrets(cfg, out)
    return out


def _drop_secrets(node: Any, out: dict) -> None:
    for f in fields(node):
        value = getattr(node, f.name)
        if f.metadata.get("secret"):
            out[f.name] = None
        elif is_dataclass(value):
            _drop_secrets(value, out[f.name])


def flatten_config(cfg: Any) -> dict[str, Any]:
    """Dotted key -> leaf value (for experiment-tracker params)."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        for k, v in node.items():
            if isinstance(v, dict) and v:
                walk(v, f"{prefix}{k}.")
            else:
                out[prefix + k] = v

    walk(config_to_dict(cfg), "")
    return out


def dump_config(cfg: Any) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False)


def save_config(cfg: Any, path: str | os.PathLike) -> Path:
    """Write the resolved config as YAML atomically (a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".config-", suffix=".yaml")
    with os.fdopen(fd, "w") as fh:
        fh.write(dump_config(cfg))
    os.replace(tmp, path)
    return path
