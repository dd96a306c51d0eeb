"""The Triton kernels against the reference, run on CPU by Triton's interpreter
(``TRITON_INTERPRET=1``, set per test) at small sizes with small blocks, so that rows
span several blocks plus a ragged tail. The same checks run compiled on CUDA in
test_ops_gpu.py."""

import importlib.util

import pytest
import torch
from _ops_cases import KEYS, assert_agree, grad_tol, make_ids, make_logits, naive, zmax_of

import pdmask
from pdmask import ops
from pdmask.stats import reduce_rows

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                       reason="needs the optional 'triton' package (pip install 'pdmask[triton]')"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # numpy warnings from the interpreter (-inf math)
]

LOW = [torch.bfloat16, torch.float16, torch.float32]


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from pdmask.ops import _kernel

    monkeypatch.setattr(_kernel, "FWD_BLOCK_V", 32)
    monkeypatch.setattr(_kernel, "BWD_BLOCK_V", 16)
    return _kernel


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("kind", ["random", "peaked", "neginf", "flat"])
def test_forward_matches_reference(dtype, kind):
    N, V, K, T = 5, 77, 6, 0.7  # 77 = 2 full blocks of 32 + a ragged tail of 13
    x = make_logits(N, V, dtype, kind=kind, seed=11)
    k, tk = make_ids(N, V, K, seed=12)
    got = ops.row_stats(x, k, tk, temperature=T, impl="triton")
    assert set(got) == set(KEYS) and all(v.dtype == torch.float32 for v in got.values())
    zm = zmax_of(x, T)
    assert_agree(got, reduce_rows(x, k, tk, temperature=T), dtype, zmax=zm)
    assert_agree(got, naive(x, k, tk, T), dtype, zmax=zm)


@pytest.mark.parametrize("V,K,inside", [(1, 1, True), (3, 3, True), (40, 1, False), (40, 1, True), (33, 33, True)])
def test_k_edges(V, K, inside):
    x = make_logits(3, V, torch.float32, seed=V)
    k, tk = make_ids(3, V, K, sampled_in_topk=inside)
    got = ops.row_stats(x, k, tk, impl="triton")
    assert_agree(got, reduce_rows(x, k, tk), torch.float32)
    got = ops.row_stats(x, k, None, impl="triton")
    assert "topk_logp" not in got
    assert_agree(got, reduce_rows(x, k, None), torch.float32)


def test_neg_inf_sampled_topk_and_all_neg_inf_row():
    x = make_logits(4, 50, torch.float32, kind="neginf", seed=3)
    k, tk = make_ids(4, 50, 5, seed=4)
    x[0, k[0]] = float("-inf")
    x[1, tk[1, :2]] = float("-inf")
    x[3] = float("-inf")
    got = ops.row_stats(x, k, tk, impl="triton")
    ref = reduce_rows(x, k, tk)
    assert got["logp"][0] == float("-inf") and torch.isneginf(got["topk_logp"][1, :2]).all()
    assert got["lse"][3] == float("-inf")  # the core turns this into a ValueError on response rows
    rows = torch.tensor([0, 1, 2])
    assert_agree(got, ref, torch.float32, keys=("lse", "sum_p2", "entropy"), rows=rows)
    fin = torch.isfinite(ref["topk_logp"][rows])
    torch.testing.assert_close(got["topk_logp"][rows][fin], ref["topk_logp"][rows][fin], atol=1e-5, rtol=1e-5)


def test_non_contiguous_rows_and_empty():
    base = make_logits(6, 90, torch.bfloat16, seed=8)
    x = base[::2, :70]  # row stride 180 elements, rows shorter than the stride
    k, tk = make_ids(3, 70, 4)
    assert_agree(ops.row_stats(x, k, tk, impl="triton"), reduce_rows(x, k, tk), torch.bfloat16)
    e = ops.row_stats(torch.empty(0, 9), torch.empty(0, dtype=torch.long), torch.empty(0, 2, dtype=torch.long),
                      impl="triton")
    assert e["topk_logp"].shape == (0, 2)


def test_out_of_range_ids_give_nan_not_a_read(interpreter):
    x = make_logits(2, 20, torch.float32)
    out = interpreter.forward(x, torch.tensor([3, 25]), torch.tensor([[1, -1], [2, 3]]), temperature=1.0)
    assert torch.isnan(out["logp"][1]) and torch.isfinite(out["logp"][0])
    assert torch.isnan(out["topk_logp"][0, 1]) and torch.isfinite(out["topk_logp"][1]).all()


def test_float64_is_refused_by_name():
    with pytest.raises(ValueError, match="logits: impl='triton' supports"):
        ops.row_stats(torch.randn(2, 5, dtype=torch.float64), torch.zeros(2, dtype=torch.long), impl="triton")


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("kind", ["random", "peaked", "neginf"])
def test_gradient_matches_float64_oracle(dtype, kind):
    N, V, T = 4, 45, 0.8
    x = make_logits(N, V, dtype, kind=kind, seed=21)
    k, _ = make_ids(N, V, None, seed=22)
    g = torch.randn(N, dtype=torch.float64)
    xa = x.clone().requires_grad_()
    (ops.row_stats(xa, k, temperature=T, impl="triton")["logp"] * g.float()).sum().backward()
    assert xa.grad.dtype == dtype
    p = torch.softmax(x.double() / T, -1)
    want = (torch.nn.functional.one_hot(k, V).double() - p) * g[:, None] / T
    torch.testing.assert_close(xa.grad.double(), want, **grad_tol(dtype, zmax_of(x, T), g.abs().max().item() / T))


def test_gradient_zero_on_all_neg_inf_padding_row():
    x = torch.randn(3, 20)
    x[2] = float("-inf")
    xa = x.clone().requires_grad_()
    ops.row_stats(xa, torch.tensor([1, 2, 3]), impl="triton")["logp"][:2].sum().backward()
    assert torch.isfinite(xa.grad).all() and (xa.grad[2] == 0).all()


def test_policy_loss_through_the_kernel_matches_reference():
    g = torch.Generator().manual_seed(0)
    B, T, V, K = 2, 3, 40, 4
    z = torch.randn(B, T, V, generator=g) * 2
    logmu = torch.log_softmax(z + 0.5 * torch.randn(B, T, V, generator=g), -1)
    k = torch.multinomial(logmu.exp().reshape(-1, V), 1, generator=g).reshape(B, T)
    tk_lp, tk = logmu.topk(K, -1)
    args = (k, logmu.gather(-1, k[..., None])[..., 0], tk, tk_lp, torch.tensor([1.0, -0.5]),
            torch.ones(B, T, dtype=torch.bool))
    res = {}
    for impl in ("reference", "triton"):
        x = z.to(torch.bfloat16).requires_grad_()
        out = pdmask.policy_loss(x, *args, delta_low=0.01, delta_high=0.01, impl=impl)
        out.loss.backward()
        res[impl] = (out, x.grad)
    (ro, rg), (to, tg) = res["reference"], res["triton"]
    assert torch.equal(to.mask, ro.mask) and (~ro.mask).any()
    torch.testing.assert_close(to.loss, ro.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tg.float(), rg.float(), atol=1e-4, rtol=2e-2)
    for key in ro.stats:
        if ro.stats[key].dtype != torch.bool:
            torch.testing.assert_close(to.stats[key].float(), ro.stats[key].float(), atol=3e-5, rtol=3e-5)
