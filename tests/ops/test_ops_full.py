"""The full-vocabulary keys (``rollout_logits`` given) through ``pdmask.ops.row_stats``:
the torch path computes them in its own pass over the logits and agrees with the
reference, values and gradient of ``log pi_k``."""

import pytest
import torch
from _ops_cases import make_ids, make_logits, row_stats, tol, zmax_of

from tests.ops import reference as _reference
from tests.ops.reference import FULL_KEYS, reduce_rows


def _pair(N, V, dtype, kind="random", seed=0):
    x = make_logits(N, V, dtype, kind=kind, seed=seed)
    g = torch.Generator().manual_seed(seed + 7)
    xr = (x.double().nan_to_num(neginf=-1e4) + 0.8 * torch.randn(N, V, generator=g, dtype=torch.float64)).to(dtype)
    if kind == "neginf":
        xr[x.isneginf() & (torch.rand(N, V, generator=g) < 0.5)] = float("-inf")  # some shared -inf
    return x, xr


def _agree(got, ref, dtype, zmax):
    t = tol(dtype, zmax)
    for key in FULL_KEYS:
        assert got[key].dtype == ref[key].dtype, key
        torch.testing.assert_close(got[key], ref[key], **t, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("kind", ["random", "peaked", "neginf"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_torch_full_keys_match_reference(dtype, kind, temperature):
    N, V, K = 11, 173, 5
    x, xr = _pair(N, V, dtype, kind)
    k, tk = make_ids(N, V, K)
    if kind == "neginf":
        k = torch.where(x.gather(1, k[:, None])[:, 0].isneginf(), torch.zeros_like(k), k)
    got = row_stats(x, k, tk, temperature=temperature, chunk_rows=4, impl="torch", rollout_logits=xr)
    ref = reduce_rows(x, k, tk, temperature=temperature, rollout_logits=xr, chunk_rows=3)
    assert set(FULL_KEYS) <= set(got)
    _agree(got, ref, dtype, zmax_of(x, temperature))
    assert all(torch.isfinite(got[key]).all() for key in FULL_KEYS)


def test_torch_path_reads_the_logits_once(monkeypatch):
    """No second (reference) pass: the reference functions are made to fail."""
    x, xr = _pair(9, 64, torch.float32)
    k, tk = make_ids(9, 64, 4)
    ref = reduce_rows(x, k, tk, rollout_logits=xr)

    def boom(*a, **kw):
        raise AssertionError("a second pass over the logits")

    monkeypatch.setattr(_reference, "reduce_rows", boom)
    monkeypatch.setattr(_reference, "full_rows", boom)
    got = row_stats(x, k, tk, impl="torch", rollout_logits=xr)
    _agree(got, ref, torch.float32, zmax_of(x, 1.0))
    xg = x.clone().requires_grad_()
    got_g = row_stats(xg, k, tk, impl="torch", rollout_logits=xr)
    _agree(got_g, ref, torch.float32, zmax_of(x, 1.0))
    assert not any(got_g[key].requires_grad for key in FULL_KEYS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.usefixtures("one_thread")  # bitwise: rollout_logits add no op to the gradient's path, on one thread
def test_gradient_unchanged_by_rollout_logits(dtype):
    x, xr = _pair(7, 50, dtype, seed=3)
    k, tk = make_ids(7, 50, 3)
    g = torch.randn(7, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    grads = []
    for rl in (None, xr):
        xg = x.clone().requires_grad_()
        out = row_stats(xg, k, tk, impl="torch", chunk_rows=3, rollout_logits=rl)
        (out["logp"] * g.to(out["logp"].dtype)).sum().backward()
        grads.append(xg.grad)
    assert torch.equal(grads[0], grads[1])


def test_rollout_logits_shape_is_checked():
    x, xr = _pair(4, 20, torch.float32)
    k, _ = make_ids(4, 20, None)
    with pytest.raises(ValueError, match="^rollout_logits:"):
        row_stats(x, k, rollout_logits=xr[:, :10], impl="torch")
