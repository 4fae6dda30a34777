"""The trainer's sleep (megarl.backends.sleep): storages freed and back bit for bit, views and
tied weights intact, gradients back as zeros, host buffers allocated once and reused."""

from __future__ import annotations

import pytest
import torch

from megarl.backends.sleep import TrainerSleep, optimizer_tensors


def test_storages_are_freed_and_come_back_bit_for_bit_views_included():
    torch.manual_seed(0)
    flat = torch.randn(100)
    first, second = flat[:40].view(4, 10), flat[40:]  # two views of one storage (megatron's buffers)
    other = torch.randn(7, dtype=torch.bfloat16)
    grad = torch.randn(30)
    want = [flat.clone(), other.clone()]
    sleep = TrainerSleep("cpu")
    sleep.sleep([first, second, other, None], drop=[grad])
    assert sleep.asleep
    assert flat.untyped_storage().nbytes() == 0 and other.untyped_storage().nbytes() == 0
    assert grad.untyped_storage().nbytes() == 0
    assert sleep.host_bytes == 512 + 512  # one copy of each storage (400 and 14 bytes, each from a 512-byte
    # boundary of the pool), the dropped one not copied
    sleep.wake()
    assert not sleep.asleep
    assert torch.equal(flat, want[0]) and torch.equal(other, want[1])
    assert torch.equal(first, want[0][:40].view(4, 10)) and torch.equal(second, want[0][40:])
    assert torch.equal(grad, torch.zeros(30))


def test_host_buffers_are_reused_from_one_sleep_to_the_next():
    a, b = torch.randn(64), torch.randn(64)
    sleep = TrainerSleep("cpu")
    sleep.sleep([a, b])
    buffers = {host.data_ptr() for _, _, host in sleep._kept}
    sleep.wake()
    a.add_(1.0)  # a training phase changes the values in place
    want = [a.clone(), b.clone()]
    sleep.sleep([a, b])
    assert {host.data_ptr() for _, _, host in sleep._kept} == buffers and sleep.host_bytes == 2 * 512
    sleep.wake()
    assert torch.equal(a, want[0]) and torch.equal(b, want[1])


def test_the_host_copies_are_one_pinned_pool_of_their_bytes_not_a_power_of_two_each():
    """Before: one torch.empty(pin_memory=True) a storage, each rounded up by torch's pinned
    allocator to a power of two (a 600 MB shard took 1 GiB). Now: one pool, its bytes those of the
    storages (each from a 512-byte boundary), page-locked once; grown once when a later sleep holds
    more (Adam's state appears at the first step), the first pool unpinned."""
    registered, unpinned = [], []

    def register(pool):
        registered.append((pool.data_ptr(), pool.numel()))
        return lambda: unpinned.append(pool.numel())

    sizes = [3_000, 1_000_001, 77]  # odd sizes: torch's pinned blocks would be 4 KiB, 1 MiB... each
    tensors = [torch.randn(n) for n in sizes]
    want = [t.clone() for t in tensors]
    sleep = TrainerSleep("cpu", pin=True, register=register)
    sleep.sleep(tensors[:2])
    first = sum(-(-4 * n // 512) * 512 for n in sizes[:2])  # 12,288 + 4,000,256 bytes
    assert registered == [(registered[0][0], first)] and sleep.host_bytes == first
    sleep.wake()
    sleep.sleep(tensors[:2])  # the same state: the same pool, no second registration
    assert len(registered) == 1
    sleep.wake()
    sleep.sleep(tensors)  # more state: one larger pool, the first one unpinned
    assert [n for _, n in registered] == [first, first + 512] and unpinned == [first]
    assert sleep.host_bytes == first + 512 < sum(1 << (4 * n - 1).bit_length() for n in sizes)
    sleep.wake()
    assert all(torch.equal(t, w) for t, w in zip(tensors, want))


def test_a_mapped_tensor_gets_memory_of_its_own_and_a_tied_weight_is_kept_once(tmp_path):
    from safetensors.torch import load_file, save_file

    save_file({"w": torch.arange(12, dtype=torch.float32)}, str(tmp_path / "w.safetensors"))
    mapped = torch.nn.Parameter(load_file(str(tmp_path / "w.safetensors"))["w"])
    tied = [mapped, mapped]  # an embedding and the output layer: one tensor under two names
    sleep = TrainerSleep("cpu")
    sleep.sleep(tied)
    assert len(sleep._kept) == 1 and mapped.untyped_storage().nbytes() == 0
    sleep.wake()
    assert torch.equal(mapped.detach(), torch.arange(12, dtype=torch.float32))


def test_an_optimizers_state_sleeps_and_the_next_step_is_the_same():
    torch.manual_seed(0)
    models = [torch.nn.Linear(8, 4) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    x = torch.randn(16, 8)

    def step(model, optimizer):
        optimizer.zero_grad(set_to_none=False)
        model(x).square().mean().backward()
        optimizer.step()

    for model, optimizer in zip(models, optimizers):
        step(model, optimizer)
    sleep = TrainerSleep("cpu")
    model, optimizer = models[1], optimizers[1]
    sleep.sleep([*model.parameters(), *optimizer_tensors(optimizer)], drop=[p.grad for p in model.parameters()])
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    assert all(v.untyped_storage().nbytes() == 0 for s in optimizer.state.values() for v in s.values())
    sleep.wake()
    for model, optimizer in zip(models, optimizers):
        step(model, optimizer)
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b)
    for a, b in zip(optimizers[0].state.values(), optimizers[1].state.values()):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_run_whose_trainer_sleeps_ends_on_the_same_weights_bit_for_bit(tiny_inputs, tiny_reference, tmp_path, capsys):
    from megarl.config import load_config
    from megarl.train import train
    from train_fixtures import hf_weights, mlflow_metric, tiny_overrides

    out = tmp_path / "run"
    # the reference run's settings (train_fixtures.tiny_reference_run), the trainer asleep while the engine generates
    train(load_config(None, tiny_overrides(tiny_inputs, out, 2) + [
        "reward.custom_function=reward_fixtures:length_score", "trainer.sleep_during_generation=true"]))
    reference, got = hf_weights(tiny_reference / "hf"), hf_weights(out / "hf")
    assert sorted(got) == sorted(reference)
    assert all(torch.equal(got[name], tensor) for name, tensor in reference.items())
    assert not torch.equal(reference["lm_head.weight"], hf_weights(tiny_inputs["model"])["lm_head.weight"])
    # each step: asleep after its weight sync, awake after the next generation (validation and checkpoint between)
    assert len(mlflow_metric(out, "perf/trainer_offload_s")) == 2
    assert len(mlflow_metric(out, "perf/trainer_onload_s")) == 2
    assert "trainer asleep while the engines generated:" in capsys.readouterr().out  # the closing summary says it


# -- Transformer Engine's quantized tensors, stood in for on the CPU: wrapper tensors whose bytes
# live in inner buffers, in the shapes TE's releases give them (TE 2.8 to 2.20, read from its source)

class _Wrapper(torch.Tensor):
    """A wrapper subclass as torch makes it (TE < 2.16: its storage's data pointer raises), its
    inner buffers set from `buffers` (name -> tensor or None), computing nothing."""

    @staticmethod
    def __new__(cls, shape, **buffers):
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.bfloat16, device="cpu")
        for name, value in buffers.items():
            setattr(t, name, value)
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"the stand-in computes nothing ({func})")


class Float8Before216(_Wrapper):
    """Float8Tensor, TE 2.8-2.15: _data, _scale_inv, _transpose; torch's wrapper storage."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale_inv: torch.Tensor):
        return _Wrapper.__new__(cls, data.shape, _data=data, _scale_inv=scale_inv, _transpose=None)


class Float8From216(Float8Before216):
    """TE >= 2.16: every quantized tensor answers an empty storage."""

    def untyped_storage(self):
        return torch.UntypedStorage(0)


class BlockwiseFrom29To215(_Wrapper):
    """Float8BlockwiseQTensor, TE 2.9-2.15: its storage is its rowwise data's, alone."""

    def untyped_storage(self):
        return self._rowwise_data.untyped_storage()


class HybridFrom219(Float8From216):
    """HybridQuantizedTensor, TE 2.19: two quantized tensors nested (rowwise, columnwise)."""


class IdentityFrom219(Float8From216):
    """IdentityTensor, TE 2.19: its high-precision data."""


class GroupedTensor(_Wrapper):
    """TE >= 2.14's GroupedTensor (the experts' single grouped weight): names without the
    underscore, torch's wrapper storage (no override). The class name is what megarl knows it by."""


def _bytes_of(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 255, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _te_shapes():
    """(id, the wrapper, its leaf buffers by hand)."""
    data, scale = _bytes_of(128, 1).view(8, 16), torch.tensor([0.5])
    yield "float8 te<2.16", Float8Before216(data, scale), [data, scale]
    data, scale = data.clone(), scale.clone()
    yield "float8 te>=2.16", Float8From216(data, scale), [data, scale]
    rows, cols, rs, cs = _bytes_of(128, 2).view(8, 16), _bytes_of(128, 3).view(16, 8), torch.ones(1, 1), torch.ones(1, 1)
    yield "blockwise te2.9-2.15", BlockwiseFrom29To215(
        (8, 16), _rowwise_data=rows, _columnwise_data=cols, _rowwise_scale_inv=rs, _columnwise_scale_inv=cs), \
        [rows, cols, rs, cs]
    a, b = _bytes_of(64, 4).view(4, 16), _bytes_of(64, 5).view(16, 4)
    sa, sb = torch.tensor([2.0]), torch.tensor([4.0])
    yield "hybrid te2.19", _Wrapper.__new__(HybridFrom219, (4, 16), _rowwise_storage=Float8From216(a, sa),
                                            _columnwise_storage=Float8From216(b, sb)), [a, sa, b, sb]
    hp = torch.randn(4, 4)
    yield "identity te2.19", _Wrapper.__new__(IdentityFrom219, (4, 4), _hp_data=hp), [hp]
    grouped = {"rowwise_data": _bytes_of(96, 6), "columnwise_data": None, "scale_inv": torch.ones(3),
               "columnwise_scale_inv": None, "amax": torch.tensor([3.0]), "columnwise_amax": None,
               "scale": torch.tensor([1.0]), "first_dims": None, "last_dims": None,
               "tensor_offsets": torch.tensor([0, 32, 64])}
    yield "grouped te>=2.14", GroupedTensor((96,), **grouped), [v for v in grouped.values() if v is not None]


@pytest.mark.parametrize("param, leaves", [s[1:] for s in _te_shapes()], ids=[s[0] for s in _te_shapes()])
def test_fp8_parameters_sleep_through_their_inner_buffers(param, leaves):
    # before: te<2.16 raised at the first sleep (the storage's data pointer), te>=2.16 was skipped
    # (an empty storage), blockwise moved its rowwise data alone, grouped raised
    want = [leaf.clone() for leaf in leaves]
    sleep = TrainerSleep("cpu")
    sleep.sleep([param])
    assert [leaf.untyped_storage().nbytes() for leaf in leaves] == [0] * len(leaves)
    assert sleep.host_bytes == 512 * len(leaves)  # each leaf's slice of the pool, rounded up to 512 bytes
    sleep.wake()
    assert all(torch.equal(leaf, w) for leaf, w in zip(leaves, want))


def test_the_fp8_weight_workspaces_are_dropped_at_sleep():
    class Linear(torch.nn.Module):  # what a TE layer holds: its weight, and the FP8 copy it caches
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(16, 8))
            self._fp8_workspaces = {"weight": Float8From216(torch.zeros(16, 8, dtype=torch.uint8), torch.ones(1))}

    from megarl.backends.sleep import WorkerSleep, free_fp8_workspaces

    model = torch.nn.Sequential(Linear(), torch.nn.Sequential(Linear()))
    assert free_fp8_workspaces([model]) == 2 * (16 * 8 + 4)  # each workspace's FP8 bytes and scale
    assert all(m._fp8_workspaces == {} for m in model.modules() if isinstance(m, Linear))
    assert free_fp8_workspaces([model]) == 0
    # a worker's sleep drops them before anything else (the first part, its weights still there)
    model = torch.nn.Sequential(Linear(), torch.nn.Sequential(Linear()))
    sleep = WorkerSleep("cpu")
    sleep.sleep([model], [], keep_weights=True)
    assert all(m._fp8_workspaces == {} for m in model.modules() if isinstance(m, Linear))
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())
    sleep.sleep([model], [])  # then the weights
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    sleep.wake()


def test_the_fp8_caches_the_probe_rebuilds_are_dropped_before_the_engines_generate(tiny_inputs, tmp_path):
    """A colocated sync sleeps the trainer's state (its FP8 caches dropped), then the probe's forward
    rebuilds them (TE caches the FP8 weight at every forward megatron runs), then the weights sleep.
    Before: that second sleep skipped the drop, and the caches (about 1 byte a parameter) stayed on
    the GPU through the generation, next to a KV cache sized without them."""
    from megarl.components import build_components
    from megarl.config import load_config
    from train_fixtures import tiny_overrides

    c = build_components(load_config(None, tiny_overrides(tiny_inputs, tmp_path) + [
        "trainer.sleep_during_generation=true"]))
    try:
        layers = [m for m in c.runtime.worker.actor.model.modules() if isinstance(m, torch.nn.Linear)]
        forwards = []

        def caches_fp8_weight(module, args):  # what a TE layer does at each forward: its FP8 weight cached
            forwards.append(module)
            module._fp8_workspaces = {"weight": Float8From216(torch.zeros(4, dtype=torch.uint8), torch.ones(1))}

        for layer in layers:
            layer.register_forward_pre_hook(caches_fp8_weight)
        c.runtime.sync_weights(1)
        assert forwards, "the probe ran no forward: the test proves nothing"
        assert c.runtime._trainer_asleep
        assert [m for m in layers if getattr(m, "_fp8_workspaces", None)] == []
    finally:
        c.close()
