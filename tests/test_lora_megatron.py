"""LoRA on the megatron backend (megarl.backends.megatron.lora) against HF + PEFT holding the same
weights and adapters, on CPU (gloo, fp32) as multi-process runs: log-probs within 1e-5 at TP 2, PP 2
and EP 2, the base's without the adapters, the merged export equal to PEFT's merge, and the
adapters exported under PEFT's names exactly."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

from lora_cases import lora_logprobs, lora_worker_run
from megarl.backends.torch.logprobs import token_log_probs
from megatron_dist import run_distributed
from test_megatron_numerics import a_batch
from tiny_models import tiny_hf_model

pytestmark = pytest.mark.megatron

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_model(family: str, targets: list[str], tied: bool = False):
    """(the HF model, it with PEFT's adapters, A and B random: B is no longer zero)."""
    base = tiny_hf_model(family, tie_word_embeddings=tied)
    adapted = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return base, adapted.eval()


@pytest.mark.parametrize("family, layout, world, targets, tied", [
    ("qwen2", dict(tp=2), 2, ALL, False),
    ("qwen3", dict(pp=2), 2, ["q_proj", "v_proj", "down_proj"], True),
    ("llama", dict(tp=2, pp=2), 4, ["k_proj", "o_proj", "up_proj"], False),
    # a mixture of experts: attention only (PEFT would put its MLP targets on the experts' 3-D tensors)
    ("qwen3_moe", dict(ep=2), 2, ["q_proj", "k_proj", "v_proj", "o_proj"], False),
])
def test_log_probs_and_merged_weights_match_hf_with_peft(tmp_path, family, layout, world, targets, tied):
    base, adapted = peft_model(family, targets, tied)
    base.save_pretrained(tmp_path)
    state = get_peft_model_state_dict(adapted)
    batch = a_batch(base.config.vocab_size)
    with torch.no_grad():
        want, _ = token_log_probs(adapted, batch.input_ids, batch.attention_mask)
        want_base, _ = token_log_probs(base, batch.input_ids, batch.attention_mask)
        merged_want = copy.deepcopy(adapted).merge_and_unload().state_dict()
    results = run_distributed(world, lora_logprobs, str(tmp_path), layout, batch,
                              dict(r=4, lora_alpha=8, target_modules=targets), state)
    real = batch.attention_mask.bool().clone()
    real[:, 0] = False
    merged, peft = {}, {}
    for with_adapters, without, stage_merged, stage_peft, frozen, trainable in results:
        torch.testing.assert_close(with_adapters[real], want[real], rtol=0, atol=1e-5)
        torch.testing.assert_close(without[real], want_base[real], rtol=0, atol=1e-5)
        assert frozen and trainable and all(".lora.by_name." in n for n in trainable)
        merged.update(stage_merged)
        peft.update(stage_peft)
    assert not torch.allclose(want[real], want_base[real], atol=1e-3)  # the adapters change the model
    from megarl.models.hf_layout import checkpoint_views

    views = checkpoint_views(base)
    assert merged.keys() == views.keys()
    for name in views:
        torch.testing.assert_close(merged[name], dict(checkpoint_views_of(merged_want, base))[name], rtol=0, atol=1e-6)
    assert peft.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(peft[name], tensor), name


def checkpoint_views_of(state: dict, like):
    """PEFT's merged state dict under the HF checkpoint's names (the model `like` gives the layout)."""
    from megarl.models.hf_layout import checkpoint_views

    model = copy.deepcopy(like)
    model.load_state_dict(state, strict=False)
    return checkpoint_views(model).items()


def lora_torch_run(hf_dir, batches):
    """The torch backend's LoRA actor on the same settings: its adapters (PEFT's names), log-probs and
    reference log-probs of the last batch after an update on each batch."""
    from transformers import AutoModelForCausalLM

    from lora_cases import LORA
    from megarl.backends.torch.lora import adapter_state
    from megarl.backends.torch.worker import TorchTrainWorker
    from megarl.config import load_config

    cfg = load_config(None, [f"model.path={hf_dir}", "model.dtype=float32", "rollout.n=2",
                             "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size=2", "actor.optim.lr=1e-3",
                             "actor.optim.eps=1e-3", "actor.optim.lr_warmup_steps=0", *LORA])
    w = TorchTrainWorker(AutoModelForCausalLM.from_pretrained(hf_dir), cfg, total_steps=10)
    for batch in batches:
        w.update_actor(batch.with_fields(ref_log_probs=w.compute_ref_log_prob(batch)))
    return adapter_state(w.actor.model), w.compute_log_prob(batches[-1])[0], w.compute_ref_log_prob(batches[-1])


@pytest.mark.parametrize("family, layout, world", [
    ("qwen2", ["actor.parallel.tensor_model_parallel_size=2"], 2),
    # at PP 2 the adapters are read as actor.lora.sync=adapter sends them: each stage's own, PEFT-named
    ("qwen3", ["actor.parallel.pipeline_model_parallel_size=2", "actor.lora.sync=adapter", "rollout.engine=sglang",
               "cluster.launcher=ray"], 2)])
def test_lora_steps_on_megatron_equal_the_torch_backends(tmp_path, family, layout, world):
    """Two updates with a KL term (the reference: the base, adapters off): the same adapters, log-probs
    and reference log-probs as the torch backend's PEFT model, from the same starting adapters."""
    from test_megatron_worker import update_batch

    model = tiny_hf_model(family)
    model.save_pretrained(tmp_path)
    batches = [update_batch(model, 1), update_batch(model, 2)]
    want_adapters, want_lp, want_ref = lora_torch_run(str(tmp_path), batches)
    results = run_distributed(world, lora_worker_run, str(tmp_path), layout, batches)
    real = batches[-1].loss_mask.bool()  # where the torch backend takes log-probs (the responses)
    with torch.no_grad():
        base_lp, _ = token_log_probs(model, batches[-1].input_ids, batches[-1].attention_mask)
    adapters = {}
    for stage_adapters, log_probs, ref in results:
        torch.testing.assert_close(log_probs[real], want_lp[real], rtol=0, atol=1e-5)
        torch.testing.assert_close(ref[real], base_lp[real], rtol=0, atol=1e-5)  # the base itself
        adapters.update(stage_adapters)
    torch.testing.assert_close(want_ref[real], base_lp[real], rtol=0, atol=1e-5)
    assert (want_lp - base_lp)[real].abs().max() > 1e-3  # the adapters trained
    assert adapters.keys() == want_adapters.keys()
    for name, tensor in want_adapters.items():
        torch.testing.assert_close(adapters[name], tensor, rtol=0, atol=1e-5, msg=name)


def test_a_lora_checkpoint_holds_the_adapters_and_resumes_exactly_on_another_layout(tmp_path):
    """Saved at TP 2 after one update, loaded at PP 2: the next update lands where an uninterrupted
    run's does; the checkpoint holds the adapters and their optimizer state, nothing of the base."""
    from megarl.backends.megatron.dist_format import read_dist_metadata
    from test_megatron_worker import update_batch

    model = tiny_hf_model("llama")
    model.save_pretrained(tmp_path / "hf")
    batches = [update_batch(model, 1), update_batch(model, 2)]
    hf, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    tp2, pp2 = ["actor.parallel.tensor_model_parallel_size=2"], ["actor.parallel.pipeline_model_parallel_size=2"]
    straight = run_distributed(2, lora_worker_run, hf, tp2, batches)
    run_distributed(2, lora_worker_run, hf, tp2, batches, ckpt, "save")
    resumed = run_distributed(2, lora_worker_run, hf, pp2, batches, ckpt, "load")
    want = {n: t for r in straight for n, t in r[0].items()}
    got = {n: t for r in resumed for n, t in r[0].items()}
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-6, msg=name)
    keys = [k for k in read_dist_metadata(tmp_path / "ckpt" / "actor").state_dict_metadata
            if not k.startswith("common_state")]  # megatron 0.19's own bookkeeping, no tensor of the model
    assert keys and all(".lora." in k for k in keys), [k for k in keys if ".lora." not in k][:5]
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("actor_adapter*")) == \
        ["actor_adapter-00001-of-00001.safetensors"]  # TP 2: one stage, written by its source rank
