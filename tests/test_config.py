"""The run configuration: DAPO defaults, YAML + overrides, and one clear error per bad input."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest
import yaml

from megarl.config import ConfigError, RunConfig, load_config, save_config
from megarl.config_loader import dotted_keys, flatten_config

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def problems_of(overrides: list[str], path=None) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return [(p.key, f"{p.what} | {p.fix}") for p in info.value.problems]


def test_defaults_follow_dapo():
    cfg = load_config(None, [])
    a = cfg.algorithm
    assert (a.clip_ratio_low, a.clip_ratio_high, a.clip_ratio_c) == (0.2, 0.28, 3.0)
    assert a.loss_agg_mode == "token-mean"
    assert not a.use_kl_loss and not a.use_kl_in_reward
    assert a.dynamic_sampling.enable and a.dynamic_sampling.metric == "acc"
    assert (a.overlong.enable, a.overlong.buffer_len, a.overlong.penalty_factor) == (True, 4096, 1.0)
    assert cfg.rollout.max_response_length == 20480
    assert (cfg.data.train_batch_size, cfg.data.gen_batch_size, cfg.rollout.n) == (512, 1536, 16)
    assert cfg.rollout.temperature == 1.0
    assert (cfg.rollout.val.top_p, cfg.rollout.val.n) == (0.7, 32)
    o = cfg.actor.optim
    assert (o.lr, o.weight_decay, o.grad_clip, o.lr_scheduler) == (1e-6, 0.1, 1.0, "constant")
    assert o.lr_warmup_steps > 0


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({
        "algorithm": {"clip_ratio_high": 0.3, "adv_estimator": "rloo"},
        "data": {"train_files": ["a.parquet", "b.parquet"]},
        "actor": {"optim": {"lr": "1e-6"}},  # PyYAML reads 1e-6 as a string; numbers accept it
    }))
    cfg = load_config(path, ["algorithm.clip_ratio_high=0.35", "model.path=123", "data.val_files=v.parquet",
                             "rollout.num_engines=null", "reward.weights={accuracy: 1.0, format: 0.5}"])
    assert cfg.algorithm.clip_ratio_high == 0.35  # override beats file
    assert cfg.algorithm.adv_estimator == "rloo"  # file beats default
    assert cfg.data.train_files == ["a.parquet", "b.parquet"]
    assert cfg.actor.optim.lr == 1e-6 and isinstance(cfg.actor.optim.lr, float)
    assert cfg.model.path == "123"  # a string field keeps the text as typed
    assert cfg.data.val_files == ["v.parquet"]
    assert cfg.rollout.num_engines is None
    assert cfg.reward.weights == {"accuracy": 1.0, "format": 0.5}


def test_nested_override_keeps_section_defaults():
    # The critic's optimizer defaults differ from the actor's; touching one key keeps the others.
    cfg = load_config(None, ["critic.optim.weight_decay=0.0", "rollout.val.n=4"])
    assert cfg.critic.optim.lr == 1e-5 and cfg.critic.optim.weight_decay == 0.0
    assert cfg.rollout.val.n == 4 and cfg.rollout.val.top_p == 0.7


@pytest.mark.parametrize("override, key, suggestion", [
    ("algorithm.clip_ratio_hgih=0.3", "algorithm.clip_ratio_hgih", "algorithm.clip_ratio_high"),
    ("clip_ratio_high=0.3", "clip_ratio_high", "algorithm.clip_ratio_high"),  # right leaf, wrong section
    ("algorithms.gamma=1.0", "algorithms", "algorithm"),
    ("actor.optim.learning_rate=1e-6", "actor.optim.learning_rate", None),
    ("data.train_batchsize=8", "data.train_batchsize", "data.train_batch_size"),
])
def test_unknown_key_suggests_nearest(override, key, suggestion):
    (found,) = problems_of([override])
    assert found[0] == key
    assert "unknown key" in found[1]
    if suggestion:
        assert f"did you mean '{suggestion}'" in found[1]


@pytest.mark.parametrize("override, expected", [
    ("data.train_batch_size=abc", "an integer"),
    ("data.train_batch_size=8.5", "an integer"),
    ("data.train_batch_size=true", "an integer"),
    ("algorithm.clip_ratio_low=high", "a number"),
    ("data.shuffle=maybe", "true or false"),
    ("actor.optim.betas=0.9", "a list of numbers"),
    ("algorithm=0.2", "a mapping"),
    ("reward.weights=[accuracy]", "a mapping of strings to numbers"),
])
def test_wrong_type(override, expected):
    (found,) = problems_of([override])
    assert found[0] == override.split("=")[0]
    assert expected in found[1]


@pytest.mark.parametrize("override, bound", [
    ("rollout.top_p=1.5", "<= 1.0"),
    ("rollout.top_p=0", "> 0.0"),
    ("algorithm.clip_ratio_low=1.0", "< 1.0"),
    ("algorithm.clip_ratio_c=1.0", "> 1.0"),
    ("data.train_batch_size=0", "> 0"),
    ("rollout.temperature=-0.5", ">= 0.0"),
    ("agent.retrieval.port=70000", "< 65536"),
    ("actor.optim.lr=0", "> 0.0"),
])
def test_out_of_range(override, bound):
    (found,) = problems_of([override])
    assert found[0] == override.split("=")[0]
    assert "out of range" in found[1] and bound in found[1]


@pytest.mark.parametrize("overrides, key, words", [
    (["data.train_batch_size=512", "actor.ppo_mini_batch_size=48"], "actor.ppo_mini_batch_size", "does not divide"),
    (["rollout.n=3", "actor.ppo_mini_batch_size=32", "actor.ppo_micro_batch_size=5"], "actor.ppo_micro_batch_size",
     "32 prompts x rollout.n=3 = 96"),
    (["algorithm.clip_ratio_high=0.1"], "algorithm.clip_ratio_high", "below algorithm.clip_ratio_low"),
    (["algorithm.overlong.buffer_len=20480"], "algorithm.overlong.buffer_len", "not below rollout.max_response_length"),
    (["data.gen_batch_size=256"], "data.gen_batch_size", "smaller than data.train_batch_size"),
    (["algorithm.adv_estimator=gae"], "algorithm.adv_estimator", "needs a critic"),
    (["algorithm.adv_estimator=ppo"], "algorithm.adv_estimator", "neither a registered advantage estimator"),
    (["rollout.n=1", "actor.ppo_micro_batch_size=1"], "rollout.n", "no baseline"),
    (["algorithm.use_kl_loss=true", "algorithm.use_kl_in_reward=true"], "algorithm.use_kl_loss", "twice"),
    (["actor.parallel.tensor_model_parallel_size=2"], "actor.parallel", "torch backend"),
    (["actor.fp8=hybrid"], "actor.fp8", "megatron"),
    (["reward.custom_function=mymodule.score"], "reward.custom_function", "module.path:function"),
    # the reward code's rule: a bare name must be a built-in scorer
    (["reward.custom_function=my_reward"], "reward.custom_function", "module.path:function"),
    (["reward.weights={task_score: 1.0, soft_overlong: 1.0}"], "reward.weights",
     "the overlong penalty is algorithm.overlong (DAPO's soft overlong punishment, applied once, after the reward)"),
    (["reward.repetition_max_penalty=0.5"], "reward.repetition_max_penalty", "out of range"),
    (["rollout.engine=sglang", "rollout.tensor_parallel_size=2"], "rollout.tensor_parallel_size",
     "runs one TP rank per node | set rollout.nodes_per_engine=2"),
    (["rollout.engine=sglang", "rollout.sglang.server=embedded", "rollout.nodes_per_engine=2",
      "rollout.tensor_parallel_size=2"], "rollout.nodes_per_engine", "embedded server runs an engine in one process"),
    (["rollout.engine=sglang", "cluster.gpus_per_node=8", "cluster.nnodes=4", "rollout.tensor_parallel_size=12",
      "rollout.mode=disaggregated", "actor.parallel.data_parallel_size=16"], "rollout.tensor_parallel_size",
     "an engine of 12 GPUs on 2 node(s) of 8 GPUs does not fill them"),
    (["rollout.engine=sglang", "cluster.gpus_per_node=8", "cluster.nnodes=4", "rollout.tensor_parallel_size=8",
      "rollout.nodes_per_engine=2", "rollout.mode=disaggregated", "actor.parallel.data_parallel_size=16"],
     "rollout.nodes_per_engine", "an engine of 8 GPUs on 2 node(s) of 8 GPUs does not fill them"),
    (["rollout.engine=sglang", "rollout.sglang.server=embedded", "sync.transport=ipc"], "sync.transport",
     "needs GPUs"),
    (["sync.transport=nccl"], "sync.transport", "embedded engine takes weights in process"),
    (["sync.transport=carrier_pigeon"], "sync.transport", "is not a weight transport"),
    (["rollout.engine=sglang", "rollout.sglang.server=embedded", "cluster.launcher=inprocess"], "cluster.launcher",
     "cannot launch engine servers"),
    (["rollout.engine=sglang", "cluster.gpus_per_node=8", "rollout.mode=disaggregated", "rollout.num_engines=1",
      "rollout.tensor_parallel_size=16"],
     "rollout.tensor_parallel_size", "spans 2 nodes, more than cluster.nnodes=1"),
    (["rollout.engine=sglang", "cluster.gpus_per_node=8", "rollout.mode=disaggregated", "sync.transport=ipc"],
     "sync.transport", "colocated"),
    (["rollout.engine=sglang", "cluster.gpus_per_node=8", "sync.transport=nccl"], "sync.transport",
     "two ranks on one device"),
    (["agent.max_turns=2", "agent.max_turn_length=4096", "rollout.max_response_length=1024",
      "algorithm.overlong.buffer_len=256", "agent.retrieval.index_dir=idx"],
     "agent.max_turn_length", "exceeds rollout.max_response_length"),
    (["agent.max_turns=2"], "agent.retrieval", "nothing serves the searches"),
    (["actor.backend=megatron", "cluster.launcher=inprocess"], "cluster.launcher", "one process per rank"),
    # 8 GPUs at TP=2: DP=4 does not split a mini batch of 1 prompt x rollout.n=2 samples
    (["actor.backend=megatron", "cluster.gpus_per_node=8", "actor.parallel.tensor_model_parallel_size=2",
      "rollout.n=2", "actor.ppo_mini_batch_size=1", "actor.ppo_micro_batch_size=1"], "actor.ppo_mini_batch_size",
     "2 samples does not split over 4 data-parallel ranks"),
    (["actor.backend=megatron", "cluster.gpus_per_node=6", "actor.parallel.tensor_model_parallel_size=4"],
     "actor.parallel", "TP x PP x CP = 4 does not divide the 6 train ranks"),
    (["actor.backend=megatron", "cluster.gpus_per_node=6", "actor.parallel.expert_model_parallel_size=4",
      "actor.ppo_mini_batch_size=6", "data.train_batch_size=12", "data.gen_batch_size=12"],
     "actor.parallel", "expert TP x EP x PP = 4 does not divide the 6 train ranks"),
    (["actor.parallel.expert_model_parallel_size=2"], "actor.parallel", "sets TP/PP/CP/EP > 1 with the torch backend"),
    (["rollout.engine=sglang", "cluster.gpus_per_node=8", "rollout.tensor_parallel_size=4", "rollout.mode=disaggregated",
      "rollout.expert_parallel_size=3"], "rollout.expert_parallel_size", "3 does not divide the engine's 4 GPUs"),
    (["actor.backend=megatron", "critic.enable=true", "algorithm.adv_estimator=gae"], "critic.backend",
     "torch differs from actor.backend=megatron"),
    (["actor.backend=megatron", "critic.enable=true", "critic.backend=megatron", "algorithm.adv_estimator=gae",
      "actor.parallel.tensor_model_parallel_size=2"], "critic.parallel", "differs from actor.parallel"),
])
def test_inconsistent_values(overrides, key, words):
    found = problems_of(overrides)
    assert [k for k, _ in found] == [key]
    assert words in found[0][1]


def test_sync_verify_on_sglangs_own_server_is_the_probe():
    # SGLang's own servers report no HF checksums: the probe checks them, and sync.verify needs it on
    (problem,) = problems_of(["rollout.engine=sglang", "sync.verify=true", "sync.probe.enable=false", "model.path=m"])
    assert problem[0] == "sync.verify" and "set sync.probe.enable=true, or sync.verify=false" in problem[1]
    cfg = load_config(None, ["rollout.engine=sglang", "sync.verify=true", "model.path=m"])
    assert not cfg.engines_report_checksums() and cfg.sync.probe.enable
    cfg = load_config(None, ["rollout.engine=sglang", "rollout.sglang.server=embedded", "sync.verify=true",
                             "sync.probe.enable=false", "model.path=m"])
    assert cfg.engines_report_checksums()


@pytest.mark.parametrize("overrides, tolerance, bound", [
    (["model.dtype=float32"], 1e-4, 1e-3),  # the CPU
    (["model.dtype=float32", "cluster.gpus_per_node=8"], 1e-3, 1e-2),
    (["model.dtype=bfloat16", "cluster.gpus_per_node=8"], 0.05, 0.5),
    (["sync.probe.tolerance=0.2", "sync.probe.gate_bound=0.3"], 0.2, 0.3),  # as set
])
def test_probe_tolerance_and_gate_bound_by_dtype_and_device(overrides, tolerance, bound):
    cfg = load_config(None, ["model.path=m", *overrides])
    assert cfg.probe_tolerance() == pytest.approx(tolerance) and cfg.gate_bound() == pytest.approx(bound)


def test_a_mixture_of_experts_gets_ten_times_the_tolerance(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_moe", "num_experts": 128}')
    cfg = load_config(None, [f"model.path={tmp_path}", "model.dtype=bfloat16", "cluster.gpus_per_node=8"])
    assert cfg.probe_tolerance() == pytest.approx(0.5) and cfg.gate_bound() == pytest.approx(5.0)
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text('{"model_type": "qwen3", "num_experts": 0}')
    cfg = load_config(None, [f"model.path={dense}", "model.dtype=bfloat16", "cluster.gpus_per_node=8"])
    assert cfg.probe_tolerance() == pytest.approx(0.05)


def test_engines_across_nodes():
    """An engine of 16 GPUs on nodes of 8 spans 2 of them; on the CPU its TP ranks are its nodes."""
    from megarl.config_rollout import engine_nodes

    cfg = load_config(None, ["rollout.engine=sglang", "cluster.gpus_per_node=8", "cluster.nnodes=4",
                             "rollout.tensor_parallel_size=16", "rollout.mode=disaggregated",
                             "actor.parallel.data_parallel_size=16"])
    assert engine_nodes(cfg) == 2 and cfg.num_rollout_engines() == 1
    cfg = load_config(None, ["rollout.engine=sglang", "rollout.tensor_parallel_size=2", "rollout.nodes_per_engine=2"])
    assert engine_nodes(cfg) == 2
    assert engine_nodes(load_config(None, ["rollout.engine=sglang", "cluster.gpus_per_node=8",
                                           "rollout.tensor_parallel_size=4", "rollout.mode=disaggregated",
                                           "actor.parallel.data_parallel_size=4"])) == 1


def test_consistent_alternatives_pass():
    # The fixes the errors suggest are accepted.
    load_config(None, ["algorithm.adv_estimator=gae", "critic.enable=true"])
    load_config(None, ["actor.backend=megatron", "actor.parallel.tensor_model_parallel_size=8",
                       "actor.parallel.pipeline_model_parallel_size=2", "actor.fp8=e4m3"])
    load_config(None, ["rollout.engine=sglang", "cluster.gpus_per_node=8"])
    load_config(None, ["rollout.engine=sglang", "rollout.sglang.server=embedded", "sync.transport=nccl"])
    load_config(None, ["actor.backend=megatron", "cluster.gpus_per_node=8", "actor.parallel.tensor_model_parallel_size=8",
                       "rollout.engine=sglang", "rollout.tensor_parallel_size=4", "sync.transport=ipc"])


def test_all_problems_reported_together():
    found = problems_of(["algorithm.clip_ratio_hgih=0.3", "data.shuffle=maybe", "rollout.top_p=2"])
    assert sorted(k for k, _ in found) == ["algorithm.clip_ratio_hgih", "data.shuffle", "rollout.top_p"]


@pytest.mark.parametrize("text, words", [
    ("algorithm: [1, 2\n", "not valid YAML"),
    ("- a\n- b\n", "not a mapping"),
])
def test_bad_files(tmp_path, text, words):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=words):
        load_config(path, [])


def test_missing_file_and_bad_override():
    with pytest.raises(ConfigError, match="config file not found"):
        load_config("no/such/file.yaml", [])
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["algorithm.clip_ratio_high"])


def test_save_and_reload_round_trip(tmp_path):
    cfg = load_config(None, ["algorithm.clip_ratio_high=0.3", "data.train_files=[x.parquet]",
                             "reward.weights={accuracy: 1.0}", "actor.optim.lr=3e-6"])
    path = save_config(cfg, tmp_path / "run" / "config.yaml")
    assert load_config(path, []) == cfg


def test_every_field_is_documented():
    def walk(schema, prefix=""):
        hints = typing.get_type_hints(schema)  # the annotations are strings (postponed evaluation)
        for f in dataclasses.fields(schema):
            assert f.metadata.get("help"), f"{prefix}{f.name} has no help text"
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], prefix + f.name + ".")
    walk(RunConfig)
    assert "algorithm.dynamic_sampling.max_num_gen_batches" in dotted_keys(RunConfig)


def test_rollout_sampling_keys_are_the_inherited_sampling_fields():
    # rollout.* takes SamplingConfig's fields (the training defaults); rollout.val has its own
    cfg = load_config(None, ["rollout.temperature=0.6", "rollout.val.top_k=20"])
    flat = flatten_config(cfg)
    names = ("temperature", "top_p", "top_k", "n")
    assert [flat[f"rollout.{k}"] for k in names] == [0.6, 1.0, -1, 16]
    assert [flat[f"rollout.val.{k}"] for k in names] == [1.0, 0.7, 20, 32]
    assert [k for k in dotted_keys(RunConfig) if k.startswith("rollout.") and k.rsplit(".", 1)[1] in names] == [
        "rollout.temperature", "rollout.top_p", "rollout.top_k", "rollout.n",
        "rollout.val.temperature", "rollout.val.top_p", "rollout.val.top_k", "rollout.val.n"]


def test_flatten_for_tracking():
    flat = flatten_config(load_config(None, ["reward.weights={accuracy: 1.0}"]))
    assert flat["algorithm.clip_ratio_high"] == 0.28
    assert flat["reward.weights.accuracy"] == 1.0
    assert flat["actor.optim.betas"] == [0.9, 0.999]


@pytest.mark.parametrize("path", sorted(EXAMPLES.rglob("*.yaml")), ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_example_configs_are_valid(path):
    load_config(path, [])


@pytest.mark.parametrize("overrides, world", [
    ([], 1),  # torch backend: one worker
    (["actor.backend=megatron", "actor.parallel.tensor_model_parallel_size=2"], 2),  # CPU run: DP = 1
    (["actor.backend=megatron", "actor.parallel.tensor_model_parallel_size=2", "actor.parallel.data_parallel_size=4"],
     8),
    (["actor.backend=megatron", "actor.parallel.tensor_model_parallel_size=2", "cluster.gpus_per_node=8",
      "cluster.nnodes=2"], 16),  # every GPU of the cluster
])
def test_train_world_size(overrides, world):
    assert load_config(None, overrides).train_world_size() == world


def test_dynamic_samplings_metric_is_acc_or_score_and_a_typo_is_named():
    # before: any string, and every one but "acc" quietly meant "score" (issue 61, item 6)
    with pytest.raises(ConfigError, match=r"algorithm\.dynamic_sampling\.metric: expects one of 'acc', 'score', got 'accc'"):
        load_config(None, ["algorithm.dynamic_sampling.metric=accc"])
    assert load_config(None, ["algorithm.dynamic_sampling.metric=score"]).algorithm.dynamic_sampling.metric == "score"


@pytest.mark.parametrize("override, words", [
    ("data.train_files=[a.parquet", "data.train_files: '[a.parquet' is not a YAML list"),  # not a file named "[a.parquet"
    ("agent.tools={python: {}", "agent.tools: '{python: {}' is not a YAML mapping"),
    ("trainer.output_dir=", "trainer.output_dir: is empty (it would be the current directory)"),
    ("trainer.output_dir=  ", "trainer.output_dir: is empty"),
])
def test_a_list_cut_short_and_an_empty_run_directory_are_named(override, words):
    # issue 61, item 6: both were accepted (a file name; the current directory)
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert words in str(e.value)
