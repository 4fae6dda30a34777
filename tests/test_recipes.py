"""The slurm recipes assemble valid runs: each is executed with MEGARL_DRY_RUN=1 (no cluster:
`megarl train --dry-run` validates the config it would run) for the node count its #SBATCH
header declares, and the layout in it is the one `megarl plan` recommends."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "examples").glob("*/run_*_qwen*.sh"))


def run_recipe(recipe: Path, **env) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    environment.update(MEGARL_DRY_RUN="1", MEGARL_PYTHON=sys.executable, MEGARL_HOME=str(ROOT), **env)
    return subprocess.run(["bash", str(recipe)], cwd=ROOT, env=environment, capture_output=True, text=True,
                          timeout=300)


def declared_nodes(recipe: Path) -> int:
    return int(re.search(r"#SBATCH --nodes=(\d+)", recipe.read_text()).group(1))


def plan_model(recipe: Path) -> str:
    return re.search(r"PLAN_MODEL=\$\{PLAN_MODEL:-([^}]+)\}", recipe.read_text()).group(1)


def rollout_gpus(recipe: Path, nodes: int) -> list[str]:
    """The recipe's own GPUs for the engines (half of the job's, as its PLAN_ARGS say), if any."""
    return ["--rollout-gpus", str(nodes * 8 // 2)] if "--rollout-gpus" in recipe.read_text() else []


def test_every_recipe_is_covered():
    names = {r.name for r in RECIPES}
    assert {"run_dapo_qwen2.5_32b.sh", "run_dapo_qwen2.5_7b.sh", "run_search_r1_qwen2.5_7b.sh",
            "run_search_r1_qwen2.5_32b.sh", "run_dapo_qwen3_30b_a3b.sh", "run_dapo_qwen3_235b_a22b.sh"} <= names


CASES = [(r, "dapo") for r in RECIPES] + [(r, "ppo") for r in RECIPES if "search_r1" in r.name]


@pytest.mark.parametrize("recipe, algo", CASES, ids=lambda c: c.name if isinstance(c, Path) else c)
def test_recipe_assembles_a_valid_run_with_the_planned_layout(recipe, algo):
    nodes = declared_nodes(recipe)
    result = run_recipe(recipe, NNODES=str(nodes), ALGO=algo)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
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
    result = run_recipe(recipe, NNODES="4", SLURM_JOB_NUM_NODES="8")
    assert result.returncode == 2 and "NNODES=4 but the job has 8 nodes" in result.stderr


def test_the_dapo_recipe_keeps_the_papers_settings():
    cfg = yaml.safe_load((ROOT / "examples/dapo/dapo_qwen2.5_32b.yaml").read_text())
    assert (cfg["data"]["train_batch_size"], cfg["rollout"]["n"], cfg["data"]["gen_batch_size"]) == (512, 16, 1536)
    assert (cfg["rollout"]["max_response_length"], cfg["algorithm"]["overlong"]["buffer_len"]) == (20480, 4096)
    assert (cfg["algorithm"]["clip_ratio_low"], cfg["algorithm"]["clip_ratio_high"]) == (0.2, 0.28)
    assert cfg["algorithm"]["loss_agg_mode"] == "token-mean" and not cfg["algorithm"]["use_kl_loss"]
    optim = cfg["actor"]["optim"]
    assert (optim["lr"], optim["weight_decay"], optim["grad_clip"], optim["lr_scheduler"]) == (1e-6, 0.1, 1.0, "constant")
    assert cfg["rollout"]["val"] == {"temperature": 1.0, "top_p": 0.7, "n": 32}
