"""The reference path never allocates a float32 copy of the whole (N, V) logits."""

import torch
from torch.profiler import ProfilerActivity, profile

import pdmask
from tests import flat  # noqa: E402


def test_peak_allocation_is_bounded_by_the_chunk_and_the_gradient():
    N, V, K, chunk = 64, 4096, 8, 8
    logits = torch.randn(1, N, V, dtype=torch.bfloat16, requires_grad=True)
    mu = torch.log_softmax(torch.randn(1, N, V), -1)
    top = mu.topk(K, -1)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = flat.policy_loss(logits, top.indices[..., 0], top.values[..., 0], top.indices, top.values,
                                 torch.ones(1), torch.ones(1, N, dtype=torch.bool), chunk_size=chunk)
        out.loss.backward()
    sizes = sorted((e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0), reverse=True)
    grad_bytes = N * V * 2  # the bf16 gradient of the logits: unavoidable
    chunk_bytes = chunk * V * 4  # one float32 chunk
    assert sizes[0] <= grad_bytes < N * V * 4  # nothing the size of a float32 copy
    # everything except the gradient buffer is chunk-sized or smaller
    big = [s for s in sizes if s > chunk_bytes]
    assert len([s for s in big if s >= grad_bytes - V * 2]) == len(big), big
