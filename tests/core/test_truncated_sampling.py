"""Truncated sampling against a simulated engine with known truncation.

The engine holds logits y, samples with top-p / top-k / min-p (vLLM's steps, transcribed in
``tests/ops/reference.py``'s ``vllm_kept_mask``) from ``mu' = softmax(y)`` renormalised over its
kept set S, and reports vLLM's processed log-probs: ``log mu'_k`` and the top-K of mu'
(-inf beyond |S|). Without the correction the trainer's full-vocabulary pi gives
``r = pi_k / mu'_k``, whose on-policy value is ``pi(S) < 1`` on every token (the known
bias); with it, ``pi' = pi / pi(S)`` on S gives ``r = 1``. Off-policy, importance sampling
is unbiased again: ``E_{k ~ mu'}[pi'_k / mu'_k] = sum_{k in S} pi'_k = 1``.
"""

import math

import pytest
import torch

import pdmask
from tests.ops.reference import vllm_kept_mask
from tests import flat  # noqa: E402

F64 = torch.float64
K = 5


def engine(y, *, top_k=None, top_p=None, min_p=None, seed=0):
    """Sample one token per row of engine logits y (N, V); return what vLLM reports."""
    S = vllm_kept_mask(y, top_k, top_p, min_p)
    logmu = torch.log_softmax(y.masked_fill(~S, -math.inf), -1)  # processed log-probs
    k = torch.multinomial(logmu.exp(), 1, generator=torch.Generator().manual_seed(seed)).squeeze(1)
    top = logmu.topk(K, dim=-1)
    return dict(sampled_ids=k, rollout_logprob=logmu.gather(1, k[:, None]).squeeze(1),
                rollout_topk_ids=top.indices, rollout_topk_logprobs=top.values), S, logmu


def logits(N=64, V=40, seed=0, scale=2.0):
    return torch.randn(N, V, generator=torch.Generator().manual_seed(seed), dtype=F64) * scale


SETTINGS = [dict(top_p=0.8), dict(top_k=8), dict(min_p=0.05), dict(top_k=10, top_p=0.9)]


@pytest.mark.parametrize("s", SETTINGS, ids=str)
def test_on_policy_ratio_is_biased_without_and_exactly_one_with_the_correction(s):
    z = logits()  # the trainer is the engine (on-policy)
    rep, S, _ = engine(z, **s)
    pi_S = torch.softmax(z, -1).masked_fill(~S, 0).sum(-1)  # the mass the engine kept, per row
    args = (z[None], rep["sampled_ids"][None], rep["rollout_logprob"][None], rep["rollout_topk_ids"][None],
            rep["rollout_topk_logprobs"][None])
    naive = flat.token_stats(*args)
    fixed = flat.token_stats(*args, **{f"sampling_{k}": v for k, v in s.items()})
    # before: r = pi_k / (pi_k / pi(S)) = pi(S) on every token, mean well below 1
    torch.testing.assert_close(naive["ratio"][0], pi_S)
    assert float(naive["ratio"].mean()) < 0.97
    # after: r = 1 on every token, and the top-K KL (0 on-policy) is 0
    torch.testing.assert_close(fixed["ratio"][0], torch.ones_like(pi_S), atol=1e-12, rtol=0)
    torch.testing.assert_close(fixed["topk_kl"][0], torch.zeros_like(pi_S), atol=1e-12, rtol=0)
    assert float(naive["topk_kl"].mean()) > 1e-3
    torch.testing.assert_close(fixed["kept_mass"][0], pi_S)  # the bias, reported
    assert not fixed["sampled_outside"].any() and float(fixed["kept_topk_mismatch"].max()) == 0.0


def test_policy_loss_metrics_report_the_bias_and_the_mismatch():
    z = logits(seed=1)
    rep, S, _ = engine(z, top_p=0.8)
    adv = torch.ones(1, 64, dtype=F64)
    naive = flat.policy_loss(z[None], *[v[None] for v in rep.values()], adv, None, mode="dppo-topk-kl")
    fixed = flat.policy_loss(z[None], *[v[None] for v in rep.values()], adv, None, mode="dppo-topk-kl",
                               sampling_top_p=0.8)
    assert float(naive.metrics["ratio_mean"]) < 0.97
    torch.testing.assert_close(fixed.metrics["ratio_mean"], torch.tensor(1.0, dtype=F64))
    torch.testing.assert_close(fixed.metrics["policy_kept_mass_mean"], naive.metrics["ratio_mean"])
    torch.testing.assert_close(fixed.metrics["kept_size_mean"], S.sum(-1).to(F64).mean())
    assert float(fixed.metrics["kept_set_sampled_outside_frac"]) == 0.0
    assert float(fixed.metrics["kept_set_topk_mismatch_frac"]) == 0.0
    # a trainer whose rule differs from the engine's (top_p .6 instead of .8) drops sampled tokens
    other = flat.policy_loss(z[None], *[v[None] for v in rep.values()], adv, None, mode="dppo-topk-kl",
                               sampling_top_p=0.6)
    assert float(other.metrics["kept_set_sampled_outside_frac"]) > 0.0
    assert float(other.metrics["kept_set_topk_mismatch_frac"]) > 0.0


def expected_ratio(z, rep_logmu, S, **trunc):
    """E_{k ~ mu'}[r_k] = sum_{k in S} mu'_k r_k, exactly: every k of every row through the
    library (one row per (n, k) pair)."""
    N, V = z.shape
    n = torch.arange(N).repeat_interleave(V)
    k = torch.arange(V).repeat(N)
    inside = S[n, k]
    n, k = n[inside], k[inside]
    st = flat.token_stats(z[n][None], k[None], rep_logmu[n, k][None], **{
        key: (v[n][None] if isinstance(v, torch.Tensor) else v) for key, v in trunc.items()})
    return torch.zeros(N, dtype=F64).index_add_(0, n, rep_logmu[n, k].exp() * st["ratio"][0])


@pytest.mark.parametrize("s", SETTINGS[:2], ids=str)
def test_off_policy_importance_sampling_is_unbiased_over_the_engines_kept_set(s):
    z = logits(N=16, V=30, seed=2)
    y = z + 0.7 * logits(N=16, V=30, seed=3, scale=1.0)  # the engine differs (off-policy)
    _, S, logmu = engine(y, **s)
    before = expected_ratio(z, logmu, S)
    after = expected_ratio(z, logmu, S, rollout_kept_mask=S)
    torch.testing.assert_close(after, torch.ones(16, dtype=F64))  # sum_{k in S} pi'_k = 1
    assert float(before.max()) < 0.999  # = pi(S) per row: biased low
    torch.testing.assert_close(before, torch.softmax(z, -1).masked_fill(~S, 0).sum(-1))


def test_monte_carlo_mean_ratio_before_and_after():
    # a sampler with known truncation: 4000 draws from top_p = 0.8 of a fixed engine;
    # the sample mean of r before the correction estimates E[pi(S)] < 1, after it estimates 1
    N, V = 4000, 50
    base = logits(N=1, V=V, seed=4)
    z = base.expand(N, V).contiguous()
    y = (base + 0.3 * logits(N=1, V=V, seed=5, scale=1.0)).expand(N, V).contiguous()
    rep, S, _ = engine(y, top_p=0.8, seed=6)
    args = (z[None], rep["sampled_ids"][None], rep["rollout_logprob"][None])
    r0 = flat.token_stats(*args)["ratio"][0]
    r1 = flat.token_stats(*args, rollout_kept_mask=S[None])["ratio"][0]
    se1 = float(r1.std()) / N ** 0.5
    assert abs(float(r1.mean()) - 1.0) < 4 * se1  # unbiased (n = 4000 draws)
    pi_S = float(torch.softmax(base, -1).masked_fill(~S[:1], 0).sum())
    se0 = float(r0.std()) / N ** 0.5
    assert abs(float(r0.mean()) - pi_S) < 4 * se0 and pi_S < 0.95  # biased: E[r] = pi(S)


def test_truncation_composes_with_every_mode():
    z = logits(N=12, V=24, seed=7)
    rep, S, _ = engine(z, top_k=6)
    B, T = 3, 4
    kw = dict(rollout_topk_ids=rep["rollout_topk_ids"].view(B, T, K),
              rollout_topk_logprobs=rep["rollout_topk_logprobs"].view(B, T, K))
    for mode in pdmask.MODES:
        if "full" in mode:
            continue  # the full-vocabulary modes refuse truncation (tested below)
        extra = {"batch_ddot": torch.randn(B, T, dtype=F64)} if "batch" in mode else {}
        out = flat.policy_loss(z.view(B, T, -1).clone().requires_grad_(), rep["sampled_ids"].view(B, T),
                                 rep["rollout_logprob"].view(B, T), **kw, advantages=torch.randn(B, dtype=F64),
                                 response_mask=torch.ones(B, T, dtype=torch.bool), mode=mode, sampling_top_k=6,
                                 **extra)
        torch.testing.assert_close(out.metrics["ratio_mean"], torch.tensor(1.0, dtype=F64), msg=mode)
        out.loss.backward()
    with pytest.raises(ValueError, match=r"^rollout.logits: the full-vocabulary terms are not available"):
        flat.policy_loss(z.view(B, T, -1), rep["sampled_ids"].view(B, T), rep["rollout_logprob"].view(B, T),
                           None, None, torch.ones(B, dtype=F64), None, mode="pdm-full-kl",
                           rollout_logits=z.view(B, T, -1), sampling_top_k=6)


def test_bad_truncation_arguments_name_the_argument():
    z = torch.full((1, 2, 5), float("nan"), dtype=F64)  # never read
    base = (z, torch.zeros(1, 2, dtype=torch.long), torch.full((1, 2), -1.0, dtype=F64), None, None,
            torch.ones(1, dtype=F64), None)
    for kw, msg in [
        (dict(sampling_top_p=2.0), r"^top_p: "),
        (dict(sampling_top_k="5"), r"^top_k: "),
        (dict(rollout_kept_mask=torch.ones(1, 2, 4, dtype=torch.bool)), r"^rollout.kept_mask: expected shape"),
        (dict(rollout_kept_mask=torch.ones(1, 2, 5, dtype=torch.bool), sampling_top_k=2),
         r"^rollout.kept_mask: give either"),
        (dict(sampling_top_k=2, impl="triton"), r"^impl: 'triton' has no kernel"),
    ]:
        with pytest.raises(ValueError, match=msg):
            flat.policy_loss(*base, mode="dppo-binary-kl", **kw)


def _padded_args(rep, mask):
    """The loss's rollout arguments of the engine's report ``rep``, shaped as ``mask`` (B, T)."""
    B, T = mask.shape
    return dict(sampled_ids=rep["sampled_ids"].view(B, T), rollout_logprob=rep["rollout_logprob"].view(B, T),
                rollout_topk_ids=rep["rollout_topk_ids"].view(B, T, K),
                rollout_topk_logprobs=rep["rollout_topk_logprobs"].view(B, T, K),
                advantages=torch.tensor([1.0, -0.5], dtype=F64), response_mask=mask)


def _padded_case(junk, seed=8):
    """(B, T) batch whose padding rows hold ``junk`` (NaN, +inf, -inf or a mix) in the logits,
    and the same batch with finite padding, for gradients that must not tell them apart."""
    B, T, V = 2, 4, 24
    z = logits(N=B * T, V=V, seed=seed).view(B, T, V)
    rep, _, _ = engine(z.view(-1, V), top_k=6)
    mask = torch.tensor([[True, True, True, False], [True, False, True, False]])
    zp = z.clone()
    if junk == "mixed":
        zp[~mask] = torch.tensor([math.nan, math.inf, -math.inf, 1.0] * (V // 4), dtype=F64)
    else:
        zp[~mask] = junk
    args = _padded_args(rep, mask)
    return z, zp, mask, args


JUNK = [math.nan, math.inf, -math.inf, "mixed"]


@pytest.mark.parametrize("trunc", [dict(sampling_top_p=0.9), dict(sampling_top_k=4)], ids=str)
@pytest.mark.parametrize("junk", JUNK, ids=str)
@pytest.mark.parametrize("impl", ["torch", "auto"])
def test_truncated_sampling_gives_nan_inf_padding_rows_zero_gradient(trunc, junk, impl):
    """Issue 30: padding may hold anything; under truncation too its rows get exactly 0 and the
    response rows the gradient of a batch with finite padding (before the fix: NaN everywhere)."""
    z, zp, mask, args = _padded_case(junk)
    grads = []
    for x0 in (z, zp):
        x = x0.clone().requires_grad_()
        out = flat.policy_loss(x, **args, mode="pdm-topk-kl", impl=impl, **trunc)
        out.loss.backward()
        assert torch.isfinite(out.loss)
        grads.append(x.grad)
    assert torch.isfinite(grads[1]).all() and (grads[1][~mask] == 0).all()
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


@pytest.mark.parametrize("trunc", [dict(sampling_top_p=0.9), dict(sampling_top_k=4)], ids=str)
@pytest.mark.parametrize("junk", JUNK, ids=str)
def test_truncated_sampling_from_hidden_gives_nan_inf_padding_rows_zero_gradient(trunc, junk):
    """The same from hidden states: a NaN/inf hidden row (padding) leaves the LM-head weight's
    gradient and the other rows' gradients as with finite padding."""
    B, T, H, V = 2, 4, 8, 24
    g = torch.Generator().manual_seed(9)
    h = torch.randn(B, T, H, generator=g, dtype=F64)
    W = torch.randn(V, H, generator=g, dtype=F64)
    rep, _, _ = engine((h @ W.T).view(-1, V), top_k=6)
    mask = torch.tensor([[True, True, True, False], [True, False, True, False]])
    hp = h.clone()
    if junk == "mixed":
        hp[~mask] = torch.tensor([math.nan, math.inf, -math.inf, 1.0] * (H // 4), dtype=F64)
    else:
        hp[~mask] = junk
    args = _padded_args(rep, mask)
    grads = []
    for h0 in (h, hp):
        hh, WW = h0.clone().requires_grad_(), W.clone().requires_grad_()
        out = flat.policy_loss_from_hidden(hh, WW, **args, mode="pdm-topk-kl", chunk_rows=3, **trunc)
        out.loss.backward()
        assert torch.isfinite(out.loss)
        grads.append((hh.grad, WW.grad))
    (gh0, gW0), (gh1, gW1) = grads
    assert torch.isfinite(gW1).all() and torch.isfinite(gh1).all() and (gh1[~mask] == 0).all()
    torch.testing.assert_close(gW1, gW0, rtol=0, atol=0)
    torch.testing.assert_close(gh1, gh0, rtol=0, atol=0)
