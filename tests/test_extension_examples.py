"""The examples of docs/extending.md, run as the page writes them: a tool (examples/tools/, the
file the page shows), an advantage estimator and a policy loss, a reward function and a data
source's reward, a scorer inside megarl, a weight transport, a wrapping engine. Each example's
code is read from the page itself, so the page cannot drift from what works."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megarl import weights
from megarl.config import ConfigError, load_config
from megarl.reward import registry
from megarl.weights.buckets import group_tensors
from megarl.weights.transport import RankPlace

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "extending.md"


def example(title: str, language: str = "python") -> str:
    """The first block of `language` after the heading `title` on the page."""
    text = PAGE.read_text()
    section = text[text.index(title):]
    return re.search(rf"```{language}\n(.*?)```", section, re.S).group(1)


@pytest.fixture
def module_from_page(tmp_path, monkeypatch):
    def load(name: str, title: str):
        (tmp_path / f"{name}.py").write_text(example(title))
        monkeypatch.syspath_prepend(str(tmp_path))
        sys.modules.pop(name, None)
        return importlib.import_module(name)
    return load


class OneRank:
    """Test double of TrainRanks: one source rank in this process."""

    def __init__(self):
        self.sender = None

    def places(self):
        return [RankPlace(rank=0, node="127.0.0.1", gpu="", stage=0, is_source=True)]

    def open_senders(self, senders):
        (self.sender,) = senders.values()
        self.sender.open()
        return lambda: None

    def push(self, bucket_bytes, version, stage=None):
        return self.sender.send(group_tensors(TENSORS.items(), bucket_bytes), version)


class LoadingEngines:
    """Test double of EngineServers: records what the engines were told to load."""

    def __init__(self):
        self.loaded = []

    async def load_from_disk(self, directory, version):
        self.loaded.append((directory, version))


TENSORS = {"a.weight": torch.arange(6.0).reshape(2, 3), "b.bias": torch.ones(4)}


def test_the_transport_example_is_two_files_of_work(module_from_page, monkeypatch, tmp_path):
    shm = module_from_page("shm_example", "## A weight transport")
    monkeypatch.setattr(shm, "ROOT", tmp_path / "shm")  # the page writes to /dev/shm
    monkeypatch.setitem(weights.TRANSPORTS, "shm", "shm_example:ShmTransport")  # the registry line

    fleet = ["rollout.engine=sglang", "rollout.sglang.server=embedded", "sync.transport=shm"]
    cfg = load_config(None, fleet)  # the config takes the new name, with the transport's own rules
    with pytest.raises(ConfigError, match="shm stays on one node"):
        load_config(None, fleet + ["cluster.nnodes=2"])
    with pytest.raises(ConfigError, match="shm is for engine servers"):
        load_config(None, ["sync.transport=shm"])

    engines, ranks = LoadingEngines(), OneRank()
    transport = weights.transport_class("shm")(cfg, engines)
    transport.connect(ranks)
    assert ranks.push(bucket_bytes=32, version=3) == 2  # 24 + 16 bytes: two buckets
    transport.finish(3)
    assert engines.loaded == [(str(tmp_path / "shm" / "v000003"), 3)]
    files = sorted((tmp_path / "shm" / "v000003").glob("*.safetensors"))
    got = {k: v for f in files for k, v in load_file(f).items()}
    assert set(got) == set(TENSORS) and all(torch.equal(got[k], TENSORS[k]) for k in TENSORS)


def test_the_scorer_example_is_one_decorated_function(module_from_page):
    from megarl.reward import scorers

    saved_scorers, saved_routes = dict(scorers.SCORERS), list(scorers.ROUTES)
    try:  # the tables are filled in place, as importing the module from registry.py would
        module_from_page("last_integer_example", "### A scorer inside megarl")
        right = registry.compute_score("counting", "3 apples and 4 pears: 7", 7)
        wrong = registry.compute_score("counting", "I count 8", "7")
        assert (right["score"], right["acc"], right["pred"]) == (1.0, True, "7")
        assert (wrong["score"], wrong["acc"]) == (0.0, False)
        assert registry.compute_score("counting", "no number", 7)["pred"] is None
        assert registry.compute_score("nq", "<answer> x </answer>", {"target": ["x"]})["acc"]  # the others stay
        load_config(None, ["reward.custom_function=last_integer"])  # a built-in name now
        with pytest.raises(ValueError, match="scorer name 'last_integer' is taken"):
            scorers.register_scorer("last_integer")(lambda *a: {})
        with pytest.raises(ValueError, match="data_source 'math' is already graded"):
            scorers.register_scorer("other_math", data_sources=("math",))(lambda *a: {})
    finally:
        scorers.SCORERS.clear()
        scorers.SCORERS.update(saved_scorers)
        scorers.ROUTES[:] = saved_routes


def test_the_tool_example_is_the_file_in_examples_and_runs_from_the_config(monkeypatch):
    import asyncio

    import yaml

    from megarl.tools import build_toolset

    assert example("## A tool") == (ROOT / "examples" / "tools" / "calculator.py").read_text()
    monkeypatch.syspath_prepend(str(ROOT))  # examples.tools.calculator, as the page's config names it
    agent = yaml.safe_load(example("## A tool", "yaml"))["agent"]
    cfg = load_config(None, [f"agent.max_turns={agent['max_turns']}", f"agent.tools={agent['tools']}"])
    tools = build_toolset(cfg.agent.tools)

    def observe(text):
        return asyncio.run(tools.run(tools.parse(text)))

    assert observe("<calc> 37 * 48 </calc>").text == "\n\n<result>1776</result>\n\n"
    assert observe("<calc>1 / 3</calc>").text == "\n\n<result>0.3333</result>\n\n"  # decimals: 4
    failed = observe("<calc>2 ^ 3</calc>")
    assert failed.failed and "Calc failed: write two numbers" in failed.text
    with pytest.raises(ConfigError, match="cannot take {'digits': 2}"):
        load_config(None, ["agent.max_turns=2", "agent.tools={calc: {class: 'examples.tools.calculator:"
                                                "TwoNumberCalculator', digits: 2}}"])


def test_the_estimator_and_loss_example_runs_from_the_config(module_from_page, monkeypatch):
    from megarl.algo import registry as algos
    from megarl.backends.loss import actor_loss
    from megarl.experience import compute_advantages, to_train_batch
    from test_algo_registry import GROUPS, LOSS_MASK, SCORES, micro_batch
    from test_experience import SAMPLES

    monkeypatch.setattr(algos, "ADVANTAGE_ESTIMATORS", dict(algos.ADVANTAGE_ESTIMATORS))
    module_from_page("my_algos", "## An advantage estimator or a policy loss")
    config = example("## An advantage estimator or a policy loss", "yaml").split()
    cfg = load_config(None, [f"algorithm.adv_estimator={config[2]}", f"algorithm.policy_loss={config[4]}"])
    advantages, _, _ = compute_advantages(to_train_batch(SAMPLES), SCORES, GROUPS, cfg.algorithm)
    # groups (1, 0) and (3, 0): GRPO gives each +-1/sqrt(2) (std of two values a, b: |a - b|/sqrt(2)); floored at 0
    per_row = [2 ** -0.5] * 5 + [0.0] * 3 + [2 ** -0.5] * 3 + [0.0] * 5
    torch.testing.assert_close(advantages, torch.tensor([a * m for a, m in zip(per_row, LOSS_MASK)]), atol=1e-5,
                               rtol=0)
    log_probs = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]], requires_grad=True)
    loss, metrics = actor_loss(log_probs, torch.zeros(2, 2), micro_batch(), cfg.algorithm, {})
    # -A·logp on the 3 loss tokens: 1·1 + 1·2 + (-2)·0.5 = 2, over 3 tokens
    assert loss.item() == pytest.approx(2 / 3) and metrics["pg_loss"] == pytest.approx(2 / 3)
    with pytest.raises(ConfigError, match="no baseline"):
        load_config(None, [f"algorithm.adv_estimator={config[2]}", "rollout.n=1"])  # needs_groups=True


def test_the_reward_example_scores_through_the_config(module_from_page):
    import yaml

    from megarl.reward.scoring import RewardRequest, score_one

    module_from_page("my_rewards", "## A reward function or a data source")
    routes = yaml.safe_load(example("## A reward function or a data source", "yaml"))["reward"]["data_sources"]
    routed = load_config(None, [f"reward.data_sources={routes}"]).reward
    custom = load_config(None, ["reward.custom_function=my_rewards:last_word_score"]).reward

    def acc(reward, data_source, response, truth):
        return score_one(reward, RewardRequest(data_source, response, truth)).acc

    assert acc(routed, "capitals", "It is Paris.", "paris") and not acc(routed, "capitals", "Paris, I think", "paris")
    assert acc(routed, "my_math", "Answer: 7", "7")  # dapo_math, by the route
    assert acc(routed, "nq", "<answer> Paris </answer>", {"target": ["Paris"]})  # the built-in routes stay
    assert acc(custom, "nq", "the answer is Paris", "Paris")  # every row, whatever its data_source


def test_the_engine_example_wraps_an_engine_in_the_agent_loop(module_from_page):
    import asyncio

    from megarl.rollout.agent import AgentSettings, run_trajectories
    from megarl.tools.base import ToolSet
    from megarl.tools.calculator import Calculator
    from test_rollout_agent import TOK, ScriptedEngine, ids

    counting = module_from_page("counting_engine", "## A rollout engine").CountingEngine
    turns = [ids("<calculator> 2 * 3 </calculator>"), ids("<answer> 6 </answer>")]
    engine = counting(ScriptedEngine(turns))
    settings = AgentSettings(max_turns=2, max_turn_length=64, max_response_length=500)
    (traj,) = asyncio.run(run_trajectories(engine, TOK, [ids("2*3?")], settings, ToolSet([Calculator()])))
    assert engine.tokens == len(turns[0]) + len(turns[1]) and traj.finish_reason == "answer"
    assert engine.params == engine.inner.params  # the rest is the inner engine's
