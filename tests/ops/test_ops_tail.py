"""The tail of the top-K support, ``log pi_T = lse_tail - lse`` and ``sum_{tail} pi^2``, on every
CPU path (torch, reference, hidden states, truncated sampling; the Triton kernel in
test_ops_triton.py) against a float64 oracle of the same input values, for tails from 1e-3
down to float32's smallest normal (issue 31: ``1 - sum pi`` rounded them to 0)."""

import math

import pytest
import torch
from _ops_cases import PI_TAILS, assert_tail_agrees, hidden_row_stats, naive_tail, row_stats, tail_case

from pdmask import ops

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def test_cases_span_the_tails_they_claim():
    x, k, tk = tail_case()
    got, _ = naive_tail(x, k, tk)
    torch.testing.assert_close(got, torch.tensor(PI_TAILS, dtype=torch.float64).log(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", ["torch", "reference"])
@pytest.mark.parametrize("T", [1.0, 0.8])
def test_logits_paths(dtype, impl, T):
    if dtype == torch.float16:  # the lifted logits reach ~90: float16 holds them (spacing 1/16)
        assert tail_case(dtype=torch.float64)[0].abs().max() < 200
    x, k, tk = tail_case(dtype=dtype, seed=1)
    got = row_stats(x, k, tk, temperature=T, impl=impl, chunk_rows=3)
    assert_tail_agrees(got, x, k, tk, dtype, T)


@pytest.mark.parametrize("dtype", DTYPES[:3], ids=str)
@pytest.mark.parametrize("chunk_rows", [None, 37])
def test_hidden_path(dtype, chunk_rows):
    """logits = h @ I: the identity weight makes the hidden path's logits exactly x."""
    x, k, tk = tail_case(dtype=dtype, seed=2, V=120)
    W = torch.eye(120, dtype=dtype)
    got = hidden_row_stats(x, W, k, tk, chunk_rows=chunk_rows, temperature=0.9)
    assert_tail_agrees(got, x, k, tk, dtype, 0.9)


@pytest.mark.parametrize("dtype", DTYPES[:3], ids=str)
@pytest.mark.parametrize("impl", ["torch", "reference", "hidden"])
def test_truncated_sampling(dtype, impl):
    """pi renormalised over a kept set: the tail is the kept ids outside S'."""
    x, k, tk = tail_case(dtype=dtype, seed=3)
    g = torch.Generator().manual_seed(4)
    keep = torch.rand(x.shape, generator=g) > 0.2  # the engine dropped a fifth of the vocabulary
    if impl == "hidden":
        got = hidden_row_stats(x, torch.eye(x.shape[1], dtype=dtype), k, tk, kept_mask=keep, chunk_rows=4)
    else:
        got = row_stats(x, k, tk, impl=impl, kept_mask=keep, chunk_rows=4)
    keep = keep.clone().scatter_(1, k[:, None], True)  # the sampled token always joins the set
    assert_tail_agrees(got, x, k, tk, dtype, keep=keep)


def test_rule_truncation_and_empty_tails():
    """top-k truncation that keeps only S' (an empty tail: -inf, 0) next to one that keeps more."""
    x, k, tk = tail_case(dtype=torch.float32, seed=5)
    got = row_stats(x, k, tk, impl="torch", truncation=ops.Sampling(top_k=200))
    keep = ops.sampling_kept_mask(x.float(), top_k=200).scatter_(1, k[:, None], True)
    assert_tail_agrees(got, x, k, tk, torch.float32, keep=keep)
    V = x.shape[1]
    full = torch.arange(V).expand(2, V)  # K = V: S' is everything
    for impl in ("torch", "reference"):
        out = row_stats(x[:2], k[:2], full, impl=impl)
        assert torch.isneginf(out["lse_tail"]).all() and (out["sum_p2_tail"] == 0).all()


def test_nan_rows_stay_nan_and_all_neg_inf_rows_are_empty():
    x, k, tk = tail_case(dtype=torch.float32, seed=6)
    x[1] = math.nan
    x[2] = -math.inf
    for impl in ("torch", "reference"):
        out = row_stats(x, k, tk, impl=impl)
        assert torch.isnan(out["lse_tail"][1]) and torch.isneginf(out["lse_tail"][2])
        assert out["sum_p2_tail"][2] == 0
        rows = torch.tensor([0] + list(range(3, x.shape[0])))
        assert_tail_agrees({key: v[rows] for key, v in out.items()}, x[rows], k[rows], tk[rows], torch.float32)


@pytest.fixture
def flush_to_zero():
    """Subnormals flushed to 0, as GPUs do (Triton's exp2 flushes): the tail terms of a
    pi_T near float32's smallest normal are subnormal relative to the row max."""
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush subnormals")
    yield
    torch.set_flush_denormal(False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("path", ["torch", "hidden", "truncated"])
def test_tails_survive_flushed_subnormals(flush_to_zero, dtype, path):
    """The rows whose tail sum could have lost terms are summed again with the tail's own
    max (without that second sum these rows give log pi_T = -inf here)."""
    assert torch.tensor([1e-40]).item() == 0.0  # the flush is on
    x, k, tk = tail_case(dtype=dtype, seed=7)
    keep = None
    if path == "torch":
        got = row_stats(x, k, tk, impl="torch")
    elif path == "hidden":
        got = hidden_row_stats(x, torch.eye(x.shape[1], dtype=dtype), k, tk)
    else:
        keep = torch.ones(x.shape, dtype=torch.bool)
        keep[:, :5] = False
        got = row_stats(x, k, tk, impl="torch", kept_mask=keep)
        keep[torch.arange(len(k)), k] = True
    torch.set_flush_denormal(False)  # the float64 oracle never meets subnormals; restore before it runs
    assert_tail_agrees(got, x, k, tk, dtype, keep=keep)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("path", ["torch", "reference", "hidden", "truncated"])
def test_the_tail_changes_no_other_statistic(dtype, path):
    """The tail is summed beside the other statistics, never into them: with and without the
    top-K, lse, logp, sum_p2 and entropy are the same bits (earlier figures reproduce)."""
    x, k, tk = tail_case(dtype=dtype, seed=8)
    if path == "hidden":
        W = torch.eye(x.shape[1], dtype=dtype)
        a, b = (hidden_row_stats(x, W, k, t, chunk_rows=53) for t in (tk, None))
    elif path == "truncated":
        a, b = (row_stats(x, k, t, truncation=ops.Sampling(top_p=0.99), chunk_rows=3) for t in (tk, None))
    else:
        a, b = (row_stats(x, k, t, impl=path, chunk_rows=3) for t in (tk, None))
    for key in ("lse", "logp", "sum_p2", "entropy"):
        assert torch.equal(a[key], b[key]), key
