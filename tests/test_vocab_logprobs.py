"""Chunked log-probs and entropy (megarl.backends.vocab_logprobs) against the obvious full-tensor
formulas: values and gradients, with a temperature, padding, chunks that do not divide the
tokens, and vocabulary slices over two ranks."""

from __future__ import annotations

import pytest
import torch

from megarl.algo import entropy_from_logits
from megarl.backends.vocab_logprobs import token_log_probs_from_logits


def reference(logits, targets, temperature, vocab_size=None):
    z = logits.double() / temperature
    if vocab_size is not None:
        z = z[..., :vocab_size]
    lp = torch.log_softmax(z, -1).gather(-1, targets[..., None])[..., 0]
    return lp, entropy_from_logits(z)


@pytest.mark.parametrize("temperature,vocab_size,chunk", [(1.0, None, 3), (0.7, None, 4), (1.3, 45, 5), (1.0, 50, 100)])
def test_values_and_gradients_equal_the_full_tensor_formulas(temperature, vocab_size, chunk):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(2, 7, 50, generator=g)).requires_grad_()
    targets = torch.randint(0, vocab_size or 50, (2, 7), generator=g)
    w_lp, w_ent = torch.randn(2, 7, generator=g), torch.randn(2, 7, generator=g)

    ref = logits.detach().double().requires_grad_()
    ref_lp, ref_ent = reference(ref, targets, temperature, vocab_size)
    ((ref_lp * w_lp).sum() + (ref_ent * w_ent).sum()).backward()

    mine = logits.detach().clone().requires_grad_()
    lp, ent = token_log_probs_from_logits(mine * 1.0, targets, temperature=temperature, with_entropy=True,
                                          vocab_size=vocab_size, chunk_tokens=chunk)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=0)
    torch.testing.assert_close(mine.grad.double(), ref.grad, atol=1e-5, rtol=0)


def test_only_the_log_probs_carry_a_gradient_when_the_entropy_is_a_metric():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(9, 30, generator=g)
    targets = torch.randint(0, 30, (9,), generator=g)
    ref = logits.double().requires_grad_()
    torch.log_softmax(ref, -1).gather(-1, targets[:, None]).sum().backward()
    mine = logits.clone().requires_grad_()
    lp, ent = token_log_probs_from_logits(mine * 1.0, targets, with_entropy=False, chunk_tokens=2)
    assert ent is None
    lp.sum().backward()
    torch.testing.assert_close(mine.grad.double(), ref.grad, atol=1e-6, rtol=0)


def test_no_full_size_temporary_beyond_the_logits():
    # an LM head's 4,000 tokens x 1,000 entries (16 MB in float32), chunks of 100 tokens: the
    # log-probs, the entropy and the backward into the head's input and weight allocate no
    # tensor a tenth the logits' size (the gradient goes into the logits' own memory)
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(4000, 64, generator=g).requires_grad_()
    weight = torch.randn(64, 1000, generator=g).requires_grad_()
    targets = torch.randint(0, 1000, (4000,), generator=g)
    logits = hidden @ weight
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        lp, ent = token_log_probs_from_logits(logits, targets, with_entropy=True, chunk_tokens=100)
        (lp.sum() + ent.sum()).backward()
    largest = max(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0)
    assert largest < 4000 * 1000 * 4 // 10, largest
    ref_hidden, ref_weight = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ref_lp, ref_ent = reference(ref_hidden @ ref_weight, targets, 1.0)
    (ref_lp.sum() + ref_ent.sum()).backward()
    torch.testing.assert_close(hidden.grad.double(), ref_hidden.grad, atol=1e-4, rtol=1e-6)
    torch.testing.assert_close(weight.grad.double(), ref_weight.grad, atol=1e-4, rtol=1e-6)


def _slice_rank(rank, store_path, logits, targets, w_lp, w_ent, results):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        mine = logits[..., rank * 25:(rank + 1) * 25].clone().requires_grad_()
        lp, ent = token_log_probs_from_logits(mine * 1.0, targets, temperature=0.8, with_entropy=True, vocab_size=45,
                                              group=dist.group.WORLD, chunk_tokens=4)
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
        results.put((rank, lp.detach().numpy(), ent.detach().numpy(), mine.grad.numpy()))  # by value
    finally:
        dist.destroy_process_group()


def test_vocabulary_slices_over_two_ranks_equal_the_whole_vocabulary(tmp_path):
    # ranks 0 and 1 (processes over gloo) hold entries 0-24 and 25-49 of a vocabulary of 45
    # (5 entries of padding on rank 1)
    import multiprocessing

    g = torch.Generator().manual_seed(3)
    logits = 2 * torch.randn(3, 5, 50, generator=g)
    targets = torch.randint(0, 45, (3, 5), generator=g)
    w_lp, w_ent = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    ref = logits.double().requires_grad_()
    ref_lp, ref_ent = reference(ref, targets, 0.8, vocab_size=45)
    ((ref_lp * w_lp).sum() + (ref_ent * w_ent).sum()).backward()

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    ranks = [context.Process(target=_slice_rank, args=(r, str(tmp_path / "store"), logits, targets, w_lp, w_ent,
                                                       results)) for r in range(2)]
    for p in ranks:
        p.start()
    out = {}
    for _ in ranks:
        rank, *values = results.get(timeout=120)
        out[rank] = [torch.from_numpy(v) for v in values]
    for p in ranks:
        p.join(timeout=30)
    for rank in range(2):
        lp, ent, grad = out[rank]
        torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=0)
        torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=0)
        torch.testing.assert_close(grad.double(), ref.grad[..., rank * 25:(rank + 1) * 25], atol=1e-5, rtol=0)
