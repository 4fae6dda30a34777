"""The megatron trainer's sleep (trainer.sleep_during_generation) on gloo ranks: every
parameter (megatron's contiguous buffers), every master weight and Adam moment of the
distributed optimizer, and the frozen reference leave the device and come back bit for bit,
the gradient buffers come back as zeros, and the next update is the one ranks that never
slept make."""

from __future__ import annotations

import pytest
import torch

from megatron_cases import sleep_phase
from megatron_dist import run_distributed
from test_megatron_worker import update_batch
from tiny_models import tiny_hf_model

pytestmark = pytest.mark.megatron  # megatron-core runs here: make test-compat runs these on its newest release too

TP2_PP2 = ["actor.parallel.tensor_model_parallel_size=2", "actor.parallel.pipeline_model_parallel_size=2"]
EP2 = ["actor.parallel.expert_model_parallel_size=2"]
REFERENCE = ["algorithm.use_kl_loss=true"]


@pytest.mark.slow  # 35 s: with the megatron runs of make test-slow
@pytest.mark.parametrize("family, ranks, layout", [("qwen2", 4, TP2_PP2 + REFERENCE), ("qwen3_moe", 2, EP2)],
                         ids=["tp2-pp2-reference", "ep2"])
def test_every_tensor_comes_back_bit_for_bit_and_the_next_update_is_unchanged(tmp_path, family, ranks, layout):
    model = tiny_hf_model(family)
    model.save_pretrained(tmp_path)
    first, second = update_batch(model, 1), update_batch(model, 2)
    slept = run_distributed(ranks, sleep_phase, str(tmp_path), layout, first, second, True)
    awake = run_distributed(ranks, sleep_phase, str(tmp_path), layout, first, second, False)
    for rank, (freed, left, differ, nonzero, log_probs) in enumerate(slept):
        assert freed > 0 and left == 0, f"rank {rank}: {left} storages kept on the device while asleep"
        assert differ == 0, f"rank {rank}: {differ} tensors differ after waking"
        assert nonzero == 0, f"rank {rank}: gradient buffers not zero after waking"
        assert torch.equal(log_probs, awake[rank][4]), f"rank {rank}: the update after waking differs"
