"""`megarl plan --config RUN.yaml [key=value ...]` (megarl.planner_config): the planner's
settings come from the run's config and overrides, a flag given wins, and what neither gives
is asked for by name."""

from __future__ import annotations

import json

import pytest
import yaml

from megarl.cli import build_parser
from megarl.planner_config import settle


def plan_args(*argv: str):
    return build_parser().parse_args(["plan", *argv])


@pytest.fixture
def run_file(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"path": str(model)},
        "data": {"max_prompt_length": 1000, "train_batch_size": 8, "gen_batch_size": 24},
        "rollout": {"engine": "sglang", "max_response_length": 3000, "n": 4},
        "actor": {"backend": "megatron", "max_tokens_per_gpu": 5000},
        "algorithm": {"use_kl_loss": True, "overlong": {"buffer_len": 100}},
        "trainer": {"sleep_during_generation": False},
        "cluster": {"nnodes": 3, "gpus_per_node": 4}}))
    return path, model


def test_the_settings_come_from_the_run_and_its_overrides(run_file):
    path, model = run_file
    args = plan_args("--config", str(path), "rollout.n=2", "critic.enable=true", "critic.backend=megatron")
    settle(args)
    got = {k: getattr(args, k) for k in ("model", "nodes", "gpus_per_node", "max_prompt_length", "max_response_length",
                                         "max_tokens_per_gpu", "rollout_batch", "kl", "critic", "no_sleep",
                                         "rollout_gpus")}
    assert got == {"model": str(model), "nodes": 3, "gpus_per_node": 4, "max_prompt_length": 1000,
                   "max_response_length": 3000, "max_tokens_per_gpu": 5000, "rollout_batch": 24 * 2, "kl": True,
                   "critic": True, "no_sleep": True, "rollout_gpus": 0}


def test_a_flag_wins_over_the_run(run_file):
    path, _ = run_file
    args = plan_args("--config", str(path), "--model", "Qwen/Qwen2.5-7B", "--nodes", "2", "--max-response-length", "7")
    settle(args)
    assert (args.model, args.nodes, args.max_response_length, args.max_prompt_length) == ("Qwen/Qwen2.5-7B", 2, 7, 1000)


def test_disaggregated_engines_get_the_gpus_the_actor_leaves(run_file):
    path, _ = run_file
    args = plan_args("--config", str(path), "rollout.mode=disaggregated", "actor.parallel.tensor_model_parallel_size=2",
                     "actor.parallel.data_parallel_size=2")
    settle(args)
    assert args.rollout_gpus == 3 * 4 - 2 * 2


def test_without_a_config_the_old_defaults_hold():
    args = plan_args("--model", "Qwen/Qwen2.5-7B", "--nodes", "1")
    settle(args)
    assert (args.max_prompt_length, args.max_response_length, args.rollout_batch, args.gpus_per_node, args.kl,
            args.rollout_gpus) == (2048, 20480, 8192, 8, False, 0)


@pytest.mark.parametrize("argv, message", [
    (["--nodes", "1"], "which model\\? Give --model"),
    (["--model", "Qwen/Qwen2.5-7B"], "how many nodes\\? Give --nodes"),
    (["--model", "Qwen/Qwen2.5-7B", "--nodes", "1", "rollout.n=2"], "'rollout.n=2': key=value overrides need --config"),
])
def test_what_is_missing_is_asked_for(argv, message):
    with pytest.raises(ValueError, match=message):
        settle(plan_args(*argv))


def test_fp8_comes_from_the_actors_setting(run_file):
    path, _ = run_file
    args = plan_args("--config", str(path))
    settle(args)
    assert args.fp8 is False
    args = plan_args("--config", str(path), "actor.fp8=hybrid")
    settle(args)
    assert args.fp8 is True
