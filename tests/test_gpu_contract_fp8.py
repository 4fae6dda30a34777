"""The GPU contract of FP8 parameters and optimizer offload, checked on a CPU (the FP8 rules of
tests/test_gpu_contract.py continue here): the padding FP8's GEMMs need of a micro-batch's
tokens, which combinations the config refuses and why, that
Transformer Engine's high-precision copies of FP8 weights are freed once no optimizer will
read them (the frozen reference's right after loading), and the OptimizerConfig megatron gets
for an offloaded optimizer, checked against megatron-core's own validation of it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_dist import run_distributed
from tiny_models import tiny_hf_model

from megarl.config import ConfigError, OptimConfig, load_config

pytestmark = pytest.mark.megatron  # megatron-core runs here: make test-compat runs these on its newest release too

MEGATRON = ["actor.backend=megatron"]
FP8_PARAMS = ["actor.fp8=hybrid", "actor.fp8_param_gather=true"]
PLAIN_ADAM = ["actor.parallel.use_distributed_optimizer=false"]
OFFLOAD = ["actor.optim.offload=true"]


@pytest.mark.parametrize("overrides, want", [
    (FP8_PARAMS + ["actor.fp8_recipe=tensorwise"], []),
    (FP8_PARAMS + ["actor.fp8_recipe=blockwise"], []),
    (["actor.fp8=hybrid", "actor.fp8_recipe=delayed"], []),  # FP8 compute on bf16 weights: scales warm up per step
    (FP8_PARAMS + ["actor.fp8_recipe=delayed"], ["actor.fp8_param_gather"]),  # cast with scale 1.0 at load
    (["actor.fp8_param_gather=true"], []),  # without actor.fp8 the flag does nothing
    (FP8_PARAMS + ["actor.fp8_recipe=tensorwise"] + PLAIN_ADAM, ["actor.fp8_param_gather"]),
    (OFFLOAD, []),
    (OFFLOAD + PLAIN_ADAM, ["actor.optim.offload"]),
    (OFFLOAD + FP8_PARAMS + ["actor.fp8_recipe=blockwise"], ["actor.optim.offload"]),
    (OFFLOAD + FP8_PARAMS, ["actor.fp8_param_gather", "actor.optim.offload"]),
    (OFFLOAD + FP8_PARAMS + ["actor.fp8_recipe=tensorwise"] + PLAIN_ADAM,
     ["actor.fp8_param_gather", "actor.optim.offload", "actor.optim.offload"]),
    (["critic.enable=true", "critic.backend=megatron", "critic.fp8=hybrid", "critic.fp8_param_gather=true"],
     ["critic.fp8_param_gather"]),
])
def test_config_refuses_fp8_params_and_offload_megatron_cannot_serve(overrides, want):
    try:
        load_config(None, MEGATRON + overrides)
        got = []
    except ConfigError as e:
        got = [p.key for p in e.problems]
    assert got == want


class _HeldCopy:
    """Transformer Engine's preserved initial value of one FP8 parameter (fp8_model_init with
    preserve_high_precision_init_val), as megatron reads it: get_high_precision_init_val()
    returns the value or None once cleared. Every call is logged in `calls`."""

    def __init__(self, param: torch.nn.Parameter, calls: list[str]):
        self.value: torch.Tensor | None = torch.zeros_like(param)
        self.calls = calls
        param.get_high_precision_init_val = self.get
        param.clear_high_precision_init_val = self.clear

    def get(self):
        self.calls.append("get")
        return self.value

    def clear(self):
        self.calls.append("clear")
        self.value = None


def test_free_master_sources_frees_every_fp8_copy_and_nothing_else():
    from megarl.backends.megatron.model import free_master_sources

    chunks = [torch.nn.Linear(2, 3), torch.nn.Linear(3, 2)]
    calls: list[str] = []
    copies = [_HeldCopy(chunks[0].weight, calls), _HeldCopy(chunks[1].weight, calls)]
    biases = [c.bias.detach().clone() for c in chunks]
    free_master_sources(chunks)
    assert calls == ["clear", "clear"] and [c.value for c in copies] == [None, None]
    assert all(torch.equal(c.bias, b) for c, b in zip(chunks, biases))


def fp8_copy_calls_in_the_worker(hf_dir: str) -> list[list[list[str]]]:
    """On one rank: the megatron train worker of a bf16 run with a reference model
    (algorithm.use_kl_loss), its models' linear weights given Transformer Engine's
    high-precision copies as fp8_model_init would (and megatron's distributed optimizer told
    they are FP8). Returns, per model built (the actor, then the reference), each copy's calls."""
    from megatron.core.optimizer import distrib_optimizer
    from megatron_cases import worker

    from megarl.backends.megatron import model

    build_model, built = model.build_model, []

    def build_with_fp8_copies(*args, **kwargs):
        chunks = build_model(*args, **kwargs)
        copies = []
        for name, param in chunks[0].named_parameters():
            if "linear" in name and name.endswith("weight"):  # what fp8_model_init makes FP8
                copies.append(_HeldCopy(param, []))
        built.append(copies)
        return chunks

    model.build_model = build_with_fp8_copies
    distrib_optimizer.is_float8tensor = lambda tensor: hasattr(tensor, "get_high_precision_init_val")
    worker(hf_dir, ["model.dtype=bfloat16", "algorithm.use_kl_loss=true"])
    return [[copy.calls + (["held"] if copy.value is not None else []) for copy in copies] for copies in built]


def test_the_frozen_reference_frees_its_fp8_copies_after_loading(tmp_path):
    """Each copy is read once at load (keep_master_source). The actor's is then read by the
    distributed optimizer, which builds the FP32 masters from it and clears it, and cleared again
    after the optimizer is built (free_master_sources; a no-op here, where one DP rank updates
    every shard). The reference gets no optimizer: its copies are cleared right after loading,
    not held for the whole run ("held")."""
    model = tiny_hf_model("qwen2")
    model.save_pretrained(tmp_path)
    (models,) = run_distributed(1, fp8_copy_calls_in_the_worker, str(tmp_path))
    actor, reference = models
    layers = 4 * model.config.num_hidden_layers  # linear_qkv, linear_proj, linear_fc1, linear_fc2
    assert actor == [["get", "get", "clear", "clear"]] * layers
    assert reference == [["get", "clear"]] * layers


def optimizer_config(monkeypatch, offload: bool, cuda: bool, distributed: bool = True, fp8_recipe=None):
    """megarl's OptimizerConfig for a bf16 model, validated by megatron-core itself. Its check
    of the precision-aware optimizer asks Transformer Engine's version, which is absent here:
    answered as a TE 2.x would."""
    from megatron.core.optimizer import optimizer_config as megatron_optimizer_config

    from megarl.backends.megatron.step import optimizer_config

    monkeypatch.setattr(megatron_optimizer_config, "is_te_min_version", lambda *args, **kwargs: True)
    model_config = SimpleNamespace(params_dtype=torch.bfloat16, bf16=True, fp16=False)
    return optimizer_config(OptimConfig(offload=offload), model_config, distributed_optimizer=distributed,
                            fp8_recipe=fp8_recipe, cuda=cuda)


@pytest.mark.parametrize("offload, cuda, want", [
    (False, True, (False, 0.0, False, False)),
    (True, False, (False, 0.0, False, False)),  # no CUDA streams for the hybrid optimizer: state on the host anyway
    # all of Adam's state on the host, through the precision-aware path that makes megatron
    # hand the hybrid optimizer the model's parameter shards (masters kept on the host only)
    (True, True, (True, 1.0, True, True)),
])
def test_an_offloaded_optimizer_takes_the_precision_aware_path(monkeypatch, offload, cuda, want):
    config = optimizer_config(monkeypatch, offload, cuda)
    assert (config.optimizer_cpu_offload, config.optimizer_offload_fraction, config.use_precision_aware_optimizer,
            config.use_precision_aware_optimizer_no_fp8_or_ds_fp8) == want
    assert config.decoupled_weight_decay  # megatron's hybrid optimizer is AdamW only
    assert config.use_distributed_optimizer and config.bf16 and config.params_dtype == torch.bfloat16


def test_megatron_refuses_the_offload_path_without_the_distributed_optimizer(monkeypatch):
    # what config validation's actor.optim.offload rule stands for
    with pytest.raises(AssertionError, match="distributed optimizer"):
        optimizer_config(monkeypatch, offload=True, cuda=True, distributed=False)


def test_the_fp8_recipe_reaches_the_optimizer(monkeypatch):
    assert optimizer_config(monkeypatch, offload=False, cuda=True, fp8_recipe="blockwise").fp8_recipe == "blockwise"


# -- the token padding FP8's GEMMs need (megarl.backends.megatron.forward)

@pytest.mark.parametrize("tp, cp, sp, recipe, want", [
    (1, 1, False, None, 1),
    (2, 1, False, None, 2),  # sequence parallelism splits rows over TP
    (2, 1, True, None, 2),
    (2, 2, False, None, 8),  # 2 x CP chunks of a multiple of TP
    (1, 1, False, "delayed", 16),  # the FP8 GEMM's token dimension
    (2, 1, False, "tensorwise", 16),  # lcm(2, 16)
    (3, 1, False, "delayed", 48),  # lcm(3, 16)
    (4, 1, True, "delayed", 64),  # each TP rank quantises its quarter: 4 x 16
    (2, 2, False, "delayed", 32),  # lcm(8, 2 x 16): each CP rank holds 16
    (2, 2, True, "delayed", 64),  # lcm(8, 16 x 2 x 2)
    (8, 4, True, "tensorwise", 512),  # lcm(64, 16 x 4 x 8)
    (1, 1, False, "blockwise", 128),  # 1 x 128 tiles
    (4, 1, False, "blockwise", 128),  # lcm(4, 128)
    (2, 2, True, "blockwise", 512),  # lcm(8, 128 x 2 x 2)
])
def test_token_multiple(tp, cp, sp, recipe, want):
    from megarl.backends.megatron.forward import token_multiple

    assert token_multiple(tp, cp, sequence_parallel=sp, fp8_recipe=recipe) == want


def test_token_multiple_refuses_a_recipe_it_does_not_know():
    from megarl.backends.megatron.forward import token_multiple

    with pytest.raises(ValueError, match="mxfp8"):
        token_multiple(2, fp8_recipe="mxfp8")


def _layout(monkeypatch, tp: int, cp: int = 1) -> None:
    """megatron's parallel state as split_batch reads it, for one rank of a tp x cp layout."""
    from megatron.core import parallel_state

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: tp)
    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: cp)
    monkeypatch.setattr(parallel_state, "get_context_parallel_rank", lambda: 0)
    monkeypatch.setattr(parallel_state, "get_data_parallel_world_size", lambda with_context_parallel=False: 1)


@pytest.mark.parametrize("tp, cp, sp, fp8, packing, want_shape", [
    (2, 1, False, None, None, (2, 6)),  # rows of 5 and 3 tokens: the longest rounded up to 2
    (2, 1, False, "hybrid", None, (2, 16)),  # to 16 under FP8
    (4, 1, True, "hybrid", None, (2, 64)),  # 16 per TP rank with sequence parallelism
    (2, 1, False, "hybrid", "thd", (1, 16)),  # packed: 8 real tokens and a padding segment of 8
    (1, 2, False, "hybrid", None, (2, 16)),  # 32 positions, this CP rank's 16 of them
])
def test_micro_batches_follow_the_models_fp8_recipe(monkeypatch, tp, cp, sp, fp8, packing, want_shape):
    from megarl.backends.batch import TrainBatch
    from megarl.backends.megatron.forward import split_batch

    _layout(monkeypatch, tp, cp)
    batch = TrainBatch.from_sequences([[1, 2, 3], [4, 5]], [[6, 7], [8]], [[1, 1], [1]])
    config = SimpleNamespace(sequence_parallel=sp, fp8=fp8, fp8_recipe="delayed")  # a TransformerConfig's fields
    (micro,) = split_batch(batch, config, micro_batch_size=2, packing=packing)
    assert tuple(micro.input_ids.shape) == want_shape


def test_context_parallel_rows_need_a_multiple_of_two_cp():
    from megarl.backends.batch import TrainBatch
    from megarl.backends.megatron.forward import make_micro_batches

    batch = TrainBatch.from_sequences([[1, 2, 3]], [[4]], [[1]])
    with pytest.raises(ValueError, match="2 x cp"):
        make_micro_batches(batch, [[0]], multiple=2, cp=2)
