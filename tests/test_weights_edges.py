"""megarl.weights at its edges: the probe's tolerances and its reading of a model's config, its
errors word for word, the buckets' sizes at their boundaries, and the engine routes' helpers."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from megarl.weights.probe import Mismatch, WeightProbe, default_tolerance, is_mixture_of_experts


@pytest.mark.parametrize("dtype, on_gpu, moe, want", [
    ("float32", False, False, 1e-4), ("float32", True, False, 1e-3), ("float32", True, True, 1e-2),
    ("bfloat16", False, False, 0.05), ("bfloat16", True, True, 0.5), ("float16", True, False, 0.05),
])
def test_the_probes_tolerance_by_dtype_device_and_experts(dtype, on_gpu, moe, want):
    assert default_tolerance(dtype, on_gpu, moe) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("config, want", [
    ({"num_experts": 8}, True), ({"num_local_experts": 4}, True), ({"n_routed_experts": 64}, True),
    ({"text_config": {"num_experts": 2}, "num_experts": 0}, True),  # a multimodal config's text model
    ({"num_experts": 1}, False), ({"num_experts": None}, False), ({"hidden_size": 8}, False),
    ({"text_config": {"hidden_size": 8}, "num_experts": 8}, False),  # the text model's config is the one read
])
def test_a_mixture_of_experts_is_read_from_the_config(tmp_path, config, want):
    (tmp_path / "config.json").write_text(json.dumps(config))
    is_mixture_of_experts.cache_clear()
    assert is_mixture_of_experts(str(tmp_path)) is want


def test_a_config_that_cannot_be_read_is_not_a_mixture_of_experts(tmp_path):
    is_mixture_of_experts.cache_clear()
    assert is_mixture_of_experts(str(tmp_path / "missing")) is False
    (tmp_path / "config.json").write_text("{oops")
    assert is_mixture_of_experts(str(tmp_path)) is False


def test_a_mismatch_is_described_in_one_line():
    assert Mismatch("engine0", 0.12345, 2.5, 30).describe(1e-4) == (
        "engine0: mean |engine - trainer| log-prob 0.123 a token over 30 probe tokens (largest 2.5; tolerance 0.0001)")


def test_the_probe_refuses_what_it_cannot_compare():
    with pytest.raises(ValueError) as error:
        WeightProbe([], 0.1)
    assert str(error.value) == "the weights probe needs at least one sequence of two or more tokens"
    p = WeightProbe([[1, 2, 3], [4, 5]], 0.1)
    with pytest.raises(RuntimeError) as error:
        asyncio.run(p.mismatches(None))
    assert str(error.value) == "the weights probe has no trainer log-probs yet (WeightProbe.expect)"
    with pytest.raises(ValueError) as error:
        p.expect([torch.zeros(2), torch.zeros(2)], 3)  # the second sequence scores one token
    assert str(error.value) == "the trainer's probe log-probs do not cover every scored token of the probe"
    p.expect([torch.zeros(2, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.float64)], 3)
    assert p.version == 3 and [t.dtype for t in p.expected] == [torch.float32, torch.float32]


def test_a_mismatch_exactly_at_the_tolerance_passes():
    p = WeightProbe([[1, 2]], 0.25)
    p.expect([torch.tensor([-1.0])], 1)

    class Engine:
        async def probe_log_probs(self, sequences):
            return {"at": [[-1.25]], "past": [[-1.2500001]]}

    assert [m.engine for m in asyncio.run(p.mismatches(Engine()))] == ["past"]

