"""The quickstart's inputs and config, end to end at a tiny scale."""

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient
from transformers import AutoModelForCausalLM, AutoTokenizer

from megarl.config import load_config
from megarl.quickstart import CodeSettings, MathSettings, QuickstartSettings, prepare, prepare_code, prepare_math
from megarl.quickstart.__main__ import main
from megarl.quickstart.worlds import read_facts, read_sums
from megarl.tracking import local_store_uri
from megarl.train import train

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "quickstart" / "search_r1_tiny.yaml"
MATH_CONFIG = CONFIG.with_name("dapo_math_tiny.yaml")
TINY_MATH = replace(MathSettings(), max_operand=3, num_val=5, vocab_size=300, hidden_size=32, num_heads=4, num_kv_heads=2, bare_steps=2, steps=3,
                   batch_size=4)
TINY = replace(QuickstartSettings(), num_entities=12, vocab_size=600, hidden_size=32, num_heads=4, num_kv_heads=2,
               read_steps=3, mix_steps=3, batch_size=4)


def test_prepare_builds_inputs_once(tmp_path, capsys):
    out = prepare(tmp_path / "qs", TINY)
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    tok = AutoTokenizer.from_pretrained(out / "model")
    assert model.config.model_type == "qwen2" and model.config.vocab_size == len(tok)
    assert (out / "index" / "manifest.json").exists()
    assert len(read_facts(out / "data" / "train.parquet")) + len(read_facts(out / "data" / "val.parquet")) == 36
    stamp = json.loads((out / "prepared.json").read_text())
    assert stamp["settings"]["num_entities"] == 12 and stamp["stats"]["final_loss"] > 0
    before = (out / "model" / "model.safetensors").stat().st_mtime_ns
    capsys.readouterr()
    prepare(tmp_path / "qs", TINY)  # up to date: nothing is rebuilt
    assert "up to date" in capsys.readouterr().out
    assert (out / "model" / "model.safetensors").stat().st_mtime_ns == before
    assert not list(out.glob("*.tmp"))


def test_quickstart_config_trains_on_prepared_inputs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the config's paths are relative: outputs/quickstart/...
    prepare(Path("outputs/quickstart"), TINY)
    cfg = load_config(str(CONFIG), ["trainer.total_training_steps=1", "data.train_batch_size=2",
                                    "data.gen_batch_size=2", "rollout.n=2", "actor.ppo_mini_batch_size=2",
                                    "actor.ppo_micro_batch_size=4", "cluster.launcher=inprocess",
                                    "algorithm.dynamic_sampling.enable=false"])  # an untrained model fails every group
    train(cfg)
    out = Path("outputs/quickstart/run")
    client = MlflowClient(tracking_uri=local_store_uri(out))
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert {m.step for m in client.get_metric_history(run.info.run_id, "val/acc")} == {0, 1}
    assert client.get_metric_history(run.info.run_id, "rollout/search_calls_mean")
    assert (out / "hf" / "model.safetensors").exists()
    assert "val/acc:" in capsys.readouterr().out


def test_command_line(tmp_path, monkeypatch):
    import megarl.quickstart.__main__ as qs

    seen = {}
    monkeypatch.setattr(qs, "prepare", lambda out, settings, force=False: seen.update(search=out, force=force,
                                                                                     settings=settings))
    monkeypatch.setattr(qs, "prepare_math", lambda out, settings, force=False: seen.update(math=out,
                                                                                          math_settings=settings))
    assert main(["prepare", str(tmp_path), "--force"]) == 0
    assert main(["prepare-math", str(tmp_path / "m")]) == 0
    assert seen == {"search": str(tmp_path), "force": True, "math": str(tmp_path / "m"),
                    "settings": qs.QuickstartSettings(), "math_settings": qs.MathSettings()}
    assert main(["prepare-math", str(tmp_path / "m"), "--warmup-steps", "20"]) == 0  # a smoke model (the journey)
    assert (seen["math_settings"].bare_steps, seen["math_settings"].steps) == (20, 20)
    with pytest.raises(SystemExit):
        main(["prepare-math", str(tmp_path), "--warmup-steps", "0"])
    assert main(["prepare", str(tmp_path), "--warmup-steps", "20"]) == 0  # a smoke model (the slurm test)
    assert (seen["settings"].read_steps, seen["settings"].mix_steps) == (20, 20) and seen["force"] is False
    with pytest.raises(SystemExit):
        main(["prepare", str(tmp_path), "--warmup-steps", "0"])
    assert main(["prepare", str(tmp_path), "--think-words", "6"]) == 0  # the async bench's long tail
    assert seen["settings"].think_words == (6, 1.0, 96) and seen["settings"].read_steps == 400


def test_math_quickstart_config_trains_on_prepared_inputs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = prepare_math(Path("outputs/quickstart_math"), TINY_MATH)
    train_items, val_items = read_sums(out / "data" / "train.parquet"), read_sums(out / "data" / "val.parquet")
    assert len(train_items) == 16 and set(val_items) <= set(train_items)
    cfg = load_config(str(MATH_CONFIG), ["trainer.total_training_steps=1", "data.train_batch_size=2",
                                         "data.gen_batch_size=2", "rollout.n=2", "rollout.val.n=1",
                                         "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size=4",
                                         "cluster.launcher=inprocess", "algorithm.dynamic_sampling.enable=false"])
    assert cfg.agent.max_turns == 0
    train(cfg)
    client = MlflowClient(tracking_uri=local_store_uri(Path("outputs/quickstart_math/run")))
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    # the DAPO math reward scores every sample +1 or -1 (overlong shaping only lowers it)
    assert -2.0 <= client.get_metric_history(run.info.run_id, "train/reward_mean")[0].value <= 1.0
    assert {m.step for m in client.get_metric_history(run.info.run_id, "val/acc")} == {0, 1}


CODE_CONFIG = CONFIG.with_name("code_tiny.yaml")
TINY_CODE = replace(CodeSettings(), num_val=2, vocab_size=300, hidden_size=32, steps=3, batch_size=4)


@pytest.mark.skipif(shutil.which("bwrap") is None and not os.environ.get("CI"),
                    reason="the code reward needs bubblewrap (make setup installs it)")
def test_code_quickstart_config_trains_on_prepared_inputs(tmp_path, monkeypatch):
    # the whole path of a code run: open-r1 code rows, every sampled program run in the sandbox
    from megarl.quickstart.code_task import read_code_problems, response_text
    from megarl.reward import compute_score

    monkeypatch.chdir(tmp_path)
    out = prepare_code(Path("outputs/quickstart_code"), TINY_CODE)
    problems = read_code_problems(out / "data" / "train.parquet")
    assert len(problems) == 40 and set(read_code_problems(out / "data" / "val.parquet")) <= set(problems)
    row = pq.read_table(out / "data" / "train.parquet").to_pylist()[0]
    right = compute_score("code", response_text(problems[0].program()), row["reward_model"]["ground_truth"])
    assert right["score"] == 1.0  # the reference program passes its own test cases, in the sandbox
    cfg = load_config(str(CODE_CONFIG), ["trainer.total_training_steps=1", "data.train_batch_size=2",
                                         "data.gen_batch_size=2", "rollout.n=2", "rollout.val.n=1",
                                         "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size=4",
                                         "cluster.launcher=inprocess", "algorithm.dynamic_sampling.enable=false"])
    train(cfg)
    client = MlflowClient(tracking_uri=local_store_uri(Path("outputs/quickstart_code/run")))
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert 0.0 <= client.get_metric_history(run.info.run_id, "train/reward_mean")[0].value <= 1.0
    assert client.get_metric_history(run.info.run_id, "reward/failures")[0].value == 0
    assert {m.step for m in client.get_metric_history(run.info.run_id, "val/acc")} == {0, 1}


def test_reasoning_sections_have_a_long_tail():
    import random
    import statistics

    from megarl.quickstart.worlds import thinking

    rng = random.Random(0)
    words = [len(thinking(rng, 8, 1.0, 128).split()) - 2 for _ in range(4000)]  # less <think> and </think>
    # log-normal with median 8, sigma 1: P(> 8 e^1.2816 = 28.8) = 0.10, P(> 128 = 8 e^2.77) = 0.0028
    assert 7 <= statistics.median(words) <= 9
    assert 0.08 < sum(w > 28.8 for w in words) / len(words) < 0.12
    assert max(words) == 128 and 2 <= words.count(128) <= 25 and min(words) >= 1


def test_demonstrations_reason_before_each_action_when_asked():
    from megarl.data.tokenizer import train_bpe_tokenizer
    from megarl.quickstart.worlds import make_facts, warmup_examples

    facts = make_facts(6, seed=0)
    tok = train_bpe_tokenizer(["<think> </think> <search> </search> <answer> </answer> so the question"], 400)
    plain = warmup_examples(facts, tok, 0.5, seed=3)
    reasoned = warmup_examples(facts, tok, 0.5, seed=3, think=(4, 1.0, 16))
    assert [d.searched for d in plain] == [d.searched for d in reasoned]  # the same draws of actions
    for d in reasoned:
        text = tok.decode([t for t, m in zip(d.response_ids, d.loss_mask) if m])  # what the model writes
        assert text.startswith("<think>") and text.count("<think>") == 1 + d.searched
        assert text.count("</think> <answer>") == 1 and text.count("</think> <search>") == d.searched
    assert all("<think>" not in tok.decode(d.response_ids) for d in plain)
