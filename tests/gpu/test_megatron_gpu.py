"""The megatron backend on a GPU (skipped where CUDA is absent): bf16 log-probs against HF's,
with Transformer Engine layers where installed, padded or packed (THD), context parallel on
two GPUs, FP8 (also through the train worker, on lengths that are not multiples of 16), FP8
parameters all-gathered in FP8, and the optimizer offloaded. Each test names the rows of the GPU
status table it checks (`gpu_path`, tests/gpu/gpu_status.py).

Tolerances (documented, not tuned to a run): bf16 keeps 8 bits of mantissa, so a log-prob of
magnitude ~6 (a 300-token vocabulary) carries rounding of ~0.03 per operation; two
implementations with different kernels and reduction orders agree within 0.15 at worst and
0.02 on average over tokens. FP8 (e4m3 / e5m2 with per-tensor scales) is compared with the
bf16 run of the same layers, within 0.5 at worst and 0.1 on average.
"""

import importlib.util

import pytest
import torch

from megarl.backends.batch import TrainBatch
from megarl.backends.torch.logprobs import token_log_probs
from megatron_cases import logprobs_and_export
from megatron_dist import run_distributed
from test_megatron_numerics import a_batch
from tiny_models import tiny_hf_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")]
path = pytest.mark.gpu_path


def te_available() -> bool:
    from megarl.backends.megatron.layers import transformer_engine_available

    return transformer_engine_available()


def skip_without_fp8() -> None:
    if not te_available():
        pytest.skip("Transformer Engine is not installed")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip(f"FP8 GEMMs need compute capability 8.9 or newer (Ada, Hopper); this GPU has "
                    f"{torch.cuda.get_device_capability()}")


def close_in_bf16(got: torch.Tensor, want: torch.Tensor, worst: float, mean: float) -> None:
    diff = (got.float() - want.float()).abs()
    assert float(diff.max()) < worst and float(diff.mean()) < mean, (float(diff.max()), float(diff.mean()))


@pytest.mark.parametrize("family, tied", [("qwen2", False), ("llama", True), ("qwen3", False)])
@pytest.mark.parametrize("impl, packing", [
    ("local", None), pytest.param("transformer_engine", None, marks=path("te_layers")), ("local", "mask"),
    pytest.param("transformer_engine", "thd", marks=path("te_layers", "thd_packing"))])  # thd: TE's cu_seqlens attention
def test_bf16_log_probs_match_hf(tmp_path, family, tied, impl, packing):
    if impl == "transformer_engine" and not te_available():
        pytest.skip("Transformer Engine is not installed")
    model = tiny_hf_model(family, tie_word_embeddings=tied)
    model.save_pretrained(tmp_path)
    batch = a_batch(model.config.vocab_size)
    hf = model.to(device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        want, _ = token_log_probs(hf, batch.input_ids.cuda(), batch.attention_mask.cuda())
    (got, _, exported), = run_distributed(1, logprobs_and_export, str(tmp_path), {}, batch, 2, "bfloat16", None, impl,
                                          None, packing)
    real = batch.attention_mask.bool().clone()
    real[:, 0] = False
    close_in_bf16(got[real], want.cpu()[real], worst=0.15, mean=0.02)
    for name, tensor in hf.state_dict().items():  # bf16 weights in, the same bf16 weights out
        if name in exported:
            assert torch.equal(exported[name], tensor.cpu()), name


@path("fp8")
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_fp8_log_probs_stay_close_to_bf16(tmp_path, recipe):
    skip_without_fp8()
    model = tiny_hf_model("qwen2")
    model.save_pretrained(tmp_path)
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, model.config.vocab_size, (32,), generator=g).tolist() for _ in range(4)]
    batch = TrainBatch.from_sequences([r[:8] for r in rows], [r[8:] for r in rows], [[1] * 24] * 4)  # FP8 GEMMs want multiples of 16
    (bf16, _, _), = run_distributed(1, logprobs_and_export, str(tmp_path), {}, batch, 2, "bfloat16", None,
                                    "transformer_engine")
    fp8 = {"fp8": "hybrid", "fp8_recipe": recipe}
    (got, _, _), = run_distributed(1, logprobs_and_export, str(tmp_path), {}, batch, 2, "bfloat16", None,
                                   "transformer_engine", fp8)
    real = batch.attention_mask.bool().clone()
    real[:, 0] = False
    close_in_bf16(got[real], bf16[real], worst=0.5, mean=0.1)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="context parallelism needs two GPUs")
@pytest.mark.parametrize("impl", ["local", pytest.param("transformer_engine", marks=path("te_cp"))])
def test_context_parallel_log_probs_match_hf(tmp_path, impl):
    """CP=2 over two GPUs: Transformer Engine's ring attention, or megarl's all-gathered keys
    and values on the local layers, against HF's bf16 log-probs."""
    if impl == "transformer_engine" and not te_available():
        pytest.skip("Transformer Engine is not installed")
    model = tiny_hf_model("qwen2")
    model.save_pretrained(tmp_path)
    batch = a_batch(model.config.vocab_size)
    hf = model.to(device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        want, _ = token_log_probs(hf, batch.input_ids.cuda(), batch.attention_mask.cuda())
    results = run_distributed(2, logprobs_and_export, str(tmp_path), {"cp": 2}, batch, 2, "bfloat16", None, impl)
    real = batch.attention_mask.bool().clone()
    real[:, 0] = False
    for got, _, _ in results:
        close_in_bf16(got[real], want.cpu()[real], worst=0.15, mean=0.02)


@path("moe_ep")
@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_moe_expert_parallel_log_probs_match_hf(tmp_path, impl):
    """Qwen3-MoE at EP=2 over two GPUs (megatron's all-to-all dispatcher on NCCL; with Transformer
    Engine, its grouped-GEMM experts) against HF's bf16 log-probs; the bf16 weights exported by
    their checkpoint names are the loaded ones."""
    from megarl.models.hf_layout import checkpoint_views

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    if impl == "transformer_engine" and not te_available():
        pytest.skip("Transformer Engine is not installed")
    model = tiny_hf_model("qwen3_moe")
    model.save_pretrained(tmp_path)
    batch = a_batch(model.config.vocab_size)
    hf = model.to(device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        want, _ = token_log_probs(hf, batch.input_ids.cuda(), batch.attention_mask.cuda())
    results = run_distributed(2, logprobs_and_export, str(tmp_path), {"ep": 2}, batch, 2, "bfloat16", None, impl)
    real = batch.attention_mask.bool().clone()
    real[:, 0] = False
    for got, _, exported in results:
        close_in_bf16(got[real], want.cpu()[real], worst=0.15, mean=0.02)
    for name, tensor in checkpoint_views(hf).items():
        assert torch.equal(results[0][2][name], tensor.cpu()), name


@path("moe_replay")
def test_moe_routing_replay_under_sequence_parallelism_matches_hf(tmp_path):
    """Routing replay at TP=2 with sequence parallelism x EP=2 on Transformer Engine's layers
    (each TP rank's router sees its share of the sequence) against HF replaying the same routing."""
    from dataclasses import replace

    from megarl.backends.moe import replay_indices
    from megarl.backends.torch.routing import replayed_routing
    from test_megatron_moe import with_routing

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    if not te_available():
        pytest.skip("Transformer Engine is not installed")
    model = tiny_hf_model("qwen3_moe")
    model.save_pretrained(tmp_path)
    batch = with_routing(a_batch(model.config.vocab_size))
    hf = model.to(device="cuda", dtype=torch.bfloat16)
    gpu = replace(batch, input_ids=batch.input_ids.cuda(), attention_mask=batch.attention_mask.cuda())
    with torch.no_grad(), replayed_routing(hf, replay_indices(batch.routing().cuda(), 2, [0, 2, 3], 4)):
        want, _ = token_log_probs(hf, gpu.input_ids, gpu.attention_mask)
    layout = {"tp": 2, "ep": 2, "etp": 1, "sequence_parallel": True}
    results = run_distributed(2, logprobs_and_export, str(tmp_path), layout, batch, 2, "bfloat16", None,
                              "transformer_engine", None, None, True)
    real = batch.attention_mask.bool().clone()
    real[:, 0] = False
    for got, _, _ in results:
        close_in_bf16(got[real], want.cpu()[real], worst=0.15, mean=0.02)


@path("optimizer_offload")
def test_optimizer_offload_takes_the_same_step(tmp_path):
    """actor.optim.offload (megatron's hybrid device optimizer: Adam's state and step on the
    host) lands on the weights of the same step with the state on the GPU (fp32, one rank)."""
    from megarl.config import AlgorithmConfig, OptimConfig
    from megatron_cases import actor_step
    from test_megatron_worker import update_batch

    model = tiny_hf_model("qwen2")
    model.save_pretrained(tmp_path)
    batch = update_batch(model, 1)
    steps = []
    for offload in (False, True):
        optim = OptimConfig(lr=1e-3, eps=1e-3, lr_warmup_steps=0, weight_decay=0.1, grad_clip=1.0, offload=offload)
        (exported, metrics), = run_distributed(1, actor_step, str(tmp_path), {}, batch, 2, AlgorithmConfig(), optim)
        steps.append(exported)
    moved = max(float((steps[0][n] - model.state_dict()[n]).abs().max()) for n in steps[0])
    assert moved > 1e-4
    for name, tensor in steps[0].items():
        torch.testing.assert_close(steps[1][name], tensor, rtol=0, atol=1e-6, msg=name)


FP8_RUN = ["model.dtype=bfloat16", "actor.transformer_impl=transformer_engine", "actor.fp8=hybrid"]


def worker_log_probs(hf_dir: str, overrides: list[str], batch):
    """Case (on each rank): the train worker of a tiny run config; its log-probs of `batch`."""
    from megatron_cases import worker

    return worker(hf_dir, overrides).compute_log_prob(batch)[0]


def fp8_params_before_and_after_a_step(hf_dir: str, batch):
    """Case (one rank): the worker with FP8 parameters (tensorwise: the config refuses them with
    delayed scaling); the HF tensors it exports right after loading, and after one actor update
    at lr 1e-6 (on its own log-probs, random advantages)."""
    from megatron_cases import worker

    w = worker(hf_dir, FP8_RUN + ["actor.fp8_param_gather=true", "actor.fp8_recipe=tensorwise", "actor.optim.lr=1e-6"])

    def exported():
        return {name: t.float().cpu() for bucket in w.export_hf_weights(1 << 30) for name, t in bucket.items()}

    loaded = exported()
    old, _ = w.compute_log_prob(batch)
    advantages = torch.randn(len(batch), 1, generator=torch.Generator().manual_seed(0)).expand_as(old).clone()
    w.update_actor(batch.with_fields(old_log_probs=old, advantages=advantages))
    return loaded, exported()


@path("fp8")
def test_fp8_worker_pads_micro_batches_to_multiples_of_16(tmp_path):
    """The train worker with actor.fp8 on rows of 14, 7, 19 and 5 tokens: FP8 GEMMs take token
    counts divisible by 16 per rank, so the worker pads its micro-batches; its log-probs stay
    within FP8's tolerance of the bf16 worker's."""
    skip_without_fp8()
    model = tiny_hf_model("qwen2")
    model.save_pretrained(tmp_path)
    batch = a_batch(model.config.vocab_size)
    (bf16,) = run_distributed(1, worker_log_probs, str(tmp_path), FP8_RUN[:2], batch)
    (fp8,) = run_distributed(1, worker_log_probs, str(tmp_path), FP8_RUN, batch)
    real = batch.attention_mask.bool().clone()
    real[:, 0] = False
    close_in_bf16(fp8[real], bf16[real], worst=0.5, mean=0.1)


@path("fp8_param_gather")
def test_fp8_param_gather_keeps_the_loaded_weights(tmp_path):
    """actor.fp8_param_gather: what the worker exports right after loading, and after one step
    at lr 1e-6, is the HF checkpoint up to FP8 rounding (e4m3: about 2^-4 relative, so under
    0.1 in norm). Were the FP32 master weights the ones megatron made from the random
    initialisation, before the HF weights were loaded, the step would write those back:
    independent values of the same scale, about sqrt(2) away in relative norm."""
    skip_without_fp8()
    model = tiny_hf_model("qwen2")
    model.save_pretrained(tmp_path)
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, model.config.vocab_size, (16,), generator=g).tolist() for _ in range(4)]
    batch = TrainBatch.from_sequences([r[:8] for r in rows], [r[8:] for r in rows], [[1] * 8] * 4)  # 16 tokens a row
    (loaded, stepped), = run_distributed(1, fp8_params_before_and_after_a_step, str(tmp_path), batch)
    want = {name: t.float() for name, t in model.state_dict().items()}
    assert set(loaded) == set(stepped) == set(want)
    for name, tensor in want.items():
        for when, got in (("loaded", loaded), ("after a step", stepped)):
            error = float((got[name] - tensor).norm() / tensor.norm())
            assert error < 0.1, (name, when, error)
