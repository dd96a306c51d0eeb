"""Property tests: any shape, K, dtype and extreme logits give finite losses and gradients."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pdmask
import pdmask_lab.batchmask  # noqa: F401  (its modes are drawn too)
from pdmask.masks import SMOOTH_SURROGATES
from tests import flat  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@st.composite
def cases(draw):
    B = draw(st.integers(1, 3))
    T = draw(st.integers(1, 4))
    V = draw(st.integers(2, 40))
    K = draw(st.integers(1, V))
    dtype = draw(st.sampled_from(DTYPES))
    scale = draw(st.sampled_from([0.0, 1e-3, 1.0, 10.0, 60.0]))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(B, T, V, generator=g) * scale
    if draw(st.booleans()):  # some -inf logits (a masked vocabulary), never a whole row
        z[..., 1:][torch.rand(B, T, V - 1, generator=g) < 0.3] = -math.inf
    y = torch.randn(B, T, V, generator=g) * draw(st.sampled_from([0.0, 1.0, 20.0]))
    logmu = torch.log_softmax(y.double(), -1)
    if draw(st.booleans()):  # engine top-p truncation: -inf log-probs inside the top-K
        keep = torch.rand(B, T, V, generator=g) < 0.5
        keep[..., 0] = True
        logmu = torch.log_softmax(torch.where(keep, y.double(), torch.tensor(-math.inf, dtype=torch.float64)), -1)
    top = logmu.topk(K, -1)
    k = torch.multinomial(logmu.exp().reshape(-1, V), 1, generator=g).reshape(B, T)
    mode = draw(st.sampled_from(sorted(m for m in pdmask.MODES if "full" not in m)))
    agg = draw(st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                "seq-mean-token-sum-norm"]))
    est = draw(st.sampled_from(list(pdmask.ESTIMATORS)))
    support = "topk+sampled" if pdmask.get_mode(mode).extras else draw(st.sampled_from(pdmask.SUPPORTS))
    resp = torch.rand(B, T, generator=g) < 0.8
    return dict(logits=z.to(dtype), ids=k, lp=logmu.gather(-1, k[..., None]).squeeze(-1).float(),
                tk=top.indices, tlp=top.values.float(), adv=torch.randn(B, generator=g) * 3, resp=resp,
                mode=mode, agg=agg, est=est, support=support, T=draw(st.sampled_from([1.0, 0.6, 1.7])),
                bd=torch.randn(B, T, generator=g) if pdmask.get_mode(mode).extras else None)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_loss_and_gradient_are_always_finite(c):
    logits = c["logits"].clone().requires_grad_(True)
    # the smooth surrogates' ratio is their weight: they take no is_cap
    # (a preset mode sets its own: cispo's clip(r, 1 - eps_low, 1 + eps_high))
    cap = {} if pdmask.MODES[c["mode"]].surrogate in SMOOTH_SURROGATES or pdmask.MODES[c["mode"]].corrections else {
        "is_cap": math.inf if c["mode"] == "none" else 5.0}
    out = flat.policy_loss(logits, c["ids"], c["lp"], c["tk"], c["tlp"], c["adv"], c["resp"],
                             mode=c["mode"], loss_agg=c["agg"], estimator=c["est"], support=c["support"],
                             temperature=c["T"], batch_ddot=c["bd"], **cap)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert torch.isfinite(logits.grad).all()
    for k, v in out.metrics.items():
        assert torch.isfinite(v).all(), k
    v = c["resp"]
    for k, t in out.stats.items():
        if t.dtype.is_floating_point and k not in ("logp", "log_ratio", "rollout_logp"):
            assert torch.isfinite(t[v]).all(), k
        if k.startswith("topk_") or k.startswith("binary_"):
            assert (t[v] >= 0).all(), k
    fr = out.metrics
    assert 0 <= fr["kept_frac"] <= 1 and 0 <= fr["disagreement_frac"] <= 1
    assert fr["kept_frac"] + fr["masked_frac"] == pytest.approx(1.0 if v.any() else 0.0, abs=1e-6)


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 30), st.integers(0, 2**16), st.data())
def test_topk_divergence_bounds_and_k_equal_v(V, seed, data):
    """Top-K KL/TV never exceed the full ones; with K = V everything equals the full answer."""
    K = data.draw(st.integers(1, V))
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(1, 4, V, generator=g, dtype=torch.float64) * 2
    y = z + torch.randn(1, 4, V, generator=g, dtype=torch.float64)
    logmu = torch.log_softmax(y, -1)
    k = torch.multinomial(logmu.exp()[0], 1, generator=g).T
    lp = logmu.gather(-1, k[..., None]).squeeze(-1)
    for KK in (K, V):
        top = logmu.topk(KK, -1)
        s_topk = flat.token_stats(z, k, lp, top.indices, top.values, rollout_logits=y, support="topk")
        s = flat.token_stats(z, k, lp, top.indices, top.values, rollout_logits=y)
        for d in ("kl", "tv"):  # the top-K alone <= top-K and k <= full (each a coarsening of the next)
            assert (s_topk[f"topk_{d}"] <= s[f"topk_{d}"] + 1e-10).all()
            assert (s[f"topk_{d}"] <= s[f"full_{d}"] + 1e-10).all()
    for d in ("kl", "tv"):
        for e in pdmask.ESTIMATORS:
            torch.testing.assert_close(s[f"ddot_topk_{d}_{e}"], s[f"ddot_full_{d}"], rtol=1e-8, atol=1e-11)
