"""Statistics from hidden states + LM-head weight (no (N, V) logits) against row_stats of
the materialised logits: values, gradients in hidden and weight, and memory."""

import pytest
import torch
from _ops_cases import AllocRecorder, KEYS, assert_agree, hidden_row_stats, make_ids, row_stats



def _hw(N, H, V, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g, dtype=torch.float64)
    W = torch.randn(V, H, generator=g, dtype=torch.float64) / H**0.5 * 3
    return h.to(dtype), W.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("chunk_rows", [None, 1, 7, 64])
def test_matches_row_stats_of_materialised_logits(dtype, chunk_rows):
    N, H, V, K, T = 9, 16, 61, 5, 0.8
    h, W = _hw(N, H, V, dtype)
    k, tk = make_ids(N, V, K)
    got = hidden_row_stats(h, W, k, tk, temperature=T, chunk_rows=chunk_rows)
    want = row_stats(h @ W.T, k, tk, temperature=T, impl="torch")  # same logits (model dtype), then reduced
    assert set(got) == set(KEYS)
    assert_agree(got, want, dtype, zmax=20.0)


def test_gradcheck_hidden_and_weight_float64():
    h, W = _hw(5, 6, 13, torch.float64)
    h.requires_grad_()
    W.requires_grad_()
    k, tk = make_ids(5, 13, 3)
    assert torch.autograd.gradcheck(
        lambda a, b: hidden_row_stats(a, b, k, tk, temperature=0.7, chunk_rows=4)["logp"], (h, W))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gradients_match_autograd_through_logits(dtype):
    N, H, V = 12, 32, 100
    h0, W0 = _hw(N, H, V, dtype, seed=3)
    k, _ = make_ids(N, V, None)
    g = torch.randn(N)
    h1, W1 = h0.clone().requires_grad_(), W0.clone().requires_grad_()
    (hidden_row_stats(h1, W1, k, chunk_rows=16)["logp"] * g).sum().backward()
    h2, W2 = h0.double().requires_grad_(), W0.double().requires_grad_()
    (torch.log_softmax(h2 @ W2.T, -1).gather(1, k[:, None])[:, 0] * g.double()).sum().backward()
    assert h1.grad.dtype == dtype and W1.grad.dtype == dtype
    t = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.05}
    torch.testing.assert_close(h1.grad.double(), h2.grad, **t)
    torch.testing.assert_close(W1.grad.double(), W2.grad, **t)


def test_only_requested_gradients_and_no_full_logits():
    N, H, V, rows = 32, 8, 1000, 4
    h, W = _hw(N, H, V, torch.float32)
    h.requires_grad_()
    k, tk = make_ids(N, V, 4)
    rec = AllocRecorder()
    with rec:
        hidden_row_stats(h, W, k, tk, chunk_rows=rows)["logp"].sum().backward()
    assert W.grad is None and h.grad is not None
    assert max(n for _, n in rec.sizes) <= max(rows * V, V * H) < N * V, rec.sizes  # chunks of rows, never N * V


def test_bad_inputs_name_the_argument():
    h, W = _hw(3, 4, 10, torch.float32)
    k = torch.zeros(3, dtype=torch.long)
    for kw, msg in [
        (dict(hidden=h, weight=W[:, :3], sampled_ids=k), "weight: expected a floating-point"),
        (dict(hidden=h, weight=W.double(), sampled_ids=k), "weight: must have the dtype"),
        (dict(hidden=h[0], weight=W, sampled_ids=k), "hidden"),
        (dict(hidden=h, weight=W, sampled_ids=k + 10), "sampled_ids: ids must lie"),
        (dict(hidden=h, weight=W, sampled_ids=k, chunk_rows=0), "chunk_rows"),
        (dict(hidden=h, weight=W, sampled_ids=k, temperature=-1.0), "temperature"),
    ]:
        with pytest.raises(ValueError, match=msg):
            hidden_row_stats(**kw)
