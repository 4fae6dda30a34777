"""`megarl plan` against numbers worked out by hand from the public configs (each written as
the arithmetic it came from, in the order of megarl/planner.py's docstring)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.cli import main
from megarl.planner import GiB, ModelShape, Workload, estimate, overrides, parse_bytes, plan_layouts

GPU = 80 * GiB


def test_parameter_counts():
    # Qwen2.5-7B: h 3584, 28 layers, 28 heads, 4 KV heads of 128, SwiGLU 18944, vocab 152064, untied
    layer_7b = (3584 * 3584 + 3584) + 2 * (3584 * 512 + 512) + 3584 * 3584 + 3 * 3584 * 18944 + 2 * 3584
    assert layer_7b == 233_057_792
    assert ModelShape.load("Qwen/Qwen2.5-7B").params() == 28 * layer_7b + 2 * 152064 * 3584 + 3584 == 7_615_616_512
    # Qwen2.5-32B: h 5120, 64 layers, 40 heads, 8 KV heads of 128, SwiGLU 27648
    layer_32b = (5120 * 5120 + 5120) + 2 * (5120 * 1024 + 1024) + 5120 * 5120 + 3 * 5120 * 27648 + 2 * 5120
    assert layer_32b == 487_605_248
    assert ModelShape.load("qwen2.5-32b").params() == 64 * layer_32b + 2 * 152064 * 5120 + 5120 == 32_763_876_352


def test_qwen2_5_32b_tp8_pp2_dp4_by_hand():
    shape = ModelShape.load("Qwen2.5-32B")
    e = estimate(shape, 64, 8, GPU, Workload(2048, 20480), tp=8, pp=2)
    # largest stage: 32 layers + the vocabulary padded to a multiple of 128 x 8 (152576) + the final norm
    stage = 32 * 487_605_248 + 152576 * 5120 + 5120
    assert e.weights == 2 * stage // 8 == 4_096_140_544
    assert e.grads == 4 * stage // 8
    assert e.optimizer == 12 * (stage // 8) // 4  # distributed over DP = 64 / 16
    tokens = 2048 + 20480
    per_layer = 2 * tokens * (4 * 5120 + (40 + 16) * 128 + 40 * 128 + 3 * 27648) // 8
    assert per_layer == 651_689_984
    assert e.activations == 64 * per_layer  # no recompute: stage 0 holds PP micro-batches of 32 layers
    assert e.logits == 8 * tokens * 152576 // 8
    assert e.train_peak == e.weights + e.grads + e.optimizer + e.activations + e.logits + 4 * GiB == 67_872_990_848
    assert e.problems == []
    # engines: 0.9 x 80 GiB - static - 4 GiB - 3 GiB; TP 2 would put 32.8 GB of weights in under 24.6 GiB
    budget = int(0.9 * GPU) - (e.weights + e.grads + e.optimizer) - 7 * GiB
    assert (e.engine_tp, e.engines) == (4, 16)
    assert e.engine_weights == 2 * 32_763_876_352 // 4
    assert e.kv_cache == budget - e.engine_weights
    assert e.kv_tokens == e.kv_cache // (2 * 64 * (8 // 4) * 128 * 2)  # K and V, 64 layers, 2 KV heads per GPU
    assert e.sequences_per_engine == e.kv_tokens // tokens
    assert e.rollout_waves == -(-8192 // (e.sequences_per_engine * 16))


def test_qwen2_5_7b_tp4_with_recompute_by_hand():
    shape = ModelShape.load("Qwen2.5-7B")
    work = Workload(max_prompt_length=1024, max_response_length=7168, max_tokens_per_gpu=16384)
    e = estimate(shape, 8, 8, GPU, work, tp=4, pp=1, recompute=True)
    assert e.dp == 2
    stage = 7_615_616_512  # PP = 1: everything; 152064 is already a multiple of 128 x 4
    assert e.weights == 2 * stage // 4 == 3_807_808_256
    assert e.optimizer == 12 * (stage // 4) // 2 == 11_423_424_768
    per_layer = 2 * 16384 * (4 * 3584 + (28 + 8) * 128 + 28 * 128 + 3 * 18944) // 4
    assert per_layer == 650_117_120
    assert e.activations == 28 * (2 * 16384 * 3584 // 4) + per_layer == 1_472_200_704
    assert e.logits == 8 * 16384 * 152064 // 4 == 4_982_833_152
    # static 3.81 + 7.62 + 11.42 GB = 21.3 GiB; budget 72 - 21.3 - 7 = 43.7 GiB: one GPU holds an engine's 15.2 GB
    assert (e.engine_tp, e.engines) == (1, 8)
    assert e.kv_tokens == e.kv_cache // (2 * 28 * 4 * 128 * 2)


def test_offload_reference_and_critic_terms():
    shape = ModelShape.load("Qwen2.5-7B")
    base = estimate(shape, 8, 8, GPU, Workload(), tp=4, pp=1, recompute=True)
    off = estimate(shape, 8, 8, GPU, Workload(), tp=4, pp=1, recompute=True, offload=True)
    ppo = estimate(shape, 8, 8, GPU, Workload(kl=True, critic=True), tp=4, pp=1, recompute=True)
    assert off.optimizer == 0 and off.train_peak == base.train_peak - base.optimizer
    assert ppo.reference == base.weights
    assert ppo.critic == base.weights + base.grads + base.optimizer


@pytest.mark.parametrize("tp, pp, words", [
    (8, 1, "TP=8 does not divide the 28 heads and 4 KV heads"),
    (4, 3, "PP=3 does not divide the 28 layers"),
    (16, 1, "TP=16 spans nodes"),
])
def test_layouts_that_cannot_work_say_why(tp, pp, words):
    e = estimate(ModelShape.load("Qwen2.5-7B"), 16, 8, GPU, Workload(), tp=tp, pp=pp)
    assert any(words in p for p in e.problems)


def test_a_model_too_big_for_the_cluster_has_no_layout():
    estimates = plan_layouts(ModelShape.load("Qwen2.5-72B"), 1, 8, 24 * GiB, Workload())
    assert estimates and all(e.problems for e in estimates)
    assert any("training needs" in p for e in estimates for p in e.problems)


def test_plan_prefers_layouts_without_offload_or_recompute():
    estimates = plan_layouts(ModelShape.load("Qwen2.5-32B"), 8, 8, GPU, Workload())
    best = estimates[0]
    assert (best.tp, best.pp, best.dp, best.recompute, best.offload) == (8, 2, 4, False, False)
    assert (best.engine_tp, best.engines) == (4, 16)
    feasible = [e for e in estimates if not e.problems]
    keys = [(e.offload, e.recompute, e.cp, e.pp, e.tp) for e in feasible]
    assert keys == sorted(keys)


def test_qwen2_5_7b_context_parallel_by_hand():
    """TP=4 x CP=2 on one node: each rank holds half of every sequence, Adam's state is
    sharded over DP x CP."""
    shape = ModelShape.load("Qwen2.5-7B")
    work = Workload(max_prompt_length=1024, max_response_length=7168, max_tokens_per_gpu=16384)
    e = estimate(shape, 8, 8, GPU, work, tp=4, pp=1, cp=2)
    assert e.dp == 1
    stage = 7_615_616_512
    assert e.optimizer == 12 * (stage // 4) // 2
    per_layer = 2 * 8192 * (4 * 3584 + (28 + 8) * 128 + 28 * 128 + 3 * 18944) // 4  # 16384 / CP tokens
    assert per_layer == 325_058_560
    assert e.activations == 28 * per_layer
    assert e.logits == 8 * 8192 * 152064 // 4
    assert any("TP x CP = 16 spans nodes" in p for p in estimate(shape, 16, 8, GPU, work, tp=4, pp=1, cp=4).problems)


def test_long_sequences_take_context_parallelism_before_recomputation():
    """Qwen2.5-7B with 64k-token sequences on one node of 80 GB GPUs: no CP = 1 layout fits
    without recomputing activations, a CP one does, and the plan prefers it."""
    work = Workload(max_prompt_length=2048, max_response_length=63488)
    estimates = plan_layouts(ModelShape.load("Qwen2.5-7B"), 1, 8, GPU, work)
    feasible = [e for e in estimates if not e.problems]
    assert all(e.recompute for e in feasible if e.cp == 1)
    best = feasible[0]
    assert best.cp > 1 and not best.recompute
    assert f"actor.parallel.context_parallel_size={best.cp}" in overrides(best)


def test_command_line(capsys, tmp_path):
    assert main(["plan", "--model", "Qwen/Qwen2.5-32B", "--nodes", "8", "--gpu-memory", "80GB"]) == 0
    out = capsys.readouterr().out
    assert "32.76B parameters" in out
    assert "actor.parallel.tensor_model_parallel_size=8 actor.parallel.pipeline_model_parallel_size=2" in out
    assert main(["plan", "--model", "Qwen2.5-32B", "--nodes", "8", "--overrides"]) == 0
    layout = capsys.readouterr().out.split()
    assert layout[:4] == ["actor.parallel.tensor_model_parallel_size=8", "actor.parallel.pipeline_model_parallel_size=2",
                          "actor.parallel.context_parallel_size=1", "actor.parallel.data_parallel_size=4"]
    from megarl.config import load_config  # the overrides are valid keys of a run
    cfg = load_config(str(Path(__file__).parents[1] / "examples/dapo/dapo_qwen2.5_32b.yaml"), layout)
    assert cfg.rollout.tensor_parallel_size == 4
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "vocab_size": 10}')
    assert main(["plan", "--model", str(tmp_path), "--nodes", "1"]) == 1  # unsupported family: a clear error
    assert "not supported" in capsys.readouterr().err
    assert main(["plan", "--model", "no-such-model", "--nodes", "1"]) == 1
    assert "neither an HF config" in capsys.readouterr().err


@pytest.mark.parametrize("text, expected", [("80GB", 80 * GiB), ("141GiB", 141 * GiB), ("80", 80 * GiB),
                                            ("0.5T", 512 * GiB)])
def test_gpu_memory_sizes(text, expected):
    assert parse_bytes(text) == expected
