"""A tiny model directory and arithmetic prompt files for end-to-end loop tests, and the
reference run several of them compare with."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq
from filelock import FileLock

from tiny_models import tiny_model, tiny_tokenizer


def write_tiny_run_inputs(root: Path, num_train: int = 8, num_val: int = 2, family: str = "qwen2") -> dict[str, str]:
    tok = tiny_tokenizer()
    model = tiny_model(family, vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")

    def rows(n, offset):
        return [{"data_source": "math_dapo", "prompt": [{"role": "user", "content": f"{i} + {i + 1} = ? Answer:"}],
                 "reward_model": {"ground_truth": str(2 * i + 1)}, "extra_info": {"index": i}}
                for i in range(offset, offset + n)]

    pq.write_table(pa.Table.from_pylist(rows(num_train, 0)), root / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows(num_val, 100)), root / "val.parquet")
    return tiny_run_paths(root)


def tiny_run_paths(root: Path) -> dict[str, str]:
    """Where write_tiny_run_inputs(root) put the model and the prompt files."""
    return {"model": str(root / "model"), "train": str(root / "train.parquet"), "val": str(root / "val.parquet")}


def tiny_overrides(paths: dict[str, str], out: Path, steps: int = 2) -> list[str]:
    return [f"model.path={paths['model']}", "model.dtype=float32",
            f"data.train_files=[{paths['train']}]", f"data.val_files=[{paths['val']}]",
            "data.max_prompt_length=64", "data.train_batch_size=2", "data.gen_batch_size=2",
            "rollout.n=4", "rollout.max_response_length=12", "rollout.val.n=2", "rollout.val.temperature=0",
            "algorithm.overlong.buffer_len=4", "algorithm.dynamic_sampling.enable=false",
            "actor.ppo_mini_batch_size=1", "actor.ppo_micro_batch_size=2", "actor.optim.lr=1e-3",
            "actor.optim.lr_warmup_steps=0", f"trainer.output_dir={out}", f"trainer.total_training_steps={steps}",
            "trainer.test_freq=1", "trainer.save_freq=1", "reward.num_workers=0", "tracking.experiment_name=t",
            "cluster.launcher=inprocess"]


def hf_weights(directory: Path) -> dict:
    """The state dict of the HF model saved in `directory`."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory).state_dict()


def mlflow_metric(out: Path, name: str, experiment: str = "t") -> list[float]:
    """A metric's values by step from a run's local MLflow store (tiny_overrides' experiment "t")."""
    from mlflow.tracking import MlflowClient

    from megarl.tracking import local_store_uri

    client = MlflowClient(tracking_uri=local_store_uri(out))
    (r,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return [m.value for m in sorted(client.get_metric_history(r.info.run_id, name), key=lambda m: m.step)]


def built_once(tmp_path_factory, name: str, build: Callable[[Path], object]) -> Path:
    """`build(directory)` once per test session, by the first pytest-xdist worker that asks (the
    others wait for it and read what it wrote): a module fixture would run on every worker that
    gets one of its tests."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # shared by this session's workers only
    directory, done = root / name, root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            directory.mkdir(exist_ok=True)
            build(directory)
            done.touch()
    return directory


def tiny_reference_run(inputs: dict[str, str], out: Path) -> None:
    """Two steps of the tiny run on the torch backend with the in-process engine, the reward
    reward_fixtures.length_score (it varies with the length, so every step has advantages):
    what the megatron and fleet runs must end on (in one process: a Ray run of it ends on the
    same weights, test_train_loop)."""
    from megarl.config import load_config
    from megarl.train import train

    train(load_config(None, tiny_overrides(inputs, out, 2) + ["reward.custom_function=reward_fixtures:length_score"]))
