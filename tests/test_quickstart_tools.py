"""The tool-use quickstart: its world, its demonstrations (laid out exactly as the agent loop
lays out a call), a tiny run through its config, and (test-slow) the Python variant learning
to call its tool."""

from __future__ import annotations

import asyncio
import os
import shutil
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient
from transformers import AutoTokenizer

from megarl.config import load_config
from megarl.quickstart import ToolSettings, prepare_tools
from megarl.quickstart.__main__ import main
from megarl.quickstart.tool_task import Product, call_pieces, read_products
from megarl.reward.scoring import RewardRequest, score_one
from megarl.tracking import local_store_uri
from megarl.train import train

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "quickstart" / "tools_tiny.yaml"
TINY = replace(ToolSettings(), num_train=40, num_val=8, vocab_size=600, hidden_size=32, num_heads=4, num_kv_heads=2,
               read_steps=3, mix_steps=3, batch_size=4)
NEEDS_BWRAP = pytest.mark.skipif(shutil.which("bwrap") is None and not os.environ.get("CI"),
                                 reason="the python tool needs bubblewrap (make setup installs it)")


def test_a_calling_demonstration_is_the_calculators_own_exchange():
    assert call_pieces(Product(37, 48), "calculator") == [
        ("<calculator> 37 * 48 </calculator>", 1), ("\n\n<result>1776</result>\n\n", 0), ("<answer> 1776 </answer>", 1)]


@NEEDS_BWRAP
def test_the_python_demonstrations_observation_is_what_the_sandbox_returns():
    from megarl.tools.base import ToolSet
    from megarl.tools.python import PythonTool

    call, observation, answer = call_pieces(Product(37, 48), "python")
    tools = ToolSet([PythonTool()])
    assert asyncio.run(tools.run(tools.parse(call[0]))).text == observation[0] == "\n\n<output>1776\n</output>\n\n"


def test_the_world_asks_products_scored_by_exact_match(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = prepare_tools(Path("outputs/quickstart_tools"), TINY)
    train_items, val_items = read_products(out / "data" / "train.parquet"), read_products(out / "data" / "val.parquet")
    assert (len(train_items), len(val_items)) == (40, 8) and not set(train_items) & set(val_items)
    assert all(10 <= x.a <= 99 and 10 <= x.b <= 99 for x in train_items + val_items)
    reward = load_config(str(CONFIG), []).reward  # the config routes calculator_world to exact match
    item = val_items[0]
    truth = pq.read_table(out / "data" / "val.parquet").to_pylist()[0]["reward_model"]["ground_truth"]
    assert truth == {"target": [str(item.a * item.b)]}

    def acc(response: str) -> bool:
        return score_one(reward, RewardRequest("calculator_world", response, truth)).acc

    assert acc(f"<answer> {item.a * item.b} </answer>") and not acc("<answer> 1 </answer>")
    tok = AutoTokenizer.from_pretrained(out / "model")
    assert [tok.decode([t]) for t in tok.encode("1776", add_special_tokens=False)] == ["1", "7", "7", "6"]


@pytest.mark.slow
def test_the_tools_config_trains_on_prepared_inputs(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    prepare_tools(Path("outputs/quickstart_tools"), TINY)
    cfg = load_config(str(CONFIG), ["trainer.total_training_steps=1", "data.train_batch_size=2",
                                    "data.gen_batch_size=2", "rollout.n=2", "actor.ppo_mini_batch_size=2",
                                    "actor.ppo_micro_batch_size=4", "cluster.launcher=ray", "cluster.cpus_per_node=3",
                                    "algorithm.dynamic_sampling.enable=false", "agent.tools={calculator: {ray: true}}"])
    assert list(cfg.agent.tools) == ["calculator"] and not cfg.agent.uses_search()
    train(cfg)
    placement = next(line for line in capfd.readouterr().err.splitlines() if line.startswith("megarl placement:"))
    assert "agent tools" in placement and "retrieval" not in placement  # the tool's actor; no retrieval server
    client = MlflowClient(tracking_uri=local_store_uri(Path("outputs/quickstart_tools/run")))
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert {m.step for m in client.get_metric_history(run.info.run_id, "val/acc")} == {0, 1}
    assert client.get_metric_history(run.info.run_id, "rollout/tool_calls_mean")


def test_command_line(tmp_path, monkeypatch):
    import megarl.quickstart.__main__ as qs

    seen = []
    monkeypatch.setattr(qs, "prepare_tools", lambda out, settings, force=False: seen.append((out, settings, force)))
    assert main(["prepare-tools", str(tmp_path)]) == 0
    assert main(["prepare-tools", str(tmp_path), "--tool", "python", "--warmup-steps", "20", "--force"]) == 0
    assert seen == [(str(tmp_path), ToolSettings(), False),
                    (str(tmp_path), ToolSettings(tool="python", read_steps=20, mix_steps=20), True)]
    with pytest.raises(SystemExit):
        main(["prepare-tools", str(tmp_path), "--tool", "shell"])


@pytest.mark.slow
@pytest.mark.full
@NEEDS_BWRAP
def test_the_python_variant_learns_to_call_its_tool(tmp_path, monkeypatch):
    """`make quickstart-tools-python`, shortened to 5 steps: validation accuracy (greedy)
    rises by at least 0.3 as the model learns that running the product in Python pays."""
    monkeypatch.chdir(tmp_path)
    root = Path("outputs/quickstart_tools_python")
    prepare_tools(root, ToolSettings(tool="python"))
    cfg = load_config(str(CONFIG), [f"model.path={root}/model", f"data.train_files=[{root}/data/train.parquet]",
                                    f"data.val_files=[{root}/data/val.parquet]", "agent.tools={python: {}}",
                                    f"trainer.output_dir={root}/run", "trainer.total_training_steps=5",
                                    "trainer.test_freq=5", "trainer.save_freq=5", "cluster.launcher=inprocess"])
    train(cfg)
    client = MlflowClient(tracking_uri=local_store_uri(root / "run"))
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    val = [m.value for m in sorted(client.get_metric_history(run.info.run_id, "val/acc"), key=lambda m: m.step)]
    calls = client.get_metric_history(run.info.run_id, "rollout/tools/python/calls_mean")
    assert val[-1] - val[0] >= 0.3, val
    assert calls and max(m.value for m in calls) > 0.5
