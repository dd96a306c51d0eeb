"""The Triton kernels against the reference at small sizes with small blocks (rows span
several blocks plus a ragged tail). Without CUDA they run on CPU in Triton's interpreter
(``TRITON_INTERPRET=1``); with CUDA the same tests run compiled on the GPU."""

import contextlib
import importlib.util
import os
import sys

import pytest
import torch
from _ops_cases import (KEYS, assert_agree, assert_tail_agrees, grad_tol, make_ids, make_logits, naive, oracle_rows,
                        row_stats, tail_case, zmax_of)

import pdmask
from tests.ops.reference import reduce_rows
from tests import flat  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
HAS_TRITON = importlib.util.find_spec("triton") is not None
if HAS_TRITON and not CUDA and "triton" not in sys.modules:
    # Triton reads TRITON_INTERPRET when it is first imported (its standard library is
    # decorated then), so import it in interpreter mode now and restore the environment;
    # the fixture below sets the variable again around each test.
    _old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    import triton.language  # noqa: F401

    if _old is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _old


def _interpreter_ready() -> bool:
    if CUDA or not HAS_TRITON:
        return True
    from pdmask.ops._kernel import language_interpreted

    return language_interpreted()


pytestmark = [
    pytest.mark.skipif(not HAS_TRITON, reason="needs the optional 'triton' package (pip install -e '.[triton]')"),
    pytest.mark.skipif(not _interpreter_ready(), reason=(
        "triton was imported earlier in this process without TRITON_INTERPRET=1, so its interpreter "
        "cannot run here; run `TRITON_INTERPRET=1 pytest tests/ops`")),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # numpy warnings from the interpreter (-inf math)
]

LOW = [torch.bfloat16, torch.float16, torch.float32]


def _dev(t):
    return None if t is None else t.to(DEV)


def run(x, k, tk=None, **kw):
    """row_stats with impl='triton' on DEV, results back on CPU."""
    out = row_stats(_dev(x), _dev(k), _dev(tk), impl="triton", **kw)
    return {key: v.cpu() for key, v in out.items()}


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    if not CUDA:
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
    got = run(x, k, tk, temperature=T)
    assert set(got) == set(KEYS) and all(v.dtype == torch.float32 for v in got.values())
    zm = zmax_of(x, T)
    assert_agree(got, reduce_rows(x, k, tk, temperature=T), dtype, zmax=zm)
    assert_agree(got, naive(x, k, tk, T), dtype, zmax=zm)


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_extreme_tails(dtype):
    """pi_T from 1e-3 down to float32's smallest normal: the kernel sums the tail of
    S' = topK ∪ {k} on its own (the support ids walked along 10 blocks of 32), and rows
    whose tail could have flushed walk the row again with the tail's own max."""
    x, k, tk = tail_case(dtype=dtype, seed=13)
    for T in (1.0, 0.8):
        assert_tail_agrees(run(x, k, tk, temperature=T), x, k, tk, dtype, T)


def test_the_tail_changes_no_other_statistic():
    x, k, tk = tail_case(dtype=torch.float32, seed=14)
    a, b = run(x, k, tk), run(x, k, None)
    for key in ("lse", "logp", "sum_p2", "entropy"):
        assert torch.equal(a[key], b[key]), key


def test_extreme_tails_through_token_stats():
    """The issue-31 reproduction through the kernel: float32 within 1e-4 of float64."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(1, 1, 1000, generator=g, dtype=torch.float64)
    z[0, 0, 7] = 26.0
    m = z.clone()
    m[0, 0, 7] = 13.0
    lmu = torch.log_softmax(m, -1)
    top = lmu.topk(20, -1)
    r = pdmask.Rollout(torch.tensor([[7]]), lmu[..., 7], top.indices, top.values)
    with oracle_rows():
        want = pdmask.token_stats(z, r)
    rd = pdmask.Rollout(*(_dev(t) for t in (r.sampled_ids, r.sampled_logprob, r.topk_ids, r.topk_logprobs)))
    got = pdmask.token_stats(_dev(z.float()), rd, compute=pdmask.Compute(impl="triton"))
    assert abs(got["topk_kl"].item() - want["topk_kl"].item()) < 1e-4
    assert got["policy_tail_mass"].item() == pytest.approx(want["policy_tail_mass"].item(), rel=1e-4)


@pytest.mark.parametrize("V,K,inside", [(1, 1, True), (3, 3, True), (40, 1, False), (40, 1, True), (33, 33, True)])
def test_k_edges(V, K, inside):
    x = make_logits(3, V, torch.float32, seed=V)
    k, tk = make_ids(3, V, K, sampled_in_topk=inside)
    got = run(x, k, tk)
    assert_agree(got, reduce_rows(x, k, tk), torch.float32)
    got = run(x, k, None)
    assert "topk_logp" not in got
    assert_agree(got, reduce_rows(x, k, None), torch.float32)


def test_neg_inf_sampled_topk_and_all_neg_inf_row():
    x = make_logits(4, 50, torch.float32, kind="neginf", seed=3)
    k, tk = make_ids(4, 50, 5, seed=4)
    x[0, k[0]] = float("-inf")
    x[1, tk[1, :2]] = float("-inf")
    x[3] = float("-inf")
    got = run(x, k, tk)
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
    assert_agree(run(x, k, tk), reduce_rows(x, k, tk), torch.bfloat16)
    e = run(torch.empty(0, 9), torch.empty(0, dtype=torch.long), torch.empty(0, 2, dtype=torch.long))
    assert e["topk_logp"].shape == (0, 2)


def test_out_of_range_ids_give_nan_not_a_read(interpreter):
    x = make_logits(2, 20, torch.float32)
    out = interpreter.forward(_dev(x), _dev(torch.tensor([3, 25])), _dev(torch.tensor([[1, -1], [2, 3]])),
                              temperature=1.0, rescue=pdmask.ops.tail_rescue_below(torch.float32, 20))
    out = {key: v.cpu() for key, v in out.items()}
    assert torch.isnan(out["logp"][1]) and torch.isfinite(out["logp"][0])
    assert torch.isnan(out["topk_logp"][0, 1]) and torch.isfinite(out["topk_logp"][1]).all()


def test_float64_is_refused_by_name():
    with pytest.raises(ValueError, match="logits: impl='triton' supports"):
        run(torch.randn(2, 5, dtype=torch.float64), torch.zeros(2, dtype=torch.long))


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("kind", ["random", "peaked", "neginf"])
def test_gradient_matches_float64_oracle(dtype, kind):
    N, V, T = 4, 45, 0.8
    x = make_logits(N, V, dtype, kind=kind, seed=21)
    k, _ = make_ids(N, V, None, seed=22)
    g = torch.randn(N, dtype=torch.float64)
    xa = x.to(DEV, copy=True).requires_grad_()
    (row_stats(xa, _dev(k), temperature=T, impl="triton")["logp"] * _dev(g.float())).sum().backward()
    assert xa.grad.dtype == dtype
    grad = xa.grad.cpu()
    p = torch.softmax(x.double() / T, -1)
    want = (torch.nn.functional.one_hot(k, V).double() - p) * g[:, None] / T
    torch.testing.assert_close(grad.double(), want, **grad_tol(dtype, zmax_of(x, T), g.abs().max().item() / T))


def test_gradient_zero_on_all_neg_inf_padding_row():
    x = torch.randn(3, 20)
    x[2] = float("-inf")
    xa = x.to(DEV, copy=True).requires_grad_()
    row_stats(xa, _dev(torch.tensor([1, 2, 3])), impl="triton")["logp"][:2].sum().backward()
    grad = xa.grad.cpu()
    assert torch.isfinite(grad).all() and (grad[2] == 0).all()


@pytest.mark.parametrize("junk", [float("nan"), float("inf"), "mixed"], ids=["nan", "inf", "mixed"])
def test_gradient_zero_on_nan_inf_padding_rows_of_the_loss(junk):
    """Padding rows may hold NaN/inf logits: the kernel's backward writes 0 on rows whose
    upstream gradient is 0 (as the torch path does), so the loss gradient stays finite."""
    g = torch.Generator().manual_seed(1)
    B, T, V, K = 2, 3, 40, 4
    z = torch.randn(B, T, V, generator=g)
    logmu = torch.log_softmax(torch.randn(B, T, V, generator=g), -1)
    tk_lp, tk = logmu.topk(K, -1)
    k = tk[..., 0]
    mask = torch.tensor([[True, True, False], [False, True, True]])
    zp = z.clone()
    if junk == "mixed":
        zp[~mask] = torch.tensor([float("nan"), float("inf"), float("-inf"), 1.0] * (V // 4))
    else:
        zp[~mask] = junk
    args = tuple(_dev(a) for a in (k, tk_lp[..., 0], tk, tk_lp, torch.tensor([1.0, -0.5]), mask))
    grads = []
    for x0 in (z, zp):
        x = x0.to(DEV, copy=True).requires_grad_()
        flat.policy_loss(x, *args, impl="triton").loss.backward()
        grads.append(x.grad.cpu())
    assert torch.isfinite(grads[1]).all() and (grads[1][~mask] == 0).all()
    torch.testing.assert_close(grads[1], grads[0])


def test_policy_loss_through_the_kernel_matches_reference():
    g = torch.Generator().manual_seed(0)
    B, T, V, K = 2, 3, 40, 4
    z = torch.randn(B, T, V, generator=g) * 2
    logmu = torch.log_softmax(z + 0.5 * torch.randn(B, T, V, generator=g), -1)
    k = torch.multinomial(logmu.exp().reshape(-1, V), 1, generator=g).reshape(B, T)
    tk_lp, tk = logmu.topk(K, -1)
    args = tuple(_dev(a) for a in (k, logmu.gather(-1, k[..., None])[..., 0], tk, tk_lp, torch.tensor([1.0, -0.5]),
                                   torch.ones(B, T, dtype=torch.bool)))
    res = {}
    for impl in ("reference", "triton"):
        x = z.to(DEV, torch.bfloat16, copy=True).requires_grad_()
        with oracle_rows() if impl == "reference" else contextlib.nullcontext():
            out = flat.policy_loss(x, *args, delta_low=0.01, delta_high=0.01, impl="triton")
        out.loss.backward()
        res[impl] = (out, x.grad)
    (ro, rg), (to, tg) = res["reference"], res["triton"]
    assert torch.equal(to.mask, ro.mask) and (~ro.mask).any()
    torch.testing.assert_close(to.loss, ro.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tg.float(), rg.float(), atol=1e-4, rtol=2e-2)
    for key in ro.stats:
        if ro.stats[key].dtype != torch.bool:
            torch.testing.assert_close(to.stats[key].float(), ro.stats[key].float(), atol=3e-5, rtol=3e-5)
