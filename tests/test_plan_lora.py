"""`megarl plan --lora RANK`: adapter counts, memory and step time worked out by hand from
Qwen2.5-32B's public config (h 5120, 64 layers, 40 heads and 8 KV heads of 128, SwiGLU 27648)."""

from __future__ import annotations

import pytest

from megarl.cli import main
from megarl.config_lora import LINEAR_MODULES
from megarl.planner import GiB, ModelShape, Workload, estimate, step_time

GPU = 80 * GiB
SHAPE = ModelShape.load("Qwen2.5-32B")


def test_adapter_counts_by_hand():
    # rank 32 on every linear layer, TP 1: A is r x in, B is out x r
    a = 32 * (5120 + 5120 + 5120 + 5120 + 5120 + 5120 + 27648)  # q k v o(in 5120) gate up down(in 27648)
    b = 32 * (5120 + 1024 + 1024 + 5120 + 27648 + 27648 + 5120)
    assert a + b == 4_194_304
    assert SHAPE.stage_lora_params(1, 1, 32, LINEAR_MODULES) == 64 * 4_194_304 == 2 ** 28
    # TP 8: a column-parallel layer's B split (q k v gate up), a row-parallel one's A split (o down)
    tp8 = 32 * (5 * 5120 + 5120 // 8 + 27648 // 8) + 32 * (640 + 128 + 128 + 3456 + 3456 + 5120 + 5120)
    assert tp8 == 1_527_808
    assert SHAPE.stage_lora_params(8, 1, 32, LINEAR_MODULES) == 64 * tp8
    # PP 2: half the layers a stage; only q and v
    qv = 16 * ((5120 + 5120 // 4) + (5120 + 1024 // 4))
    assert SHAPE.stage_lora_params(4, 2, 16, ("q_proj", "v_proj")) == 32 * qv


def test_the_base_is_frozen_and_is_the_reference():
    full = estimate(SHAPE, 8, 8, GPU, Workload(2048, 20480, kl=True), tp=8, pp=1)
    lora = estimate(SHAPE, 8, 8, GPU, Workload(2048, 20480, kl=True, lora=32), tp=8, pp=1)
    adapters = 64 * 1_527_808
    assert lora.weights == int(full.weights + 2 * adapters)  # the base in bf16 and the adapters
    assert lora.grads == 4 * adapters and lora.optimizer == 12 * adapters  # DP 1
    assert lora.reference == 0 and full.reference == full.weights
    assert lora.activations == full.activations and lora.logits == full.logits
    critic = estimate(SHAPE, 8, 8, GPU, Workload(2048, 20480, critic=True, lora=32), tp=8, pp=1)
    assert critic.critic == full.weights + full.grads + full.optimizer  # the critic trains every weight


def test_training_takes_two_thirds_of_the_flops():
    work, lora = Workload(2048, 20480), Workload(2048, 20480, lora=32)
    e = estimate(SHAPE, 8, 8, GPU, lora, tp=8, pp=1)
    full_t, lora_t = (step_time(SHAPE, e, 1, 8, w, 1024, 10240) for w in (work, lora))
    assert lora_t.training == pytest.approx(full_t.training * 4 / 6)
    assert (lora_t.generation, lora_t.log_probs, lora_t.weight_sync) == \
        (full_t.generation, full_t.log_probs, full_t.weight_sync)  # merged: the whole model is synced


def test_qwen2_5_32b_fits_one_node_colocated_with_lora(capsys):
    """The case the planner is for: Qwen2.5-32B with LoRA on one node of 8 H100 (80 GB), the engines
    colocated. Without LoRA the same node needs full recomputation and the optimizer on the host."""
    assert main(["plan", "--model", "Qwen/Qwen2.5-32B", "--nodes", "1", "--lora", "32", "--kl", "--overrides"]) == 0
    recommended = capsys.readouterr().out.split()
    assert {"actor.gradient_checkpointing=false", "actor.optim.offload=false", "actor.lora.r=32",
            "rollout.mode=colocated"} <= set(recommended)
    assert main(["plan", "--model", "Qwen/Qwen2.5-32B", "--nodes", "1", "--kl", "--overrides"]) == 0
    assert {"actor.gradient_checkpointing=true", "actor.optim.offload=true"} <= set(capsys.readouterr().out.split())


def test_the_rank_and_layers_come_from_the_runs_config(tmp_path, capsys):
    (tmp_path / "run.yaml").write_text("actor:\n  lora:\n    r: 8\n    target_modules: [q_proj, v_proj]\n")
    assert main(["plan", "--config", str(tmp_path / "run.yaml"), "--model", "Qwen/Qwen2.5-32B", "--nodes", "1"]) == 0
    assert "LoRA rank 8 on q_proj, v_proj, the base frozen" in capsys.readouterr().out
