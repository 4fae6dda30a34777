"""Qwen3-MoE on the megatron backend against the HF model holding the same weights, on CPU
(gloo, fp32) as multi-process runs on localhost: megatron's all-to-all token dispatcher (the
one GPU runs use; megarl's CPU mode stands in for its CUDA streams), expert parallelism (EP)
alone and with tensor (TP) and pipeline (PP) parallelism. The tiny model has 6 experts (not a
power of two), top-2 routing, grouped-query attention and one dense layer among the MoE ones."""

from dataclasses import replace

import pytest
import torch

from megarl.backends.batch import TrainBatch

from megarl.backends.torch.logprobs import token_log_probs
from megatron_cases import logprobs_and_export
from megatron_dist import run_distributed
from test_megatron_numerics import a_batch
from tiny_models import tiny_hf_model

pytestmark = pytest.mark.megatron  # megatron-core runs here: make test-compat runs these on its newest release too

# world sizes: EP=2 alone (2 ranks); TP=2 with EP=2 over the two data-parallel replicas (4 ranks,
# expert TP 1); TP=2 with EP=2 folded into the TP ranks (2 ranks: megatron lays experts out apart
# from attention); PP=2 with EP=2 (4 ranks)
MOE_LAYOUTS = {"ep2": (dict(ep=2), 2), "tp2ep2": (dict(tp=2, ep=2, etp=1), 4),
               "tp2ep2_folded": (dict(tp=2, ep=2, etp=1), 2), "pp2ep2": (dict(pp=2, ep=2), 4)}


@pytest.mark.parametrize("layout", list(MOE_LAYOUTS))
def test_moe_log_probs_match_hf_and_export_is_exact(tmp_path, layout):
    from megarl.models.hf_layout import checkpoint_views

    model = tiny_hf_model("qwen3_moe")
    model.save_pretrained(tmp_path)
    batch = a_batch(model.config.vocab_size)
    with torch.no_grad():
        want_lp, want_ent = token_log_probs(model, batch.input_ids, batch.attention_mask, with_entropy=True)
    kw, world = MOE_LAYOUTS[layout]
    results = run_distributed(world, logprobs_and_export, str(tmp_path), kw, batch, 2)
    real = batch.attention_mask.bool().clone()
    real[:, 0] = False
    exported = {}
    for log_probs, entropy, tensors in results:
        torch.testing.assert_close(log_probs[real], want_lp[real], rtol=0, atol=1e-5)
        torch.testing.assert_close(entropy[real], want_ent[real], rtol=0, atol=1e-5)
        exported.update(tensors)
    state = checkpoint_views(model)
    assert exported.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(exported[name], tensor), name


def with_routing(batch, seed: int = 2):
    """`batch` with a routing of its own (distinct random experts per token and MoE layer), as a
    rollout engine on other weights would have routed it."""
    g = torch.Generator().manual_seed(seed)
    lengths = batch.attention_mask.sum(1).tolist()
    routed = [torch.stack([torch.cat([torch.randperm(6, generator=g)[:2] for _ in range(3)]) for _ in range(n - 1)])
              for n in lengths]
    return replace(batch, routed_experts=TrainBatch.from_sequences(
        [[0]] * len(batch), [[0] * (n - 1) for n in lengths], [[1] * (n - 1) for n in lengths],
        routed_experts=[r.to(torch.int16) for r in routed]).routed_experts)


def replayed_log_probs(model, batch):
    from megarl.backends.moe import replay_indices
    from megarl.backends.torch.routing import replayed_routing

    with torch.no_grad(), replayed_routing(model, replay_indices(batch.routing(), 2, [0, 2, 3], 4)):
        return token_log_probs(model, batch.input_ids, batch.attention_mask, with_entropy=True)


@pytest.mark.parametrize("layout, packing", [("ep2", None), ("ep2", "mask"), ("pp2ep2", None)])
def test_replayed_routing_log_probs_match_hf_replaying_it(tmp_path, layout, packing):
    # the routing replayed on megatron's routers (padded rows, and packed end to end; two
    # pipeline stages) gives the log-probs of the HF model replaying the same routing
    model = tiny_hf_model("qwen3_moe")
    model.save_pretrained(tmp_path)
    batch = with_routing(a_batch(model.config.vocab_size))
    want_lp, want_ent = replayed_log_probs(model, batch)
    real = batch.attention_mask.bool().clone()
    real[:, 0] = False
    with torch.no_grad():
        own, _ = token_log_probs(model, batch.input_ids, batch.attention_mask)
    assert (own - want_lp)[real].abs().max() > 1e-2  # the routing replayed is not the model's own
    kw, world = MOE_LAYOUTS[layout]
    results = run_distributed(world, logprobs_and_export, str(tmp_path), kw, batch, 2, "float32", None, "local",
                              None, packing, True)
    for log_probs, entropy, _ in results:
        torch.testing.assert_close(log_probs[real], want_lp[real], rtol=0, atol=1e-5)
        torch.testing.assert_close(entropy[real], want_ent[real], rtol=0, atol=1e-5)


# full recomputation: the routers run each forward twice, the second time in the backward pass;
# with two pipeline stages (1F1B) the second micro-batch's forward comes before the first's backward
@pytest.mark.parametrize("recompute, replay, layout", [(None, False, "ep2"), ("full", False, "ep2"),
                                                      ("full", True, "ep2"), ("full", True, "pp2ep2")])
def test_one_moe_optimizer_step_equals_the_torch_backend(tmp_path, recompute, replay, layout):
    # EP=2 over 2 ranks: attention and the router data-parallel (a row pair each), the experts
    # split; one row per micro-batch on both backends, since the load-balancing loss (coefficient
    # 0.01 from the config, large enough to move the router) is a micro-batch's; `replay`: both
    # route as the batch's routed_experts say
    from megarl.backends.torch.actor import TorchActor
    from megarl.config import AlgorithmConfig, OptimConfig
    from megarl.models.hf_layout import checkpoint_views
    from megatron_cases import actor_step

    model = tiny_hf_model("qwen3_moe")
    model.save_pretrained(tmp_path)
    batch = a_batch(model.config.vocab_size)
    batch = with_routing(batch) if replay else batch
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        now, _ = token_log_probs(model, batch.input_ids, batch.attention_mask)
    batch = batch.with_fields(old_log_probs=now + 0.3 * torch.randn(now.shape, generator=g),
                              advantages=torch.randn(len(batch), 1, generator=g).expand_as(now).clone())
    algo = AlgorithmConfig()
    optim = OptimConfig(lr=1e-3, eps=1e-3, lr_warmup_steps=0, weight_decay=0.1, grad_clip=1.0)
    kw, world = MOE_LAYOUTS[layout]
    results = run_distributed(world, actor_step, str(tmp_path), kw, batch, 1, algo, optim, None, recompute, None,
                              replay)

    before = {n: t.clone() for n, t in checkpoint_views(model).items()}
    actor = TorchActor(model, algo, optim, mini_batch_samples=len(batch), micro_batch_samples=1, routing_replay=replay)
    assert actor.moe_aux_loss_coeff == 0.01
    want = actor.update_actor(batch)
    exported = {}
    for tensors, _ in results:
        exported.update(tensors)
    state = checkpoint_views(model)
    assert exported.keys() == state.keys()
    for name, tensor in state.items():
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=1e-5, msg=name)
    router = "model.layers.0.mlp.gate.weight"
    assert not torch.allclose(state[router], before[router], atol=1e-4)  # the router did move
    got = results[0][1]
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    assert want["moe_aux_loss"] > 0 and want["moe_load_max_over_mean"] >= 1.0
    for key in ("moe_aux_loss", "moe_load_max_over_mean"):  # megatron's routers report what the torch backend does
        assert all(r[1][key] == pytest.approx(want[key], rel=1e-5) for r in results), key


@pytest.mark.slow
@pytest.mark.full
def test_megarl_train_at_ep2_ends_on_the_torch_backends_weights(tmp_path, monkeypatch):
    # `megarl train` on a tiny Qwen3-MoE: the torch backend, then megatron at EP=2 (two Ray rank
    # actors; each data-parallel rank's micro-batch is one of the torch backend's, so the
    # load-balancing loss is the same too), the same rollouts and weights; the EP=2 checkpoint resumes
    import ray

    from megarl.config import load_config
    from megarl.export import export_checkpoint
    from megarl.train import train
    from train_fixtures import hf_weights, mlflow_metric, tiny_overrides, write_tiny_run_inputs

    monkeypatch.setenv("PYTHONPATH", str(__import__("pathlib").Path(__file__).parent))
    inputs = write_tiny_run_inputs(tmp_path / "inputs", family="qwen3_moe")

    def run(out, steps, extra):
        overrides = [o for o in tiny_overrides(inputs, out, steps) if not o.startswith("cluster.launcher")]
        overrides += ["reward.custom_function=reward_fixtures:length_score", "cluster.launcher=ray", *extra]
        return train(load_config(None, overrides))

    megatron = ["actor.backend=megatron", "actor.parallel.expert_model_parallel_size=2"]  # 2 CPU ranks
    run(tmp_path / "torch", 2, [])
    run(tmp_path / "megatron", 2, megatron)
    want, got = hf_weights(tmp_path / "torch" / "hf"), hf_weights(tmp_path / "megatron" / "hf")
    initial = hf_weights(__import__("pathlib").Path(inputs["model"]))
    assert got.keys() == want.keys()
    assert max(float((want[n] - initial[n]).abs().max()) for n in want) > 1e-3
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-4, msg=name)
    assert mlflow_metric(tmp_path / "megatron", "train/reward_mean") == mlflow_metric(tmp_path / "torch",
                                                                                       "train/reward_mean")
    assert not ray.is_initialized()
    export_checkpoint(tmp_path / "megatron", tmp_path / "exported")  # megarl export reads the EP=2 checkpoint
    exported = hf_weights(tmp_path / "exported")
    assert exported.keys() == got.keys() and all(torch.equal(exported[n], got[n]) for n in got)


@pytest.mark.slow
def test_megarl_train_replaying_the_engines_routing(tmp_path, monkeypatch):
    # actor.moe_routing_replay through the whole loop: the embedded engine records each token's
    # experts, the batch carries them to the torch backend (in process) and to megatron at EP=2
    # (two Ray rank actors, each its data-parallel share). A step has two mini-batches: the first
    # trains under the engine's weights (the replayed routing is the model's own), the second
    # after an optimizer step, where the replay routes as the engine did and the model's own
    # routing would differ: both backends end on the same weights, not those of a run without replay
    from megarl.config import load_config
    from megarl.train import train
    from train_fixtures import hf_weights, mlflow_metric, tiny_overrides, write_tiny_run_inputs

    monkeypatch.setenv("PYTHONPATH", str(__import__("pathlib").Path(__file__).parent))
    inputs = write_tiny_run_inputs(tmp_path / "inputs", family="qwen3_moe")

    def run(out, extra):
        overrides = [o for o in tiny_overrides(inputs, out, 1) if not o.startswith("cluster.launcher")]
        return train(load_config(None, [*overrides, "reward.custom_function=reward_fixtures:length_score", *extra]))

    run(tmp_path / "plain", ["cluster.launcher=inprocess"])
    run(tmp_path / "torch", ["cluster.launcher=inprocess", "actor.moe_routing_replay=true"])
    run(tmp_path / "megatron", ["cluster.launcher=ray", "actor.moe_routing_replay=true", "actor.backend=megatron",
                                "actor.parallel.expert_model_parallel_size=2"])
    plain, want, got = (hf_weights(tmp_path / name / "hf") for name in ("plain", "torch", "megatron"))
    assert max(float((want[n] - plain[n]).abs().max()) for n in want) > 1e-3
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-4, msg=key)  # as the other train tests
    for name in ("torch", "megatron"):  # old log-probs under the engine's weights and routing
        assert mlflow_metric(tmp_path / name, "rollout/logprob_mismatch")[0] < 1e-5


# the tiny model's experts in float32 bytes: one expert's gate and up projections (fc1, 2 x 40 x
# 64) and its down projection (fc2, 64 x 40); at EP = 2 each rank holds 3 of the 6 experts
FC1, FC2 = 2 * 40 * 64 * 4, 64 * 40 * 4
EXPERT_GATHERS = [  # (expert_gather_bytes, the bytes each all-gather of one MoE layer brings, fc1 then fc2)
    (None, [2 * 3 * FC1, 2 * 3 * FC2]),  # a layer's experts at once: 122,880 and 61,440
    (50_000, [2 * FC1] * 3 + [2 * 2 * FC2, 2 * 1 * FC2]),  # one fc1 expert (40,960) or two fc2 (40,960) per rank
    (1, [2 * FC1] * 3 + [2 * FC2] * 3),  # less than an expert: one per rank, never split
]


def gathered_exports(hf_dir: str, layout_kw: dict, limits: list) -> list:
    """On this rank: for each limit, the HF tensors exported with it as expert_gather_bytes and
    the bytes each torch.distributed.all_gather of the export brought (counted at torch's API)."""
    from megarl.backends.megatron.model import Layout, build_model, export_hf_tensors, initialize, load_hf_weights
    from megarl.models import ModelSpec

    spec = ModelSpec.from_hf(hf_dir)
    layout = Layout(**layout_kw)
    initialize(layout, seed=0)
    chunks = build_model(spec, layout)
    load_hf_weights(chunks, spec, hf_dir)
    original = torch.distributed.all_gather
    out = []
    for limit in limits:
        sizes = []

        def counted(outputs, tensor, *args, sizes=sizes, **kwargs):
            sizes.append(sum(t.numel() * t.element_size() for t in outputs))
            return original(outputs, tensor, *args, **kwargs)

        torch.distributed.all_gather = counted
        try:
            out.append((dict(export_hf_tensors(chunks, spec, expert_gather_bytes=limit)), sizes))
        finally:
            torch.distributed.all_gather = original
    return out


def test_moe_export_gathers_a_layers_experts_in_chunks_of_bounded_bytes(tmp_path):
    # EP = 2 on 2 ranks (no TP: every all-gather of the export is an expert gather over EP),
    # MoE layers 0, 2, 3; both ranks export every HF tensor exactly, whatever the chunk size
    from megarl.models.hf_layout import checkpoint_views

    model = tiny_hf_model("qwen3_moe")
    model.save_pretrained(tmp_path)
    state = checkpoint_views(model)
    limits = [limit for limit, _ in EXPERT_GATHERS]
    results = run_distributed(2, gathered_exports, str(tmp_path), dict(ep=2), limits)
    for (limit, per_layer), *ranks in zip(EXPERT_GATHERS, *results):
        for exported, sizes in ranks:
            assert sizes == per_layer * 3, limit
            if limit is not None and limit >= 2 * FC1:  # one expert of each rank fits: no gather brings more
                assert max(sizes) <= limit
            assert exported.keys() == state.keys()
            for name, tensor in state.items():
                assert torch.equal(exported[name], tensor), (limit, name)


@pytest.mark.parametrize("expert_bytes, ep, local, limit, want", [
    (100, 2, 8, None, 8),  # no limit: all local experts in one gather
    (100, 2, 8, 1000, 5),  # 5 x 2 x 100 = 1000 bytes
    (100, 2, 8, 999, 4),
    (100, 4, 8, 1000, 2),  # each gather brings a chunk of every EP rank
    (100, 2, 8, 10_000, 8),  # never more than a rank has
    (100, 2, 8, 150, 1),  # one expert of each rank is more than the limit: one anyway (not split)
])
def test_experts_per_gather(expert_bytes, ep, local, limit, want):
    from megarl.backends.megatron.model import experts_per_gather

    assert experts_per_gather(expert_bytes, ep, local, limit) == want
