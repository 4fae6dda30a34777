"""The weights probe's tolerance calibrated at run time (megarl.weights.probe, sync.probe): the
first probe measures the noise floor between the engines and the trainer holding the same
weights, the tolerance in force becomes the larger of sync.probe.tolerance and
sync.probe.noise_multiple x the floor, and a floor above sync.probe.ceiling stops the run; the
default bounds by dtype, device, experts and the trainer's FP8; a mixture of experts recognised
from the HF config wherever model.path finds it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.weights.probe import WeightProbe, WrongWeights, default_ceiling, default_tolerance

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("bound, multiple, floor, want", [
    (0.05, 3, 0.01, 0.05),  # 3 x 0.01 = 0.03 is below the bound: the bound stays
    (0.05, 3, 0.04, 0.12),  # 3 x 0.04 above it
    (1e-4, 3, 1e-6, 1e-4),  # float32 on the CPU: the engines agree to 1e-6
    (0.05, 5, 0.02, 0.1),
])
def test_the_tolerance_in_force_is_the_bound_or_a_multiple_of_the_floor(bound, multiple, floor, want):
    probe = WeightProbe([[1, 2]], bound, multiple=multiple, ceiling=1.0)
    assert probe.tolerance == bound and probe.floor is None  # not calibrated yet: the bound
    probe.calibrate(floor)
    assert probe.floor == floor and probe.tolerance == pytest.approx(want, rel=1e-12)
    assert probe.bound == bound


def test_a_floor_above_the_ceiling_is_refused():
    probe = WeightProbe([[1, 2]], 0.05, multiple=3, ceiling=0.5)
    with pytest.raises(ValueError, match="noise floor 0.6 a token is above the ceiling 0.5"):
        probe.calibrate(0.6)
    with pytest.raises(ValueError, match="noise floor nan"):
        probe.calibrate(float("nan"))
    assert probe.floor is None and probe.tolerance == 0.05


@pytest.mark.parametrize("dtype, on_gpu, moe, fp8, want", [
    ("bfloat16", True, False, False, 0.05),
    ("bfloat16", True, False, True, 0.05 + 0.1),  # the FP8 trainer's gap to a bf16 one added
    ("bfloat16", True, True, True, 0.5 + 0.1),
    ("float32", False, False, False, 1e-4),
])
def test_the_default_bound_by_dtype_experts_and_fp8(dtype, on_gpu, moe, fp8, want):
    assert default_tolerance(dtype, on_gpu, moe, fp8) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("bound, want", [
    (0.05, 0.5),  # 10 x the bound
    (1e-4, 1e-3),
    (0.5, 2.0),  # 10 x would be 5 nats: at most 2
    (0.6, 2.0),
    (3.0, 3.0),  # never below the bound itself
])
def test_the_default_ceiling(bound, want):
    assert default_ceiling(bound) == pytest.approx(want, rel=1e-12)


def test_the_config_resolves_the_bound_with_fp8_and_the_ceiling(tmp_path):
    from megarl.config import load_config

    gpu = ["model.path=m", "model.dtype=bfloat16", "cluster.gpus_per_node=8"]
    cfg = load_config(None, gpu + ["actor.backend=megatron", "actor.fp8=hybrid"])
    assert cfg.probe_tolerance() == pytest.approx(0.15) and cfg.probe_ceiling() == pytest.approx(1.5)
    cfg = load_config(None, gpu + ["sync.probe.tolerance=0.02", "sync.probe.ceiling=0.3"])
    assert cfg.probe_tolerance() == 0.02 and cfg.probe_ceiling() == 0.3


def test_a_ceiling_below_the_bound_is_refused_by_name():
    from megarl.config import load_config
    from megarl.config_loader import ConfigError

    with pytest.raises(ConfigError, match=r"sync.probe.ceiling: 0.01 is below sync.probe.tolerance=0.05"):
        load_config(None, ["model.path=m", "sync.probe.tolerance=0.05", "sync.probe.ceiling=0.01"])


def test_a_mixture_of_experts_is_recognised_from_a_hub_id_in_the_local_cache(tmp_path):
    """model.path a hub id, its config in the HF cache (no directory of that name): before, only a
    directory's config.json was read, and the model counted as dense."""
    snapshot = tmp_path / "hub" / "models--acme--tiny-moe" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 8}))
    (tmp_path / "hub" / "models--acme--tiny-moe" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--tiny-moe" / "refs" / "main").write_text("abc123")
    # a process of its own: huggingface_hub reads its cache's place and offline mode at import
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    code = ("from megarl.weights.probe import is_mixture_of_experts as moe; "
            "print(moe('acme/tiny-moe'), moe('acme/absent'))")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False"]


# -- the runtime: the embedded engine beside the torch trainer (float32 on the CPU: they agree
# within 1e-5 a token), its answers shifted by a known offset

@pytest.fixture
def components(tiny_inputs, tmp_path):
    from megarl.components import build_components
    from megarl.config import load_config
    from train_fixtures import tiny_overrides

    c = build_components(load_config(None, tiny_overrides(tiny_inputs, tmp_path) + [
        "sync.probe.tolerance=0.005", "sync.probe.noise_multiple=3", "sync.probe.ceiling=0.1"]))
    yield c
    c.close()


def shift_answers(engine, monkeypatch) -> dict:
    """Every log-prob the engine answers the probe with moved by offset["by"] (nats)."""
    offset = {"by": 0.0}
    answer = engine.probe_log_probs

    async def shifted(sequences):
        return {name: [[x + offset["by"] for x in row] for row in rows]
                for name, rows in (await answer(sequences)).items()}

    monkeypatch.setattr(engine, "probe_log_probs", shifted)
    return offset


@pytest.mark.parametrize("offset, floor, tolerance, reloads", [
    (0.004, 0.004, 0.012, 0),  # within the bound 0.005: measured as it is; 3 x 0.004 = 0.012 in force
    (0.001, 0.001, 0.005, 0),  # 3 x 0.001 = 0.003: the bound stays
    (0.02, 0.02, 0.06, 1),  # above the bound: measured again after one reload, below the ceiling 0.1
])
def test_the_first_probe_measures_the_floor_and_sets_the_tolerance(components, monkeypatch, offset, floor,
                                                                  tolerance, reloads):
    runtime = components.runtime
    shift_answers(runtime.engine, monkeypatch)["by"] = offset
    runtime.for_generation()  # the engines' start: the first probe
    assert runtime.weight_reloads == reloads
    assert runtime.probe.floor == pytest.approx(floor, abs=2e-5)
    assert runtime.probe.tolerance == pytest.approx(tolerance, abs=6e-5)
    metrics = components.engine_metrics()
    assert metrics["rollout/probe_noise_floor"] == pytest.approx(floor, abs=2e-5)
    assert metrics["rollout/probe_tolerance"] == pytest.approx(tolerance, abs=6e-5)


def test_the_calibrated_tolerance_judges_the_later_probes(components, monkeypatch):
    runtime = components.runtime
    offset = shift_answers(runtime.engine, monkeypatch)
    offset["by"] = 0.004
    runtime.for_generation()  # tolerance 0.012
    offset["by"] = 0.01  # beyond the bound 0.005, within 0.012: no reload
    runtime.check_engine_weights("a test's event")
    assert runtime.weight_reloads == 0
    offset["by"] = 0.02
    with pytest.raises(WrongWeights, match=r"after a test's event, and again after they were loaded once more: "
                                           r"embedded engine: mean \|engine - trainer\| log-prob 0.02 a token .*"
                                           r"tolerance 0.012\)"):
        runtime.check_engine_weights("a test's event")
    assert runtime.weight_reloads == 1
    assert runtime.probe.floor == pytest.approx(0.004, abs=2e-5)  # calibrated once, not again


def test_wrong_weights_at_the_start_do_not_calibrate_themselves_into_acceptance(components, monkeypatch):
    runtime = components.runtime
    shift_answers(runtime.engine, monkeypatch)["by"] = 0.5  # the engines stay 0.5 a token off, reload or not
    with pytest.raises(WrongWeights, match=r"embedded engine serves other weights than the trainer's \(version 0\) "
                                           r"after the engines started, and again after they were loaded once more: "
                                           r"embedded engine: mean \|engine - trainer\| log-prob 0.5 a token over \d+ "
                                           r"probe tokens \(largest 0.5; ceiling 0.1\); sync.probe.ceiling=0.1 is the "
                                           r"largest noise floor .* raise sync.probe.ceiling. The run stopped"):
        runtime.for_generation()
    assert runtime.weight_reloads == 1 and runtime.probe.floor is None
