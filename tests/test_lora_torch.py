"""LoRA on the torch backend (actor.lora, PEFT): merged weights, the base frozen, the reference
as the base, checkpoints of the adapters alone, and the config's rules."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file

from megarl.backends.torch.worker import ADAPTER_FILE, TorchTrainWorker
from megarl.config import ConfigError, load_config
from test_backend_torch_actor import random_batch
from test_backend_torch_worker import CFG
from tiny_models import tiny_model

LORA = ["actor.lora.r=4", "actor.lora.lora_alpha=8", "actor.lora.target_modules=[q_proj,v_proj,down_proj]"]
SCALE = 8 / 4


def lora_worker(extra=(), seed=0, tie=False):
    model = tiny_model("qwen2", seed=seed, tie=tie)
    base = copy.deepcopy(model.state_dict())
    return TorchTrainWorker(model, load_config(None, CFG + LORA + list(extra)), total_steps=4), base


def adapters(worker) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{HF module name: (A, B)} read from the PEFT model's parameters by their names."""
    params = dict(worker.actor.model.named_parameters())
    out = {}
    for name in params:
        if name.endswith(".lora_A.default.weight"):
            module = name.removeprefix("base_model.model.").removesuffix(".lora_A.default.weight")
            out[module] = (params[name], params[name.replace("lora_A", "lora_B")])
    return out


def randomise_b(worker, seed=3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, b in adapters(worker).values():
            b.copy_(torch.randn(b.shape, generator=g) * 0.05)


def step(worker, batch, g):
    old, _ = worker.compute_log_prob(batch)
    ref = worker.compute_ref_log_prob(batch) if worker.has_reference else None
    return worker.update_actor(batch.with_fields(old_log_probs=old, advantages=torch.randn(old.shape, generator=g),
                                                 ref_log_probs=ref))


def test_the_adapters_go_on_the_named_layers_only():
    worker, _ = lora_worker()
    layers = sorted(adapters(worker))
    assert layers == sorted(f"model.layers.{i}.{m}" for i in range(2)
                            for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"))
    for a, b in adapters(worker).values():
        assert a.shape[0] == 4 and b.shape[1] == 4 and not b.any()  # B starts at zero: the model starts as the base


def test_the_engines_get_the_base_plus_the_scaled_product():
    worker, base = lora_worker()
    randomise_b(worker)
    exported = {n: t for bucket in worker.export_hf_weights(1 << 30) for n, t in bucket.items()}
    assert sorted(exported) == sorted(base)
    pairs = adapters(worker)
    for name, tensor in base.items():
        module = name.removesuffix(".weight")
        want = tensor + SCALE * pairs[module][1] @ pairs[module][0] if module in pairs else tensor
        torch.testing.assert_close(exported[name], want, atol=1e-6, rtol=0)
    assert worker.weight_checksums() == TorchTrainWorker(_loaded(exported), load_config(None, CFG), 1).weight_checksums()


def _loaded(state):
    model = tiny_model("qwen2", seed=7)
    model.load_state_dict(state)
    return model


def test_log_probs_are_the_merged_models():
    worker, _ = lora_worker()
    randomise_b(worker)
    batch, _ = random_batch()
    merged = {n: t for bucket in worker.export_hf_weights(1 << 30) for n, t in bucket.items()}
    plain = TorchTrainWorker(_loaded(merged), load_config(None, CFG), 1)
    torch.testing.assert_close(worker.compute_log_prob(batch)[0], plain.compute_log_prob(batch)[0], atol=1e-5, rtol=0)


def test_an_update_trains_the_adapters_alone():
    worker, base = lora_worker()
    batch, g = random_batch()
    trainable = [n for n, p in worker.actor.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    in_optimizer = sum(len(group["params"]) for group in worker.actor.optimizer.param_groups)
    assert in_optimizer == len(trainable) == 2 * len(adapters(worker))
    before = {n: p.detach().clone() for n, p in worker.actor.model.named_parameters()}
    step(worker, batch, g)
    for name, p in worker.actor.model.named_parameters():
        if p.requires_grad:
            assert not torch.equal(p, before[name]), name
        else:
            assert torch.equal(p, before[name]) and p.grad is None, name
    # the base's own tensors, as the model file holds them
    inner = worker.actor.model.get_base_model().state_dict()
    for name, tensor in base.items():
        module, leaf = name.rsplit(".", 1)
        ours = inner.get(name, inner.get(f"{module}.base_layer.{leaf}"))
        assert torch.equal(ours, tensor), name


def test_the_reference_is_the_base_without_a_copy():
    worker, base = lora_worker(["algorithm.use_kl_loss=true"])
    assert worker.has_reference and worker.reference is None
    batch, g = random_batch()
    step(worker, batch, g)
    plain = TorchTrainWorker(_loaded(base), load_config(None, CFG), 1)
    want = plain.compute_log_prob(batch)[0]
    torch.testing.assert_close(worker.compute_ref_log_prob(batch), want, atol=1e-6, rtol=0)
    assert not torch.allclose(worker.compute_log_prob(batch)[0], want, atol=1e-4)  # the adapters are on again


@pytest.mark.parametrize("tie", [False, True])
def test_a_checkpoint_holds_the_adapters_and_resumes_exactly(tmp_path, tie):
    batch, g = random_batch(seed=5)
    advantages = [torch.randn(batch.input_ids.shape, generator=g) for _ in range(3)]

    def train(worker, advs):
        for adv in advs:
            old, _ = worker.compute_log_prob(batch)
            worker.update_actor(batch.with_fields(old_log_probs=old, advantages=adv))

    straight, _ = lora_worker(tie=tie)
    train(straight, advantages)

    first, _ = lora_worker(tie=tie)
    train(first, advantages[:2])
    first.save_checkpoint(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([ADAPTER_FILE, "actor_optim.pt", "rng.pt"])
    saved = load_file(tmp_path / ADAPTER_FILE)
    assert len(saved) == 2 * len(adapters(first)) and all(".lora_A." in n or ".lora_B." in n for n in saved)
    assert all(n.startswith("base_model.model.model.layers.") for n in saved)  # PEFT's file names

    resumed, _ = lora_worker(tie=tie)
    resumed.load_checkpoint(tmp_path)
    train(resumed, advantages[2:])
    assert resumed.weight_checksums() == straight.weight_checksums()


def test_a_checkpoint_without_adapters_is_refused_by_name(tmp_path):
    plain = TorchTrainWorker(tiny_model("qwen2"), load_config(None, CFG), 1)
    plain.save_checkpoint(tmp_path)
    worker, _ = lora_worker()
    with pytest.raises(FileNotFoundError, match=r"lacks \['actor_adapter.safetensors'\].*actor.lora.r=4"):
        worker.load_checkpoint(tmp_path)


def test_all_linear_names_every_layer():
    cfg = load_config(None, ["actor.lora.r=8", "actor.lora.target_modules=[all-linear]"])
    assert cfg.actor.lora.modules() == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert cfg.actor.lora.scaling == 2.0


@pytest.mark.parametrize("overrides, key, words", [
    (["actor.lora.r=4", "actor.lora.target_modules=[q_proj,lm_head]"], "actor.lora.target_modules",
     "names ['lm_head'], which are not linear layers megarl adapts"),
    (["actor.lora.r=4", "actor.lora.target_modules=[]"], "actor.lora.target_modules", "is empty"),
    (["critic.enable=true", "critic.lora.r=4", "algorithm.adv_estimator=gae"], "critic.lora.r",
     "the critic trains every weight"),
    (["actor.lora.r=-1"], "actor.lora.r", ">= 0"),
    (["actor.lora.r=4", "actor.lora.lora_dropout=1.0"], "actor.lora.lora_dropout", "< 1.0"),
])
def test_bad_lora_settings_are_named(overrides, key, words):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert any(p.key == key and words in str(p) for p in err.value.problems), str(err.value)
