"""`megarl plan` against numbers worked out by hand from the public configs (each written as
the arithmetic it came from, in the order of megarl/planner.py's docstring)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.cli import main
from megarl.planner import GiB, ModelShape, Workload, engine_memory, estimate, overrides, parse_bytes, plan_layouts

GPU = 80 * GiB  # 85_899_345_920 bytes; 90% of it: 77_309_411_328


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
    e = estimate(shape, 64, 8, GPU, Workload(2048, 20480, sleep=False), tp=8, pp=2)  # the trainer awake
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
    # The colocated engines. Static: 4_096_140_544 + 8_192_281_088 + 6_144_210_816 = 18_432_632_448.
    # Budget B = 77_309_411_328 - 18_432_632_448 - 4 GiB overhead - 1 GiB engine context - 3 GiB engine
    # runtime = 50_286_844_288. TP 2 would put 32_763_876_352 bytes of weights in more than B / 2.
    assert (e.engine_tp, e.engines) == (4, 16)
    assert e.engine_weights == 2 * 32_763_876_352 // 4 == 16_381_938_176
    # SGLang's fraction is of the memory free when the engine starts: the trainer is built but has not
    # stepped, so Adam's m and v (2/3 of the optimizer: 4_096_140_544) are not there yet.
    assert e.static_at_launch == 18_432_632_448 - 4_096_140_544 == 14_336_491_904
    free = GPU - 14_336_491_904 - 4 * GiB - 1 * GiB
    assert free == 66_194_144_896
    # B / free = 0.7597 -> 0.75. (B / GPU = 0.58 would get 0.58 x free - weights = 20.5 GiB of KV cache
    # from SGLang, not the B - weights = 31.6 GiB it was meant to be.)
    assert e.mem_fraction_static == 0.75
    assert e.kv_cache == 49_645_608_672 - 16_381_938_176 == 33_263_670_496  # 0.75 x free - engine weights
    assert e.kv_tokens == 33_263_670_496 // (2 * 64 * (8 // 4) * 128 * 2) == 507_563  # K, V; 64 layers; 2 KV heads
    assert e.sequences_per_engine == 507_563 // 22528 == 22
    assert e.rollout_waves == -(-8192 // (22 * 16)) == 24
    # while rollouts run after a step, trainer static + overhead + the engine's context, f x free and
    # runtime stay within 90% of the GPU: 18_432_632_448 + 8 GiB + 49_645_608_672 = 76_668_175_712
    assert e.static + 8 * GiB + 49_645_608_672 == 76_668_175_712 <= int(0.9 * GPU)


def test_qwen2_5_32b_engines_next_to_a_sleeping_trainer_by_hand():
    """The layout above with the trainer asleep while the engines generate (the default): it keeps
    2 GiB (its CUDA context and communicators) and sleeps before the engines start."""
    e = estimate(ModelShape.load("Qwen2.5-32B"), 64, 8, GPU, Workload(2048, 20480), tp=8, pp=2)
    assert e.sleep and e.train_peak == 67_872_990_848  # training itself is as above
    budget = 77_309_411_328 - 2 * GiB - 1 * GiB - 3 * GiB
    assert budget == 70_866_960_384
    # TP 1 would put 65_527_752_704 bytes of weights in more than B / 2; TP 2 puts 32_763_876_352
    assert (e.engine_tp, e.engines) == (2, 32)
    free = GPU - 2 * GiB - 1 * GiB
    assert free == 82_678_120_448
    assert e.mem_fraction_static == 0.85  # 70_866_960_384 / 82_678_120_448 = 0.857
    assert e.kv_cache == 70_276_402_380 - 32_763_876_352 == 37_512_526_028  # int(0.85 x free) - engine weights
    assert e.kv_tokens == 37_512_526_028 // (2 * 64 * (8 // 2) * 128 * 2) == 286_197  # 4 KV heads per GPU
    assert e.sequences_per_engine == 286_197 // 22528 == 12
    assert e.rollout_waves == -(-8192 // (12 * 32)) == 22


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
    # static 3.81 + 7.62 + 11.42 GB = 21.3 GiB; budget 72 - 21.3 - 8 = 42.7 GiB: one GPU holds an engine's 15.2 GB
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


def test_engines_start_before_the_critic_and_actor_have_adam_moments():
    """PPO with a KL reference, Qwen2.5-7B TP 4 with recompute on 8 GPUs (DP 2): at the engines'
    start neither the actor's nor the critic's Adam m, v exist."""
    e = estimate(ModelShape.load("Qwen2.5-7B"), 8, 8, GPU, Workload(kl=True, critic=True, sleep=False), tp=4, pp=1,
                 recompute=True)
    weights, grads, optimizer = 3_807_808_256, 7_615_616_512, 11_423_424_768  # 2, 4, 12/DP bytes x 7.6e9 / 4
    static = weights + grads + optimizer + weights + (weights + grads + optimizer)  # actor, reference, critic
    assert e.static == static == 49_501_507_328
    moments = 2 * optimizer // 3  # m and v: 8 of the 12 bytes, 7_615_616_512 each for actor and critic
    assert e.static_at_launch == static - 2 * moments == 34_270_274_304
    budget = int(0.9 * GPU) - static - 8 * GiB  # an engine's 15.2 GB would take more than half: TP 2
    assert budget == 19_217_969_408
    assert (e.engine_tp, e.engines) == (2, 4)
    free = GPU - 34_270_274_304 - 5 * GiB
    assert free == 46_260_362_496
    assert e.mem_fraction_static == 0.41  # 19_217_969_408 / 46_260_362_496 = 0.4154
    assert e.kv_cache == 18_966_748_623 - 7_615_616_512 == 11_351_132_111  # int(0.41 x free) - TP 2 weights


def test_disaggregated_engines_on_gpus_of_their_own():
    """Qwen2.5-7B on one node, 4 of the 8 GPUs for the engines: the trainer's memory has no
    part in theirs."""
    work = Workload(max_prompt_length=1024, max_response_length=7168, max_tokens_per_gpu=16384)
    e = estimate(ModelShape.load("Qwen2.5-7B"), 4, 8, GPU, work, tp=4, pp=1, rollout_gpus=4)
    assert e.dp == 1
    # B = 77_309_411_328 - 1 GiB context - 3 GiB runtime = 73_014_444_032; free = 80 GiB - 1 GiB
    assert (e.engine_tp, e.engines) == (1, 4)  # 15_231_233_024 bytes of weights <= B / 2
    assert e.mem_fraction_static == 0.86  # 73_014_444_032 / 84_825_604_096 = 0.8608
    assert e.kv_cache == 72_950_019_522 - 15_231_233_024 == 57_718_786_498  # int(0.86 x 84_825_604_096) - weights
    assert e.kv_tokens == 57_718_786_498 // (2 * 28 * 4 * 128 * 2) == 1_006_535
    assert e.sequences_per_engine == 1_006_535 // 8192 == 122
    layout = overrides(e)
    assert "rollout.mode=disaggregated" in layout and "rollout.gpu_memory_utilization=0.86" in layout
    from megarl.config import load_config  # the run these overrides make has the same engines
    cfg = load_config(str(Path(__file__).parents[1] / "examples/dapo/dapo_qwen2.5_7b.yaml"),
                      layout + ["cluster.nnodes=1", "cluster.gpus_per_node=8"])
    assert (cfg.train_world_size(), cfg.num_rollout_engines()) == (4, 4)


def test_every_colocated_plan_fits_next_to_the_stepped_trainer():
    """Whatever layout is picked, SGLang's static share (f x the memory free at its start) plus
    its runtime, next to the trainer's memory after a step (awake), stays within 90% of the GPU."""
    for e in plan_layouts(ModelShape.load("Qwen2.5-32B"), 4, 8, GPU, Workload(critic=True, sleep=False)):
        if e.problems:
            continue
        free = GPU - e.static_at_launch - 5 * GiB
        assert e.kv_cache == int(e.mem_fraction_static * free) - e.engine_weights
        assert e.static + 4 * GiB + 1 * GiB + e.mem_fraction_static * free + 3 * GiB <= 0.9 * GPU


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
    assert (best.engine_tp, best.engines) == (2, 32)  # next to the sleeping trainer (worked out below)
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
    assert main(["plan", "--model", "Qwen2.5-32B", "--nodes", "8", "--estimate"]) == 0
    estimate = capsys.readouterr().out
    assert main(["plan", "--model", "Qwen2.5-32B", "--nodes", "8", "--overrides"]) == 0
    printed = capsys.readouterr()
    layout = printed.out.split()
    assert printed.err == estimate  # the step-time estimate for the recipe's log
    assert layout[:4] == ["actor.parallel.tensor_model_parallel_size=8", "actor.parallel.pipeline_model_parallel_size=2",
                          "actor.parallel.context_parallel_size=1", "actor.parallel.data_parallel_size=4"]
    from megarl.config import load_config  # the overrides are valid keys of a run
    cfg = load_config(str(Path(__file__).parents[1] / "examples/dapo/dapo_qwen2.5_32b.yaml"), layout)
    assert cfg.rollout.tensor_parallel_size == 2
    assert (cfg.rollout.mode, cfg.rollout.gpu_memory_utilization) == ("colocated", 0.85)  # worked out below
    assert main(["plan", "--model", "Qwen2.5-32B", "--nodes", "8", "--overrides", "--no-sleep"]) == 0
    awake = load_config(str(Path(__file__).parents[1] / "examples/dapo/dapo_qwen2.5_32b.yaml"),
                        capsys.readouterr().out.split())
    assert (awake.rollout.tensor_parallel_size, awake.rollout.gpu_memory_utilization) == (4, 0.75)  # worked out above
    assert awake.trainer.sleep_during_generation is False
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "vocab_size": 10}')
    assert main(["plan", "--model", str(tmp_path), "--nodes", "1"]) == 1  # unsupported family: a clear error
    assert "not supported" in capsys.readouterr().err
    assert main(["plan", "--model", "no-such-model", "--nodes", "1"]) == 1
    assert "neither an HF config" in capsys.readouterr().err
    assert main(["plan", "--model", "Qwen2.5-7B", "--nodes", "1", "--rollout-gpus", "8"]) == 1
    assert "--rollout-gpus 8" in capsys.readouterr().err


@pytest.mark.parametrize("text, expected", [("80GB", 80 * GiB), ("141GiB", 141 * GiB), ("80", 80 * GiB),
                                            ("0.5T", 512 * GiB)])
def test_gpu_memory_sizes(text, expected):
    assert parse_bytes(text) == expected


def test_qwen3_30b_a3b_parameters_by_hand():
    # h 2048, 48 layers, 32 heads and 4 KV heads of 128, QK norm; 128 experts of 768, router 128 x 2048
    attention = 2048 * 32 * 128 + 2 * 2048 * 4 * 128 + 32 * 128 * 2048 + 2 * 2048 + 2 * 128
    layer = attention + 128 * 2048 + 128 * 3 * 2048 * 768
    assert layer == 623_120_640
    assert ModelShape.load("Qwen3-30B-A3B").params() == 48 * layer + 2 * 151936 * 2048 + 2048 == 30_532_122_624


def test_qwen3_30b_a3b_tp4_cp2_ep8_by_hand():
    """2 nodes: attention over TP 4 x CP 2 x DP 2, the experts over EP 8 x expert DP 2 (expert TP 1)."""
    shape = ModelShape.load("Qwen3-30B-A3B")
    e = estimate(shape, 16, 8, GPU, Workload(2048, 20480, 22528, sleep=False), tp=4, pp=1, cp=2, ep=8)
    rest = 48 * (18_874_368 + 4352 + 262_144) + 152064 * 2048 * 2 + 2048  # vocabulary padded to 512 x 297
    experts = 48 * 603_979_776
    assert e.weights == int(2 * (rest / 4 + experts / 8)) == 8_018_566_144
    assert e.optimizer == int(12 * (rest / 4 / (2 * 2) + experts / 8 / 2)) == 22_899_485_184  # DP x CP; expert DP
    # per token: 4h + (q + 2 kv) d + q d + 3 k I (the 8 experts' gate, up, product) + 2 k h (all-to-all copies)
    width = 4 * 2048 + (32 + 8) * 128 + 32 * 128 + 3 * 8 * 768 + 2 * 8 * 2048
    assert width == 68608
    assert e.activations == 48 * (2 * 11264 * width // 4) == 18_547_212_288  # 22528 / CP tokens
    assert e.problems == [] and e.engine_tp == 8
    layout = overrides(e)
    assert "actor.parallel.expert_model_parallel_size=8" in layout and "rollout.expert_parallel_size=8" in layout


def test_expert_layouts_that_cannot_work_say_why():
    moe, dense = ModelShape.load("Qwen3-30B-A3B"), ModelShape.load("Qwen2.5-7B")
    assert "EP=3 does not divide the 128 experts" in estimate(moe, 24, 8, GPU, Workload(), tp=1, pp=1, ep=3).problems
    assert "EP x PP = 16 does not divide the 24 GPUs" in estimate(moe, 24, 8, GPU, Workload(), tp=1, pp=1,
                                                                   ep=16).problems
    assert "EP=2 needs a mixture of experts" in estimate(dense, 8, 8, GPU, Workload(), tp=1, pp=1, ep=2).problems


def test_qwen3_235b_a22b_engines_next_to_an_awake_trainer_span_nodes():
    """An engine's bf16 weights take 59 GB of each of 8 GPUs: next to an awake trainer they fit
    only in an engine across nodes (2 P / 32 = 14.7 GB a GPU at TP 32, four nodes); on GPUs of
    their own, and next to a trainer that sleeps, an engine of one node holds them."""
    shape = ModelShape.load("Qwen3-235B-A22B")
    assert 2 * shape.params() / 8 > 58e9
    for nodes in (8, 16):
        colocated = plan_layouts(shape, nodes, 8, GPU, Workload(2048, 20480, 22528, sleep=False))
        fit = [e for e in colocated if not e.problems]
        assert fit and all(e.engine_tp in (16, 32) for e in fit)
        assert fit[0].engine_weights == int(2 * shape.params() / fit[0].engine_tp)
        within_a_node = [e for e in colocated if e.engine_tp and e.engine_tp <= 8]
        assert all(e.problems for e in within_a_node)
        asleep = plan_layouts(shape, nodes, 8, GPU, Workload(2048, 20480, 22528))[0]
        assert not asleep.problems and asleep.engine_tp == 8 and not asleep.rollout_gpus
        best = plan_layouts(shape, nodes, 8, GPU, Workload(2048, 20480, 22528), rollout_gpus=nodes * 4)[0]
        assert not best.problems and best.engine_tp == 8 and best.ep > 1




def test_the_colocated_syncs_peak_is_checked():
    """When a colocated sync brings the engines' weights back, a sleeping trainer keeps only the
    weights it pushes (its gradients and Adam state left first); awake it keeps everything."""
    shape = ModelShape.load("Qwen2.5-32B")
    e = estimate(shape, 64, 8, GPU, Workload(2048, 20480), tp=8, pp=2)  # asleep: the default
    assert e.engine_tp == 2 and e.engine_weights == 32_763_876_352
    assert e.sync_peak == e.weights + 32_763_876_352 + 1536 * 2**20 + 4 * GiB + 1 * GiB
    assert not e.problems
    awake = estimate(shape, 64, 8, GPU, Workload(2048, 20480, sleep=False), tp=8, pp=2)
    assert awake.engine_tp == 4 and awake.static == 18_432_632_448  # weights, grads and Adam all stay
    assert awake.sync_peak == 18_432_632_448 + 16_381_938_176 + 1536 * 2**20 + 5 * GiB
    # Qwen3-235B-A22B on 4 nodes, asleep: room to generate, not to sync (test_plan_time.py)
    moe = estimate(ModelShape.load("Qwen3-235B-A22B"), 32, 8, GPU, Workload(512, 7680, None, 512, True), tp=4, pp=2,
                   ep=16, recompute=True, offload=True)  # training fits
    assert moe.engine_tp == 8 and moe.problems == [
        f"the weight sync needs {moe.sync_peak / GiB:.1f} GiB when the engines' weights come back next to the "
        f"trainer's {moe.weights / GiB:.1f} GiB, more than 90% of the GPU"]
    assert moe.sync_peak == moe.weights + moe.engine_weights + 1536 * 2**20 + 5 * GiB > 0.9 * GPU


def test_fp8_caches_by_hand_while_training_in_the_sync_and_not_while_the_engines_generate():
    """actor.fp8 (--fp8): Transformer Engine caches an FP8 copy of each weight (1 byte a parameter)
    and its transpose (1 more) while training; the probe's forward in a colocated sync builds the
    copy alone (no gradients, no transpose); the sleep before the engines generate drops them all
    (megarl.backends.sleep.WorkerSleep), so a sleeping trainer's engines are sized as without FP8."""
    shape = ModelShape.load("Qwen2.5-7B")
    # Qwen2.5-7B on TP 4: 28 layers of 233_057_792, the untied vocabulary (152064, a multiple of
    # 128 x 4) twice, the final norm: 7_615_616_512 parameters, a quarter a GPU
    stage = (28 * 233_057_792 + 2 * 152064 * 3584 + 3584) // 4
    assert stage == 1_903_904_128
    for sleep in (True, False):
        bf16 = estimate(shape, 8, 8, GPU, Workload(sleep=sleep), tp=4, pp=1, recompute=True)
        fp8 = estimate(shape, 8, 8, GPU, Workload(sleep=sleep, fp8=True), tp=4, pp=1, recompute=True)
        assert (bf16.fp8_caches, fp8.fp8_caches) == (0, 2 * stage)
        assert fp8.train_peak - bf16.train_peak == 2 * stage
        # the sync: asleep, the weights pushed and the probe's copy; awake, everything the trainer holds
        assert fp8.sync_peak - bf16.sync_peak == (stage if sleep else 2 * stage)
        if sleep:  # the engines' budget as without FP8: nothing of the caches is left while they generate
            assert (fp8.mem_fraction_static, fp8.kv_cache) == (bf16.mem_fraction_static, bf16.kv_cache)
        else:  # an awake trainer keeps its caches next to the engines: B is 2 bytes a parameter smaller
            assert engine_memory(bf16, GPU)[0] - engine_memory(fp8, GPU)[0] == 2 * stage
