"""The slurm recipes assemble valid runs: each is executed with MEGARL_DRY_RUN=1 (no cluster:
`megarl train --dry-run` validates the config it would run) for the node count its #SBATCH
header declares, and the layout in it is the one `megarl plan` recommends."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "examples").glob("*/run_*_qwen*.sh"))


def run_recipe(recipe: Path, *args: str, **env) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MEGARL_"))}
    environment.update(MEGARL_DRY_RUN="1", MEGARL_PYTHON=sys.executable, MEGARL_HOME=str(ROOT), **env)
    return subprocess.run(["bash", str(recipe), *args], cwd=ROOT, env=environment, capture_output=True, text=True,
                          timeout=300)


# each data file the recipes read, and the data_source megarl's data commands write in it
DATA_SOURCES = {"dapo-math-17k.parquet": "math_dapo", "aime-2024.parquet": "aime2024", "train.parquet": "nq",
                "test.parquet": "hotpotqa"}


def stand_ins(tmp_path: Path, model: str) -> dict[str, str]:
    """The recipes' inputs, as a dry run checks them: a model directory whose config.json is
    `model`'s public HF config (no weights), the data files each recipe reads (a few rows, as the
    data commands write them) and a BM25 index of a small corpus for the Search-R1 recipes."""
    from megarl.data.prepare import write_rows
    from megarl.planner_models import KNOWN_MODELS
    from megarl.retrieval import build_index

    model_dir, data = tmp_path / "model", tmp_path / "data"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(KNOWN_MODELS[model]))
    data.mkdir()
    for name, source in DATA_SOURCES.items():
        write_rows([{"data_source": source, "prompt": [{"role": "user", "content": f"question {i}"}],
                     "reward_model": {"ground_truth": "4"}} for i in range(2)], data / name)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "contents": f"passage {i}"}) + "\n" for i in range(3)))
    build_index(corpus, tmp_path / "index", kind="bm25", show_progress=False)
    return {"MEGARL_MODEL_PATH": str(model_dir), "MEGARL_DATA_DIR": str(data), "MEGARL_INDEX_DIR": str(tmp_path / "index")}


def declared_nodes(recipe: Path) -> int:
    return int(re.search(r"#SBATCH --nodes=(\d+)", recipe.read_text()).group(1))


def plan_model(recipe: Path) -> str:
    return re.search(r"MEGARL_PLAN_MODEL=\$\{MEGARL_PLAN_MODEL:-([^}]+)\}", recipe.read_text()).group(1)


def rollout_gpus(recipe: Path, nodes: int) -> list[str]:
    """The recipe's own GPUs for the engines (half of the job's, as its MEGARL_PLAN_ARGS say), if any."""
    return ["--rollout-gpus", str(nodes * 8 // 2)] if "--rollout-gpus" in recipe.read_text() else []


def test_every_recipe_is_covered():
    names = {r.name for r in RECIPES}
    assert {"run_dapo_qwen2.5_32b.sh", "run_dapo_qwen2.5_7b.sh", "run_search_r1_qwen2.5_7b.sh",
            "run_search_r1_qwen2.5_32b.sh", "run_dapo_qwen3_30b_a3b.sh", "run_dapo_qwen3_235b_a22b.sh"} <= names


CASES = [(r, "dapo") for r in RECIPES] + [(r, "ppo") for r in RECIPES if "search_r1" in r.name]


@pytest.mark.parametrize("recipe, algo", CASES, ids=lambda c: c.name if isinstance(c, Path) else c)
def test_recipe_assembles_a_valid_run_with_the_planned_layout(recipe, algo, tmp_path):
    nodes = declared_nodes(recipe)
    result = run_recipe(recipe, MEGARL_NNODES=str(nodes), MEGARL_ALGO=algo, **stand_ins(tmp_path, plan_model(recipe)))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    # the plan weighed the recipe's save_freq against its #SBATCH --time: a save within the job
    assert "step time, estimated" in result.stderr and "megarl plan: warning" not in result.stderr, result.stderr
    cfg = yaml.safe_load(result.stdout[result.stdout.index("\nmodel:") + 1:])
    assert cfg["cluster"]["nnodes"] == nodes and cfg["cluster"]["ray_address"] == "auto"
    plan_args = ["--max-prompt-length", str(cfg["data"]["max_prompt_length"]),
                 "--max-response-length", str(cfg["rollout"]["max_response_length"]),
                 "--max-tokens-per-gpu", str(cfg["actor"]["max_tokens_per_gpu"])]
    if algo == "ppo":
        plan_args += ["--critic", "--kl"]
        assert cfg["critic"]["enable"] and cfg["algorithm"]["adv_estimator"] == "gae"
    plan_args += rollout_gpus(recipe, nodes)
    planned = subprocess.run([sys.executable, "-m", "megarl.cli", "plan", "--model", plan_model(recipe), "--nodes",
                              str(nodes), *plan_args, "--overrides"], cwd=ROOT, capture_output=True, text=True,
                             check=True)
    for override in planned.stdout.split():
        key, value = override.split("=")
        section = cfg
        for part in key.split(".")[:-1]:
            section = section[part]
        assert str(section[key.split(".")[-1]]).lower() == value.lower(), override
    if "search_r1" in recipe.name:
        assert cfg["agent"]["retrieval"]["url"] == "http://retrieval-node:8000/retrieve"
        assert cfg["agent"]["retrieval"]["topk"] == 3 and cfg["agent"]["mask_observations"] is True


def planned_layout(model: str, nodes: int, cfg: dict, *extra: str) -> list[str]:
    args = ["--max-prompt-length", str(cfg["data"]["max_prompt_length"]),
            "--max-response-length", str(cfg["rollout"]["max_response_length"]),
            "--max-tokens-per-gpu", str(cfg["actor"]["max_tokens_per_gpu"]), *extra]
    return subprocess.run([sys.executable, "-m", "megarl.cli", "plan", "--model", model, "--nodes", str(nodes),
                           *args, "--overrides"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()


@pytest.mark.parametrize("config", sorted((ROOT / "examples").glob("*/*_qwen*.yaml")), ids=lambda p: p.name)
def test_an_example_config_holds_the_planned_layout_of_its_nodes(config):
    # run without its recipe (megarl train CONFIG on a cluster of cluster.nnodes nodes), a
    # config must hold what the planner recommends there, engine memory fraction included
    from megarl.config import load_config

    raw = yaml.safe_load(config.read_text())
    resolved = load_config(str(config), [])
    nodes = raw["cluster"]["nnodes"]
    engines = nodes * 8 - resolved.train_world_size() if resolved.rollout.mode == "disaggregated" else 0
    extra = ["--rollout-gpus", str(engines)] if engines else []
    for override in planned_layout(raw["model"]["path"], nodes, raw, *extra):
        key, value = override.split("=")
        found = resolved
        for part in key.split("."):
            found = getattr(found, part)
        if key.endswith("data_parallel_size") and not found:
            continue  # not given: the rest of the world, as planned
        assert str(found).lower() == value.lower(), f"{config.name}: {override}"


def test_a_recipe_refuses_a_node_count_other_than_the_jobs():
    recipe = ROOT / "examples/dapo/run_dapo_qwen2.5_32b.sh"
    result = run_recipe(recipe, MEGARL_NNODES="4", SLURM_JOB_NUM_NODES="8")
    assert result.returncode == 2 and "MEGARL_NNODES=4 but the job has 8 nodes" in result.stderr


def test_a_dry_run_outside_slurm_is_told_the_node_count():
    result = run_recipe(ROOT / "examples/dapo/run_dapo_qwen2.5_32b.sh")
    assert result.returncode == 2 and "how many nodes? Outside a slurm job set MEGARL_NNODES" in result.stderr
    assert "config OK" not in result.stderr


def test_a_recipes_dry_run_names_the_inputs_that_are_not_there(tmp_path):
    """As a new user runs it first: no model downloaded, no data prepared; each is named."""
    result = run_recipe(ROOT / "examples/dapo/run_dapo_qwen2.5_32b.sh", MEGARL_NNODES="8",
                        MEGARL_MODEL_PATH=str(tmp_path / "models/Qwen2.5-32B"), MEGARL_DATA_DIR=str(tmp_path / "data"))
    assert result.returncode == 2 and "config OK" not in result.stderr
    assert "the run's inputs are not all there (3 missing)" in result.stderr
    assert (f"model.path={tmp_path}/models/Qwen2.5-32B: no such directory here" in result.stderr
            and f"hf download Qwen/Qwen2.5-32B --local-dir {tmp_path}/models/Qwen2.5-32B" in result.stderr)
    for name in ["dapo-math-17k.parquet", "aime-2024.parquet"]:
        assert f"{tmp_path}/data/{name}: no such file" in result.stderr


def test_a_search_recipes_dry_run_checks_its_index(tmp_path):
    """The index the recipe's retrieval server would serve is read as serve opens it (before: a
    made-up URL, and a missing index found after the queue wait)."""
    recipe = ROOT / "examples/search_r1/run_search_r1_qwen2.5_7b.sh"
    inputs = stand_ins(tmp_path, plan_model(recipe))
    missing = run_recipe(recipe, MEGARL_NNODES="1", **{**inputs, "MEGARL_INDEX_DIR": str(tmp_path / "no-index")})
    assert missing.returncode == 2 and "config OK" not in missing.stderr
    assert (f"megarl retrieval check: index {tmp_path}/no-index: no such directory; build one with "
            "`megarl retrieval build`") in missing.stderr
    (tmp_path / "not-an-index").mkdir()
    stray = run_recipe(recipe, MEGARL_NNODES="1", **{**inputs, "MEGARL_INDEX_DIR": str(tmp_path / "not-an-index")})
    assert stray.returncode == 2 and "no manifest.json, so it is not an index" in stray.stderr
    found = run_recipe(recipe, MEGARL_NNODES="1", **inputs)
    assert found.returncode == 0, found.stderr[-3000:]
    assert f"index {tmp_path}/index: bm25, 3 documents of {tmp_path}/corpus.jsonl" in found.stdout


def test_a_recipe_plans_from_the_runs_own_settings(tmp_path):
    """An override of the run reaches its plan: responses of 8192 tokens are planned as such,
    not as the recipe's 20480 (the step-time estimate the recipe prints tells them apart)."""
    def estimate(response: int) -> str:
        return subprocess.run([sys.executable, "-m", "megarl.cli", "plan", "--model", "Qwen/Qwen2.5-32B", "--nodes", "8",
                               "--max-prompt-length", "2048", "--max-response-length", str(response),
                               "--max-tokens-per-gpu", "22528", "--rollout-batch", str(1536 * 16), "--estimate"],
                              cwd=ROOT, capture_output=True, text=True, check=True).stdout.splitlines()[0]

    result = run_recipe(ROOT / "examples/dapo/run_dapo_qwen2.5_32b.sh", "rollout.max_response_length=8192",
                        MEGARL_NNODES="8", **stand_ins(tmp_path, "Qwen/Qwen2.5-32B"))
    assert result.returncode == 0, result.stderr[-3000:]
    planned = estimate(8192)
    assert planned != estimate(20480) and planned in result.stderr.splitlines()


def test_the_dapo_recipe_keeps_the_papers_settings():
    cfg = yaml.safe_load((ROOT / "examples/dapo/dapo_qwen2.5_32b.yaml").read_text())
    assert (cfg["data"]["train_batch_size"], cfg["rollout"]["n"], cfg["data"]["gen_batch_size"]) == (512, 16, 1536)
    assert (cfg["rollout"]["max_response_length"], cfg["algorithm"]["overlong"]["buffer_len"]) == (20480, 4096)
    assert (cfg["algorithm"]["clip_ratio_low"], cfg["algorithm"]["clip_ratio_high"]) == (0.2, 0.28)
    assert cfg["algorithm"]["loss_agg_mode"] == "token-mean" and not cfg["algorithm"]["use_kl_loss"]
    optim = cfg["actor"]["optim"]
    assert (optim["lr"], optim["weight_decay"], optim["grad_clip"], optim["lr_scheduler"]) == (1e-6, 0.1, 1.0, "constant")
    assert cfg["rollout"]["val"] == {"temperature": 1.0, "top_p": 0.7, "n": 32}


def find_install(home: Path, *path: Path) -> subprocess.CompletedProcess:
    """megarl_install (tools/ray_on_slurm.sh) with MEGARL_HOME=home and PATH=path + the system's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGARL_")}
    env.update(MEGARL_HOME=str(home), PATH=":".join([*map(str, path), "/usr/bin", "/bin"]))
    return subprocess.run(["bash", "-c", f"source {ROOT / 'tools/ray_on_slurm.sh'}; megarl_install && "
                           'echo "$MEGARL_PY|$MEGARL_CMD|$MEGARL_RAY"'], env=env, capture_output=True, text=True,
                          timeout=60)


def wrapper(path: Path, target: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\nexec {target} "$@"\n')
    path.chmod(0o755)
    return path


def test_recipes_find_megarl_installed_without_a_venv(tmp_path):
    """`pip install` into a container's python (the GPU docs' way): no .venv in the repository;
    the python3 on PATH runs megarl, and its commands are found on PATH (pip put a system
    python's scripts in another directory)."""
    venv_bin = Path(sys.executable).parent
    python = wrapper(tmp_path / "usr/bin/python3", sys.executable)
    found = find_install(tmp_path / "repo", python.parent, venv_bin)
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip() == f"{python}|{venv_bin / 'megarl'}|{venv_bin / 'ray'}"


def test_the_repositorys_venv_comes_first(tmp_path):
    python = wrapper(tmp_path / "repo/.venv/bin/python", sys.executable)
    megarl = wrapper(tmp_path / "repo/.venv/bin/megarl", str(Path(sys.executable).parent / "megarl"))
    ray = wrapper(tmp_path / "repo/.venv/bin/ray", str(Path(sys.executable).parent / "ray"))
    other = wrapper(tmp_path / "usr/bin/python3", sys.executable)
    found = find_install(tmp_path / "repo", other.parent)
    assert found.returncode == 0 and found.stdout.strip() == f"{python}|{megarl}|{ray}", found.stderr


def test_a_python_without_megarl_is_named_with_what_to_do(tmp_path):
    python = wrapper(tmp_path / "usr/bin/python3", "false")
    found = find_install(tmp_path / "repo", python.parent)
    assert found.returncode == 2 and found.stdout == ""
    assert f"megarl: {python} cannot run megarl" in found.stderr and "docs/install.md#gpu-machine" in found.stderr


def test_sglang_in_an_environment_of_its_own_is_the_runs_server_python(tmp_path):
    """docs/install.md's container install: MEGARL_SGLANG_PYTHON becomes rollout.sglang.python;
    a path that is no python stops the recipe before anything starts, naming it."""
    inputs = stand_ins(tmp_path, "Qwen/Qwen2.5-32B")
    server_python = tmp_path / "sglang-env" / "bin" / "python"
    server_python.parent.mkdir(parents=True)
    server_python.symlink_to(sys.executable)
    result = run_recipe(ROOT / "examples/dapo/run_dapo_qwen2.5_32b.sh", MEGARL_NNODES="8",
                        MEGARL_SGLANG_PYTHON=str(server_python), **inputs)
    assert result.returncode == 0, result.stderr[-3000:]
    cfg = yaml.safe_load(result.stdout[result.stdout.index("\nmodel:") + 1:])
    assert cfg["rollout"]["engine"] == "sglang" and cfg["rollout"]["sglang"]["python"] == str(server_python)
    missing = run_recipe(ROOT / "examples/dapo/run_dapo_qwen2.5_32b.sh", MEGARL_NNODES="8",
                         MEGARL_SGLANG_PYTHON=str(tmp_path / "nowhere/python"), **inputs)
    assert missing.returncode == 2 and "config OK" not in missing.stderr
    assert f"MEGARL_SGLANG_PYTHON={tmp_path}/nowhere/python is not an executable python" in missing.stderr
