"""`megarl train --dry-run`: validates, prints the resolved config, exits non-zero on bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from megarl.cli import EXIT_CONFIG_ERROR, main


def write_data(path: Path, data_source: str, rows: int = 2) -> Path:
    from megarl.data.prepare import write_rows

    return write_rows([{"data_source": data_source, "prompt": [{"role": "user", "content": f"question {i}"}],
                        "reward_model": {"ground_truth": "an answer"}} for i in range(rows)], path)


def inputs(where: Path, data_source: str = "nq") -> list[str]:
    """A run's inputs as the dry run checks them (the model there, its weights unread; the data's
    rows read), as overrides. nq: routed to exact match."""
    (where / "model").mkdir()
    (where / "model" / "config.json").write_text("{}")
    write_data(where / "train.parquet", data_source)
    return [f"model.path={where / 'model'}", f"data.train_files=[{where / 'train.parquet'}]"]


def test_dry_run_prints_resolved_config(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("algorithm:\n  clip_ratio_high: 0.3\n")
    given = inputs(tmp_path)
    before = sorted(tmp_path.iterdir())
    assert main(["train", str(path), "rollout.n=8", *given, "--dry-run"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["algorithm"]["clip_ratio_high"] == 0.3
    assert printed["rollout"]["n"] == 8
    assert printed["algorithm"]["clip_ratio_low"] == 0.2
    assert sorted(tmp_path.iterdir()) == before  # nothing written


def test_a_dry_run_names_every_missing_input(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bare").mkdir()  # a model directory without its config.json
    (tmp_path / "train.parquet").write_bytes(b"")
    (tmp_path / "val.jsonl").mkdir()  # a directory is no data file
    code = main(["train", "model.path=bare", "data.train_files=[train.parquet,more.parquet]",
                 "data.val_files=[val.jsonl]", "agent.max_turns=2", "agent.retrieval.index_dir=index",
                 "trainer.resume=runs/step_000003", "--dry-run"])
    err = capsys.readouterr().err
    assert code == EXIT_CONFIG_ERROR and "config OK" not in err
    assert err.splitlines()[1:] == [
        "  - model.path=bare: the directory has no config.json (an HF model directory has one)",
        "  - data.train_files: more.parquet: no such file",
        "  - data.val_files: val.jsonl: no such file",
        "  - agent.retrieval.index_dir=index: no such directory (megarl retrieval build writes it)",
        "  - trainer.resume=runs/step_000003: no such checkpoint directory"]
    assert err.splitlines()[0] == "megarl: the run's inputs are not all there (5 missing):"


def test_a_hub_model_counts_when_it_is_in_the_local_cache(tmp_path, monkeypatch):
    """A hub name is fine once downloaded into the HF cache (every node then needs that cache)."""
    import huggingface_hub.constants

    from megarl.config import load_config
    from megarl.preflight import missing_inputs

    snapshot = tmp_path / "hub" / "models--Org--Tiny" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "hub" / "models--Org--Tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--Org--Tiny" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.jsonl").write_bytes(b"")
    assert missing_inputs(load_config(None, ["model.path=Org/Tiny", "data.train_files=[t.jsonl]"])) == []
    missing = missing_inputs(load_config(None, ["model.path=Org/Other", "data.train_files=[t.jsonl]"]))
    assert len(missing) == 1 and missing[0].startswith("model.path=Org/Other: no such directory here") \
        and "hf download Org/Other --local-dir models/Other" in missing[0]
    # issue 61, item 5: a local directory is not a hub id, and a quickstart's model is prepared, not downloaded
    for path, words in [("models/Qwen2.5-32B", "hf download Qwen/Qwen2.5-32B --local-dir models/Qwen2.5-32B)"),
                        ("models/Mystery-7B", "hf download ORG/Mystery-7B --local-dir models/Mystery-7B)"),
                        ("outputs/quickstart/model", "a quickstart's prepare step makes it; run its make target first"),
                        ("build/real-model/smollm2-135m", "`make real-model` makes it")]:
        (missing,) = missing_inputs(load_config(None, [f"model.path={path}", "data.train_files=[t.jsonl]"]))
        assert missing.startswith(f"model.path={path}: no such directory here") and words in missing, missing


def test_a_dry_run_imports_the_reward_functions_and_binds_their_signatures(tmp_path, capsys):
    """A module that is not there, or a function of another call, stops the dry run naming the
    setting (before: "config OK", and the run failed after its model loaded)."""
    given = inputs(tmp_path)
    cases = [("reward.custom_function=no_such_module_here:score", "reward.custom_function",
              "cannot import module 'no_such_module_here'"),
             ("reward.custom_function=reward_fixtures:scorer_shaped", "reward.custom_function",
              "takes (solution_str, ground_truth, extra_info=None), but megarl calls it as fn(data_source, "),
             ("reward.data_sources={nq: no_such_module_here:score}", "reward.data_sources.nq",
              "cannot import module 'no_such_module_here'")]
    for override, key, words in cases:
        assert main(["train", *given, override, "--dry-run"]) == EXIT_CONFIG_ERROR, override
        err = capsys.readouterr().err
        assert f"{key}: {key} " in err and words in err and "fix: name an importable function" in err, err
    assert main(["train", *given, "reward.custom_function=reward_fixtures:length_score", "--dry-run"]) == 0


def test_a_dry_run_reads_the_datas_sources_and_refuses_rows_no_reward_scores(tmp_path, capsys):
    given = inputs(tmp_path, data_source="mystery_set")
    write_data(tmp_path / "val.parquet", "nq", rows=3)
    assert main(["train", *given, f"data.val_files=[{tmp_path / 'val.parquet'}]", "--dry-run"]) == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert err.splitlines()[0] == "megarl: the run's start would refuse it (1 problem):"
    assert "no reward scores data_source 'mystery_set' (2 rows)" in err and "config OK" not in err
    # routed by the config: the same data passes
    assert main(["train", *given, "reward.data_sources={mystery_set: search_r1_em}", "--dry-run"]) == 0
    capsys.readouterr()
    (tmp_path / "cut.jsonl").write_text('{"data_source": "nq", "prompt": "q"}\n')
    assert main(["train", *given, f"data.val_files=[{tmp_path / 'cut.jsonl'}]", "--dry-run"]) == EXIT_CONFIG_ERROR
    assert f"{tmp_path / 'cut.jsonl'} row 1: missing column 'reward_model'" in capsys.readouterr().err


def test_a_dry_run_compares_the_config_with_the_checkpoint_it_would_resume(tmp_path, capsys):
    from megarl.config import load_config
    from megarl.config_loader import flatten_config

    out = tmp_path / "run"
    given = [*inputs(tmp_path), f"trainer.output_dir={out}"]
    step = out / "checkpoints" / "step_000005"
    step.mkdir(parents=True)  # the meta.json of a checkpoint as the run writes it: the run's flattened config
    (step / "meta.json").write_text(json.dumps({"step": 5, "config": flatten_config(load_config(None, given))}))
    assert main(["train", *given, "--dry-run"]) == 0  # the same run: resumed
    assert main(["train", *given, "trainer.save_freq=7", "--dry-run"]) == 0  # operational: may change
    capsys.readouterr()
    assert main(["train", *given, "actor.optim.lr=3e-6", "--dry-run"]) == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert f"the config changes what the run at {step} was learning" in err and "actor.optim.lr: 1e-06 -> 3e-06" in err
    assert main(["train", *given, "actor.optim.lr=3e-6", "trainer.resume=disable", "--dry-run"]) == 0
    (step / "meta.json").write_text("{not json")
    assert main(["train", *given, "--dry-run"]) == EXIT_CONFIG_ERROR
    assert "is damaged (not valid JSON" in capsys.readouterr().err


def test_bad_config_exits_with_key_and_fix(capsys):
    assert main(["train", "algorithm.clip_ratio_high=0.1", "--dry-run"]) == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert "algorithm.clip_ratio_high" in err and "fix:" in err


def test_run_saves_resolved_config(tmp_path):
    out = tmp_path / "run"
    # no model at model.path: the run stops with a clear error, after saving its config
    assert main(["train", f"trainer.output_dir={out}", "algorithm.clip_ratio_high=0.3",
                 f"model.path={tmp_path / 'no-model'}"]) == 1
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["algorithm"]["clip_ratio_high"] == 0.3
    assert saved["trainer"]["output_dir"] == str(out)


def test_console_script_entry_point(tmp_path):
    exe = Path(sys.executable).with_name("megarl")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "megarl.cli"]
    bad = subprocess.run(cmd + ["train", "clip_ratio_hgh=0.3", "--dry-run"], capture_output=True, text=True,
                         env={**os.environ}, cwd=tmp_path, timeout=120)
    assert bad.returncode == EXIT_CONFIG_ERROR
    assert "did you mean 'algorithm.clip_ratio_high'" in bad.stderr
    good = subprocess.run(cmd + ["train", *inputs(tmp_path), "--dry-run"], capture_output=True, text=True, cwd=tmp_path,
                          timeout=120)
    assert good.returncode == 0 and "clip_ratio_high: 0.28" in good.stdout


def test_version_names_megarl_and_the_libraries_in_one_line(capsys):
    import tomllib

    import pytest
    import torch

    with pytest.raises(SystemExit) as stopped:
        main(["--version"])
    assert stopped.value.code == 0
    line = capsys.readouterr().out
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    python = ".".join(map(str, sys.version_info[:3]))
    # the distribution's version, read without importing torch: the PyPI CUDA build's is 2.14.1 where
    # torch says 2.14.1+cu130 (the CPU wheel's carries +cpu in both)
    torch_release = torch.__version__.split("+")[0]
    assert line.startswith(f"megarl {pyproject['project']['version']} (python {python}, torch {torch_release}")
    assert line.count("\n") == 1 and line.endswith(")\n")


def test_a_run_without_an_output_dir_is_named_after_its_config_file(tmp_path):
    from megarl.config import load_config

    (tmp_path / "grpo_small.yaml").write_text("model:\n  path: m\n")
    (tmp_path / "dapo_big.yaml").write_text("model:\n  path: m\n")
    assert load_config(str(tmp_path / "grpo_small.yaml")).trainer.output_dir == "outputs/grpo_small"
    assert load_config(str(tmp_path / "dapo_big.yaml")).trainer.output_dir == "outputs/dapo_big"
    assert load_config(None, ["model.path=m"]).trainer.output_dir == "outputs/run"
    assert load_config(str(tmp_path / "dapo_big.yaml"), ["trainer.output_dir=/x/y"]).trainer.output_dir == "/x/y"


def test_the_command_line_and_a_plan_import_no_torch():
    # the CLI's promise: configuration errors, plans and help come before anything heavy (a
    # recipe asks `megarl plan` on every submission; torch and transformers take seconds)
    code = ("import sys\nfrom megarl.cli import main\n"
            "assert main(['plan', '--model', 'Qwen2.5-7B', '--nodes', '1', '--overrides']) == 0\n"
            "print(sorted(m for m in ('torch', 'transformers', 'ray') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"
