"""Truncated sampling in pdmask.ops: the kept set (vLLM's rules and order), the statistics of
pi renormalised over it on the torch path, the reference and the hidden-state path, their
gradients, and memory (no (N, V) float copy)."""

import math

import pytest
import torch
import _ops_cases
from _ops_cases import AllocRecorder, make_ids, make_logits

from pdmask import ops
from tests.ops import reference as _reference

F64 = torch.float64


def _truncation(kw: dict) -> dict:
    """The flat ``sampling_*`` keywords of a rule as the ops' ``truncation=`` argument."""
    kw = dict(kw)
    rules = {k[9:]: kw.pop(k) for k in list(kw) if k.startswith("sampling_")}
    if rules:
        kw["truncation"] = ops.Sampling(**rules)
    return kw


def row_stats(*args, **kw):
    return _ops_cases.row_stats(*args, **_truncation(kw))


def hidden_row_stats(*args, **kw):
    return _ops_cases.hidden_row_stats(*args, **_truncation(kw))


RULES = [dict(sampling_top_k=5), dict(sampling_top_p=0.8), dict(sampling_min_p=0.1),
         dict(sampling_top_k=12, sampling_top_p=0.7, sampling_min_p=0.02), dict(sampling_top_p=0.95)]
TRUNC = ("lse", "logp", "sum_p2", "entropy", "topk_logp", "lse_tail", "sum_p2_tail", "kept_mass", "kept_size")


def vllm_literal(y, top_k=None, top_p=None, min_p=None):
    """vLLM's pytorch sampler steps on temperature-scaled logits, written out on the
    descending sort (an independent transcription): min-p on the softmax, top-k, then
    top-p keeping the largest tokens while the mass *before* them is < p."""
    x = y.clone()
    if min_p is not None:
        p = torch.softmax(x, -1)
        x[p < p.max(-1, keepdim=True).values * min_p] = -math.inf
    out = torch.zeros_like(x, dtype=torch.bool)
    for r in range(x.shape[0]):
        vals, idx = x[r].sort(descending=True)
        n = x.shape[1] if top_k is None else min(top_k, x.shape[1])
        kth = vals[n - 1]
        keep = vals >= kth
        vals = torch.where(keep, vals, torch.full_like(vals, -math.inf))
        if top_p is not None:
            p = torch.softmax(vals, -1)
            before = torch.cumsum(p, 0) - p
            keep = keep & (before < top_p)
            keep[0] = True
        out[r, idx[keep & torch.isfinite(vals)]] = True
    return out


@pytest.mark.parametrize("rule", RULES, ids=lambda r: ",".join(f"{k[9:]}={v}" for k, v in r.items()))
@pytest.mark.parametrize("T", [1.0, 0.7])
def test_kept_set_matches_vllm(rule, T):
    y = make_logits(40, 300, F64, seed=3) / T
    kw = {k[9:]: v for k, v in rule.items()}
    want = vllm_literal(y, **kw)
    assert torch.equal(_reference.vllm_kept_mask(y, **kw), want)
    assert torch.equal(ops.sampling_kept_mask(y, **kw), want)
    assert 1 <= int(want.sum(-1).min()) and int(want.sum(-1).max()) < 300  # it truncates, never empties


def test_kept_set_by_hand():
    # p = [.5, .25, .15, .1]: top_p .7 keeps .5 and .25 (mass before .15 is .75 >= .7);
    # top_p .8 also keeps .15 (mass before it .75 < .8); min_p .25 keeps p >= .125: three
    # tokens; top_k 1 keeps the argmax only.
    y = torch.tensor([[.5, .25, .15, .1]], dtype=F64).log()
    assert ops.sampling_kept_mask(y, top_p=0.7).tolist() == [[True, True, False, False]]
    assert ops.sampling_kept_mask(y, top_p=0.8).tolist() == [[True, True, True, False]]
    assert ops.sampling_kept_mask(y, min_p=0.25).tolist() == [[True, True, True, False]]
    assert ops.sampling_kept_mask(y, top_k=1).tolist() == [[True, False, False, False]]
    # the order is vLLM's: min-p .25 first (drops .1), then top-p .85 over [.5, .25, .15]/.9:
    # masses before each are 0, .556, .833 -> all three kept (.833 < .85)
    assert ops.sampling_kept_mask(y, min_p=0.25, top_p=0.85).tolist() == [[True, True, True, False]]
    assert ops.sampling_kept_mask(y).all()  # every rule off


def test_renormalised_statistics_by_hand():
    # top_p .7 keeps {0, 1}: pi' = [2/3, 1/3]; k = 1: log pi'_k = log(1/3);
    # sum pi'^2 = 4/9 + 1/9 = 5/9; entropy = -(2/3 log 2/3 + 1/3 log 1/3) = 0.636514;
    # kept_mass pi(S) = .75; top-K ids [0, 3]: log(2/3) and -inf (outside S)
    z = torch.tensor([[.5, .25, .15, .1]], dtype=F64).log()
    for impl in ("torch", "reference"):
        out = row_stats(z, torch.tensor([1]), torch.tensor([[0, 3]]), sampling_top_p=0.7, impl=impl)
        torch.testing.assert_close(out["logp"], torch.tensor([math.log(1 / 3)], dtype=F64))
        torch.testing.assert_close(out["sum_p2"], torch.tensor([5 / 9], dtype=F64))
        torch.testing.assert_close(out["entropy"], torch.tensor([-(2 / 3 * math.log(2 / 3) + 1 / 3 * math.log(1 / 3))],
                                                                dtype=F64))
        torch.testing.assert_close(out["kept_mass"], torch.tensor([.75], dtype=F64))
        assert out["kept_size"].tolist() == [2.0] and out["sampled_outside"].tolist() == [False]
        assert out["topk_logp"][0, 1] == -math.inf
        torch.testing.assert_close(out["topk_logp"][0, 0], torch.tensor(math.log(2 / 3), dtype=F64))


def test_sampled_token_outside_the_rule_joins_the_set():
    # k = 3 (p .1) is outside top_p .7's {0, 1}: S = {0, 1, 3}, pi' = [.5, .25, .1] / .85
    z = torch.tensor([[.5, .25, .15, .1]], dtype=F64).log()
    out = row_stats(z, torch.tensor([3]), sampling_top_p=0.7, impl="torch")
    assert out["sampled_outside"].tolist() == [True] and out["kept_size"].tolist() == [3.0]
    torch.testing.assert_close(out["logp"], torch.tensor([math.log(.1 / .85)], dtype=F64))


@pytest.mark.parametrize("rule", RULES[:4], ids=str)
@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("chunk_rows", [None, 1, 7])
def test_torch_path_matches_reference(rule, dtype, chunk_rows):
    N, V, K = 23, 97, 6
    z = make_logits(N, V, dtype, seed=5)
    k, tk = make_ids(N, V, K)
    a = row_stats(z, k, tk, temperature=0.8, impl="torch", chunk_rows=chunk_rows, **rule)
    b = row_stats(z, k, tk, temperature=0.8, impl="reference", **rule)
    assert set(a) == set(b) == set(TRUNC) | {"sampled_outside"}
    assert torch.equal(a["sampled_outside"], b["sampled_outside"]) and torch.equal(a["kept_size"], b["kept_size"])
    t = {"atol": 1e-12, "rtol": 1e-12} if dtype == F64 else {"atol": 2e-5, "rtol": 2e-5}
    for key in TRUNC:
        torch.testing.assert_close(a[key].double(), b[key].double(), **t, equal_nan=False, msg=key)


def test_engine_kept_mask_input():
    N, V = 11, 50
    z = make_logits(N, V, F64, seed=2)
    k, tk = make_ids(N, V, 4)
    mask = torch.rand(N, V, generator=torch.Generator().manual_seed(0)) < 0.3
    a = row_stats(z, k, tk, kept_mask=mask, impl="torch", chunk_rows=4)
    b = row_stats(z, k, tk, kept_mask=mask, impl="reference")
    for key in TRUNC:
        torch.testing.assert_close(a[key], b[key], msg=key)
    # the same numbers as a log-softmax over the mask plus the sampled token
    m = mask.clone()
    m[torch.arange(N), k] = True
    logq = torch.log_softmax(z.masked_fill(~m, -math.inf), -1)
    torch.testing.assert_close(a["logp"], logq.gather(1, k[:, None])[:, 0])
    assert torch.equal(a["sampled_outside"], ~mask[torch.arange(N), k])


def test_neg_inf_logits_and_padding_rows():
    z = make_logits(9, 40, torch.float32, kind="neginf")
    z[3] = -math.inf  # an all -inf (padding) row
    k, tk = make_ids(9, 40, 3)
    z.requires_grad_()
    out = row_stats(z, k, tk, sampling_top_p=0.9, impl="torch")
    rows = torch.arange(9) != 3
    for key in ("sum_p2", "entropy", "kept_mass"):
        assert torch.isfinite(out[key][rows]).all(), key
    g = torch.randn(9).masked_fill(~rows, 0.0)
    (out["logp"][rows] * g[rows]).sum().backward()
    assert torch.isfinite(z.grad).all() and (z.grad[3] == 0).all()


@pytest.mark.parametrize("rule", RULES[:4], ids=str)
def test_gradcheck_float64(rule):
    z = make_logits(6, 19, F64, seed=4, scale=1.5).requires_grad_()
    k, _ = make_ids(6, 19, None)
    assert torch.autograd.gradcheck(
        lambda x: row_stats(x, k, temperature=0.9, impl="torch", chunk_rows=4, **rule)["logp"], (z,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gradient_is_e_k_minus_renormalised_pi(dtype):
    N, V, T = 13, 70, 0.7
    z = make_logits(N, V, dtype, seed=8).requires_grad_()
    k, _ = make_ids(N, V, None)
    g = torch.randn(N, generator=torch.Generator().manual_seed(1))
    (row_stats(z, k, temperature=T, sampling_top_p=0.85, sampling_top_k=20, impl="torch")["logp"] * g).sum() \
        .backward()
    assert z.grad.dtype == dtype
    y = z.detach().double() / T
    S = _reference.vllm_kept_mask(y, top_k=20, top_p=0.85)
    S[torch.arange(N), k] = True
    p = torch.softmax(y.masked_fill(~S, -math.inf), -1)
    want = g.double()[:, None] * (torch.nn.functional.one_hot(k, V).double() - p) / T
    t = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(z.grad.double(), want, **t)


def test_hidden_path_matches_logits_path():
    N, H, V, K = 21, 12, 57, 5
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, H, generator=g, dtype=F64)
    W = torch.randn(V, H, generator=g, dtype=F64) / 2
    k, tk = make_ids(N, V, K)
    for rule in RULES[:4]:
        a = hidden_row_stats(h, W, k, tk, temperature=0.8, chunk_rows=5, **rule)
        b = row_stats(h @ W.T, k, tk, temperature=0.8, impl="reference", **rule)
        assert torch.equal(a["sampled_outside"], b["sampled_outside"])
        for key in TRUNC:
            torch.testing.assert_close(a[key], b[key], msg=key)
    hh, WW = h[:5, :4].clone().requires_grad_(), W[:13, :4].clone().requires_grad_()
    k5 = k[:5] % 13
    assert torch.autograd.gradcheck(
        lambda x, w: hidden_row_stats(x, w, k5, temperature=0.8, chunk_rows=2, sampling_top_p=0.75)["logp"],
        (hh, WW))


def test_memory_never_a_float_copy_of_the_whole_logits():
    N, V, rows = 64, 2000, 4
    z = make_logits(N, V, torch.bfloat16).requires_grad_()
    k, tk = make_ids(N, V, 8)
    rec = AllocRecorder()
    with rec:
        out = row_stats(z, k, tk, sampling_top_p=0.9, sampling_top_k=100, impl="torch", chunk_rows=rows)
        out["logp"].sum().backward()
    big = [(n, s) for n, s in rec.sizes if s > rows * V]
    assert [s for _, s in big] == [N * V], big  # the gradient itself, in bf16
    assert z.grad.dtype == torch.bfloat16


def test_bad_arguments():
    z = make_logits(3, 10, F64)
    k = torch.zeros(3, dtype=torch.long)
    for kw, msg in [
        (dict(sampling_top_k=2.5), r"^top_k: expected an int"),
        (dict(sampling_top_p=0.0), r"^top_p: expected a number in \(0, 1\]"),
        (dict(sampling_top_p=1.5), r"^top_p: "),
        (dict(sampling_min_p=-0.1), r"^min_p: expected a number in \[0, 1\]"),
        (dict(kept_mask=torch.ones(3, 10)), r"^kept_mask: expected a bool tensor"),
        (dict(kept_mask=torch.ones(3, 9, dtype=torch.bool)), r"^kept_mask: expected shape \(3, 10\)"),
        (dict(kept_mask=torch.ones(3, 10, dtype=torch.bool), sampling_top_k=3), r"^kept_mask: give either"),
        (dict(sampling_top_k=3, impl="triton"), r"^impl: 'triton' has no kernel for truncated sampling"),
        (dict(sampling_top_k=3, rollout_logits=z), r"^rollout_logits: "),
    ]:
        with pytest.raises(ValueError, match=msg):
            row_stats(z, k, **kw)


@pytest.mark.usefixtures("one_thread")  # bitwise: off values take the untruncated path, the same ops, on one thread
def test_off_values_mean_no_truncation():
    z = make_logits(5, 30, F64)
    k, tk = make_ids(5, 30, 3)
    a = row_stats(z, k, tk, impl="torch")
    b = row_stats(z, k, tk, impl="torch", sampling_top_k=0, sampling_top_p=1.0, sampling_min_p=0.0)
    assert set(a) == set(b)
    for key in a:
        assert torch.equal(a[key], b[key])
    assert not ops.Sampling(top_k=-1, top_p=1, min_p=0).truncated and ops.Sampling(top_k=0) == ops.Sampling()
