"""DRPO, SPO and the smooth predictive weight: against their authors' code, autograd and each other.

The oracles below restate the peers' per-token losses in our own words (we do not install them):

- **UniRL DRPO** (Tencent-Hunyuan/UniRL at 17863c4, ``unirl/algorithms/drpo.py``, ``_drpo_loss``;
  the file once named ``ar_drpo.py``, whose ``_ar_drpo_loss`` it replaced): the log-ratio
  ``new_logp - old_logp`` is clamped to [-20, 20] (``drpo.py:115``) and exponentiated to ``r``
  (differentiable through ``new_logp``); ``mu`` is ``exp(old_logp)``, detached; the token's loss is
  ``-A r + |A| w_pen (r - 1)^2 / (2 eps)`` with ``w_pen = mu`` (``penalty_mu_weighted=True``, DRPO)
  or 1 (``False``: "plain SPO"). Its default ``drpo_epsilon`` is 12.5 ("paper section 4"). Its
  ``seq-mean-token-sum-norm`` (``DRPO.compute_loss_and_backward``, ``drpo.py:265-267``) splits the
  masked token losses by ``segment.lengths``, sums each sequence and takes the mean over *every*
  sequence, one without a loss token included, divided by ``horizon``.
- **SPO's authors** (MyRepositories-hub/Simple-Policy-Optimization at 48c13fd, ``mujoco/trainer.py``,
  ``Trainer.compute_policy_loss`` with ``algo == 'spo'``, lines 105-109):
  ``-(A r - |A| (r - 1)^2 / (2 eps))`` with ``r = exp(new_logp - old_logp)`` *not* clamped
  (``trainer.py:33-34``); default ``epsilon`` 0.2 (``mujoco/main.py``).
- **verl 0.9.1's** ``agg_loss`` (``verl/trainer/ppo/core_algos.py:1181-1193``): the seq-mean modes
  average over the sequences with at least one loss token (``seq_mask``, line 1183).
"""

from __future__ import annotations

import math

import pytest
import torch

import pdmask
from pdmask.masks import (
    MaskMode, advantage_limit, divergence_region, predictive, ratio_sign, smooth_weight, token_loss,
)

from .helpers import make_case
from tests import flat  # noqa: E402

F64 = torch.float64
SMOOTH = ["drpo", "spo", "pdm-smooth-topk-kl", "pdm-smooth-topk-tv"]


# ------------------------------------------------------------------ the restated oracles
def unirl_drpo_loss(new_logp, old_logp, adv, eps, mu_weighted=True):
    """UniRL's ``_drpo_loss`` (module docstring), per token; ``eps`` a number or a tensor."""
    r = torch.exp((new_logp - old_logp).clamp(-20.0, 20.0))
    mu = old_logp.exp().detach()
    pen_w = mu if mu_weighted else torch.ones_like(mu)
    return -adv * r + adv.abs() * pen_w * (r - 1.0) ** 2 / (2.0 * eps)


def spo_authors_loss(new_logp, old_logp, adv, eps):
    """SPO's ``compute_policy_loss`` (module docstring), per token (no mean, no clamp)."""
    r = torch.exp(new_logp - old_logp)
    return -(adv * r - adv.abs() * (r - 1.0) ** 2 / (2.0 * eps))


def unirl_seq_mean_token_sum_norm(per_token, lengths, horizon):
    """UniRL's ``seq-mean-token-sum-norm`` (module docstring) on packed token losses (already
    multiplied by the loss mask): the mean over every sequence of its sum, / horizon."""
    parts = torch.split(per_token, lengths)
    return torch.stack([p.sum() for p in parts]).mean() / float(horizon)


def verl_seq_mean_token_sum_norm(loss_mat, loss_mask, horizon):
    """verl 0.9.1's ``agg_loss`` in ``seq-mean-token-sum-norm`` (module docstring), local batch."""
    seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
    seq_mask = (torch.sum(loss_mask, dim=-1) > 0).to(loss_mat.dtype)
    return (seq_losses * seq_mask).sum() / seq_mask.sum() / horizon


# ------------------------------------------------------------------ batches
def batch(seed=0, B=4, T=7, V=40, K=6, extreme=False):
    """Ragged (B, T) batch with a mismatched rollout, an empty sequence, A of both signs and 0
    (``extreme``: tokens with log r > 20 and < -20 as well)."""
    c = make_case(B * T, V, K, seed=seed, mismatch=1.2, scale=2.5)
    g = torch.Generator().manual_seed(seed + 7)
    logits = c["logits"].reshape(B, T, V)
    rlp = c["rollout_logprob"].reshape(B, T).clone()
    tk, tlp = c["topk_ids"].reshape(B, T, K), c["topk_logprobs"].reshape(B, T, K).clone()
    if extreme:
        k = c["sampled_ids"].reshape(B, T)
        rlp[0, 1] = -45.0  # log r ~ +40 (the top-K says the same of the sampled token)
        tlp[0, 1] = torch.where(tk[0, 1] == k[0, 1], torch.full_like(tlp[0, 1], -45.0), tlp[0, 1])
        logits = logits.clone()
        logits[1, 2, k[1, 2]] -= 60.0  # log r ~ -60
    resp = torch.ones(B, T, dtype=torch.bool)
    resp[0, -2:] = False
    resp[2, -3:] = False
    resp[3] = False  # an empty sequence
    adv = torch.randn(B, generator=g, dtype=F64) * 2
    adv[1] = -abs(adv[1])
    adv[0] = abs(adv[0])
    adv_t = adv[:, None].expand(B, T).clone()
    adv_t[2, 0] = 0.0
    return dict(logits=logits, ids=c["sampled_ids"].reshape(B, T), rlp=rlp, tk=tk, tlp=tlp, adv=adv_t, resp=resp)


def run(b, mode, **kw):
    leaf = b["logits"].clone().requires_grad_(True)
    out = flat.policy_loss(leaf, b["ids"], b["rlp"], b["tk"], b["tlp"], b["adv"], b["resp"], mode=mode, **kw)
    (g,) = torch.autograd.grad(out.loss, leaf)
    return out, g


def oracle(b, per_token_fn, agg="token-mean"):
    """Loss and logits-gradient of a per-token oracle on the same batch, token-mean aggregated."""
    leaf = b["logits"].clone().requires_grad_(True)
    new_logp = torch.log_softmax(leaf, -1).gather(-1, b["ids"][..., None]).squeeze(-1)
    per = per_token_fn(new_logp, b["rlp"].to(F64), b["adv"])
    m = b["resp"]
    per = torch.where(m, per, torch.zeros_like(per))
    loss = per.sum() / m.sum()
    (g,) = torch.autograd.grad(loss, leaf)
    return per.detach(), loss.detach(), g


# ------------------------------------------------------------------ DRPO = UniRL
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("extreme", [False, True])
def test_drpo_equals_unirl_loss_and_gradient(seed, extreme):
    b = batch(seed, extreme=extreme)
    for dl, dh in [(0.15, 0.15), (12.5, 12.5), (0.05, 0.3)]:
        out, g = run(b, "drpo", delta_low=dl, delta_high=dh)
        eps = torch.where(b["adv"] > 0, torch.full_like(b["adv"], dh), torch.full_like(b["adv"], dl))
        per, loss, g_ref = oracle(b, lambda lp, old, a: unirl_drpo_loss(lp, old, a, eps))
        torch.testing.assert_close(out.token_loss.detach(), per, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(out.loss.detach(), loss, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=1e-14)
        assert bool(out.mask[b["resp"]].all()), "DRPO masks nothing"


def test_drpo_gradient_weight_is_the_closed_form():
    """d loss_t / d log pi_k = -A w r with w = 1 - sign(A (r - 1)) |pi_k - mu_k| / delta (UniRL's
    Table-1 weight): smooth, bounded in [1 - 1/delta, 1 + 1/delta], negative beyond delta."""
    g = torch.Generator().manual_seed(5)
    n = 400
    rlp = torch.log(torch.rand(n, generator=g, dtype=F64) * 0.98 + 0.01)
    logp = torch.log(torch.rand(n, generator=g, dtype=F64) * 0.98 + 0.01).requires_grad_(True)
    adv = torch.randn(n, generator=g, dtype=F64)
    delta = 0.15
    per, _ = token_loss(logp, (logp - rlp).detach(), adv, torch.ones(n, dtype=torch.bool), surrogate="drpo",
                        delta_low=delta, delta_high=delta, rollout_logp=rlp)
    (d,) = torch.autograd.grad(per.sum(), logp)
    pi, mu = logp.detach().exp(), rlp.exp()
    r = pi / mu
    w = 1 - torch.sign(adv * (r - 1)) * (pi - mu).abs() / delta
    torch.testing.assert_close(d, -adv * w * r, rtol=1e-12, atol=1e-14)
    assert bool((w >= 1 - 1 / delta).all() and (w <= 1 + 1 / delta).all())
    beyond = ((pi - mu).abs() > delta) & (adv * (r - 1) > 0)
    assert bool(beyond.any()) and bool((w[beyond] < 0).all()) and bool((w[~beyond] >= 0).all())
    # the mode's reported weight is the same closed form (from the statistics)
    st = {"log_ratio": (logp - rlp).detach(), "ratio": r, "binary_tv": (pi - mu).abs()}
    torch.testing.assert_close(smooth_weight(st, adv, "drpo", thresholds=pdmask.Thresholds(delta, delta)), w,
                               rtol=1e-12, atol=1e-14)


def test_drpo_at_unirls_default_scale_never_corrects():
    """delta is in probability units (|pi_k - mu_k| <= 1): UniRL's drpo_epsilon = 12.5 keeps
    w in [1 - 1/12.5, 1 + 1/12.5] = [0.92, 1.08], so no token reaches the corrective side."""
    b = batch(1)
    out, _ = run(b, "drpo", delta_low=12.5, delta_high=12.5)
    assert float(out.metrics["corrective_frac"]) == 0.0
    assert 0.92 <= float(out.metrics["smooth_weight_min"]) <= 1.0
    out, _ = run(b, "drpo", delta_low=0.05, delta_high=0.05)  # a delta below 1 does, where |pi_k - mu_k| > delta
    assert float(out.metrics["corrective_frac"]) > 0


@pytest.mark.parametrize("mode", ["drpo", "spo"])
def test_drpo_and_spo_pass_gradcheck(mode):
    b = batch(3)
    leaf = b["logits"].clone().requires_grad_(True)

    def f(z):
        return flat.policy_loss(z, b["ids"], b["rlp"].to(F64), None, None, b["adv"], b["resp"], mode=mode).loss

    assert torch.autograd.gradcheck(f, (leaf,), eps=1e-6, atol=1e-8, rtol=1e-6)


# ------------------------------------------------------------------ SPO
@pytest.mark.parametrize("seed", [0, 1])
def test_spo_equals_unirl_plain_spo_everywhere_and_the_authors_inside_the_clamp(seed):
    b = batch(seed, extreme=True)
    eps = 0.2
    out, g = run(b, "spo", delta_low=eps, delta_high=eps)
    per, loss, g_ref = oracle(b, lambda lp, old, a: unirl_drpo_loss(lp, old, a, eps, mu_weighted=False))
    torch.testing.assert_close(out.token_loss.detach(), per, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=1e-14)
    # the authors' code takes no clamp: equal where |log r| <= 20, a documented difference beyond
    per_a, _, _ = oracle(b, lambda lp, old, a: spo_authors_loss(lp, old, a, eps))
    lr = out.stats["log_ratio"].detach()
    inside = b["resp"] & (lr.abs() <= 20)
    beyond = b["resp"] & (lr.abs() > 20) & (b["adv"] != 0)
    assert bool(beyond.any())
    torch.testing.assert_close(out.token_loss.detach()[inside], per_a[inside], rtol=1e-12, atol=1e-14)
    assert bool((out.token_loss.detach()[beyond] != per_a[beyond]).all())


def test_spo_authors_gradient_grows_beyond_the_clamp_where_ours_is_zero():
    """The SPO authors' ratio has no clamp (trainer.py:33-34): beyond |log r| = 20 their gradient
    w.r.t. log pi_k, -A r + |A| (r - 1) r / eps, keeps growing (about 5.7e26 at log r = 30,
    |A| = 1, eps = 0.2), where ours (and UniRL's) is 0: docs/core.md states it."""
    eps = 0.2
    old = torch.tensor([-31.0, -1.0, -1.0], dtype=F64)
    adv = torch.tensor([1.0, -1.0, 1.0], dtype=F64)
    logp = torch.tensor([-1.0, -0.8, -1.5], dtype=F64).requires_grad_(True)  # log r = 30, 0.2, -0.5
    per, _ = token_loss(logp, (logp - old).detach(), adv, torch.ones(3, dtype=torch.bool), surrogate="spo",
                        delta_low=eps, delta_high=eps)
    (ours,) = torch.autograd.grad(per.sum(), logp)
    (theirs,) = torch.autograd.grad(spo_authors_loss(logp, old, adv, eps).sum(), logp)
    (unirl,) = torch.autograd.grad(unirl_drpo_loss(logp, old, adv, eps, mu_weighted=False).sum(), logp)
    r = math.exp(30.0)
    assert float(ours[0]) == 0.0 and float(unirl[0]) == 0.0
    assert float(theirs[0]) == pytest.approx(-r + (r - 1) * r / eps, rel=1e-12) and float(theirs[0]) > 1e26
    torch.testing.assert_close(ours[1:], theirs[1:], rtol=1e-12, atol=1e-14)  # inside the clamp: the same


def test_unirl_seq_mean_token_sum_norm_counts_an_empty_sequence_verl_and_pdmask_do_not():
    """One sequence without a loss token among five: UniRL averages over five, verl 0.9.1 and
    pdmask over four, so theirs is 5/4 of UniRL's (docs/core.md, Aggregation)."""
    g = torch.Generator().manual_seed(3)
    B, T, horizon = 5, 6, 8.0
    loss_mat = torch.randn(B, T, generator=g, dtype=F64)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 4:] = False
    mask[3] = False  # the empty sequence: every token masked (a truncated or filtered response)
    ours = pdmask.aggregate(loss_mat, mask, pdmask.Aggregation("seq-mean-token-sum-norm", loss_scale_factor=horizon))
    verl = verl_seq_mean_token_sum_norm(loss_mat, mask.to(F64), horizon)
    unirl = unirl_seq_mean_token_sum_norm((loss_mat * mask).reshape(-1), [T] * B, horizon)
    torch.testing.assert_close(ours, verl, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(ours, unirl * 5 / 4, rtol=1e-12, atol=1e-14)
    assert abs(float(ours - unirl)) > 1e-3
    # without the empty sequence the three agree
    full = torch.ones(B, T, dtype=torch.bool)
    torch.testing.assert_close(
        pdmask.aggregate(loss_mat, full, pdmask.Aggregation("seq-mean-token-sum-norm", loss_scale_factor=horizon)),
        unirl_seq_mean_token_sum_norm(loss_mat.reshape(-1), [T] * B, horizon), rtol=1e-12, atol=1e-14)


def test_the_peer_differences_are_stated_where_equality_is_claimed():
    """docs/core.md and docs/verl.md state the differences the two tests above assert, and name
    UniRL's function by its name (``_drpo_loss``; ``spo_adaptive_eps`` is the verl loss of the
    version UniRL's DRPO recipe used)."""
    from pathlib import Path

    docs = Path(__file__).resolve().parents[2] / "docs"
    core = " ".join((docs / "core.md").read_text().split())
    verl = " ".join((docs / "verl.md").read_text().split())
    assert "The SPO authors' own code (`mujoco/trainer.py`, `compute_policy_loss`) clamps nothing" in core
    assert "it averages over *every* sequence of the batch" in core and "×1.25 with one empty sequence" in core
    row = next(ln for ln in (docs / "verl.md").read_text().splitlines() if ln.startswith("| `pdmask_drpo` |"))
    assert "UniRL's `_drpo_loss`, `unirl/algorithms/drpo.py`" in row and "UniRL's `spo_adaptive_eps`" not in row
    assert "`drpo.py`" in core or "`unirl/algorithms/drpo.py`" in core
    assert "clamp their log ratio to ±20" in verl


def test_spo_gradient_weight_and_region():
    """d loss_t / d log pi_k = -A w r with w = 1 - sign(A (r - 1)) |r - 1| / delta; w < 0 exactly
    where |r - 1| > delta outward (the mode's region x ratio direction: out_of_region, outward)."""
    g = torch.Generator().manual_seed(8)
    n = 400
    rlp = torch.log(torch.rand(n, generator=g, dtype=F64) * 0.98 + 0.01)
    logp = (rlp + torch.randn(n, generator=g, dtype=F64) * 0.4).clamp(max=0).requires_grad_(True)
    adv = torch.randn(n, generator=g, dtype=F64)
    dl, dh = 0.1, 0.3
    per, _ = token_loss(logp, (logp - rlp).detach(), adv, torch.ones(n, dtype=torch.bool), surrogate="spo",
                        delta_low=dl, delta_high=dh)
    (d,) = torch.autograd.grad(per.sum(), logp)
    r = (logp.detach() - rlp).exp()
    delta = torch.where(adv > 0, torch.full_like(adv, dh), torch.full_like(adv, dl))
    w = 1 - torch.sign(adv * (r - 1)) * (r - 1).abs() / delta
    torch.testing.assert_close(d, -adv * w * r, rtol=1e-12, atol=1e-14)
    st = {"log_ratio": (logp - rlp).detach(), "ratio": r}
    th = pdmask.Thresholds(dl, dh)
    torch.testing.assert_close(smooth_weight(st, adv, "spo", thresholds=th), w, rtol=1e-12, atol=1e-14)
    res = pdmask.mask_from_stats({**st, "binary_kl": r * 0, "ddot_binary_kl": r * 0}, adv, "spo", thresholds=th)
    assert torch.equal(w < 0, res.out_of_region & res.outward)
    assert bool((w < 0).any()) and bool(res.keep.all())


# ------------------------------------------------------------------ the smooth predictive weight
BINARY_TV_SMOOTH = {
    "ratio": MaskMode("smooth-binary-tv-ratio", divergence_region("binary_tv"), ratio_sign(), "binary_tv",
                      surrogate="smooth", default_delta=0.15),
    "predictive": MaskMode("smooth-binary-tv-pred", divergence_region("binary_tv"), predictive("binary_tv"),
                           "binary_tv", surrogate="smooth", default_delta=0.15),
}


@pytest.mark.parametrize("direction", list(BINARY_TV_SMOOTH))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_smooth_weight_over_binary_tv_is_drpo(direction, seed):
    """Over binary TV with the ratio direction (or binary TV's own Ddot, which has its sign) the
    smooth predictive weight is DRPO's: the same weight and the same gradient to float64
    rounding. Its value is -A w r, not DRPO's quadratic (a documented difference)."""
    b = batch(seed)
    for dl, dh in [(0.15, 0.15), (0.05, 0.3)]:
        out_s, g_s = run(b, BINARY_TV_SMOOTH[direction], delta_low=dl, delta_high=dh)
        out_d, g_d = run(b, "drpo", delta_low=dl, delta_high=dh)
        m = b["resp"]
        torch.testing.assert_close(g_s, g_d, rtol=1e-10, atol=1e-13)
        for k in ("smooth_weight_mean", "smooth_weight_min", "corrective_frac"):
            torch.testing.assert_close(out_s.metrics[k], out_d.metrics[k], rtol=1e-12, atol=1e-14)
        moved = m & (b["adv"] != 0) & (out_d.stats["log_ratio"].detach().abs() > 1e-3)
        assert bool((out_s.token_loss.detach()[moved] != out_d.token_loss.detach()[moved]).all())


@pytest.mark.parametrize("div", ["kl", "tv"])
@pytest.mark.parametrize("estimator", list(pdmask.ESTIMATORS))
def test_smooth_topk_gradient_and_its_hard_counterpart(div, estimator):
    """pdm-smooth-topk-*: gradient -A w r (e_k - pi) (w detached) against autograd of the
    restated formula; w < 0 exactly on the tokens pdm-topk-* masks at the same delta."""
    b = batch(5)
    d = 0.02 if div == "kl" else 0.1
    out, g = run(b, f"pdm-smooth-topk-{div}", estimator=estimator, delta_low=d, delta_high=d)
    hard, _ = run(b, f"pdm-topk-{div}", estimator=estimator, delta_low=d, delta_high=d)
    st, adv, m = out.stats, b["adv"], b["resp"]
    D, dd = st[f"topk_{div}"], st[pdmask.ddot_key(f"topk_{div}", estimator)]
    w = 1 - torch.sign(adv * dd) * D / d

    def per_token(lp, old, a):
        return -a * w * torch.exp((lp - old).clamp(-20, 20))

    _, loss, g_ref = oracle(b, per_token)
    torch.testing.assert_close(out.loss.detach(), loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=1e-14)
    masked = ~hard.mask & m
    assert bool(masked.any()), "the hard mask must act or the comparison proves little"
    assert torch.equal((w < 0) & m, masked)
    assert bool(out.mask[m].all())


def test_smooth_modes_reach_their_hard_masks_only_beyond_delta():
    """A small delta: corrective tokens exist; delta = inf: w = 1, the IS-weighted gradient -A r."""
    b = batch(6)
    for mode in SMOOTH:
        out, g = run(b, mode, delta_low=math.inf, delta_high=math.inf)
        assert float(out.metrics["corrective_frac"]) == 0.0 and float(out.metrics["smooth_weight_min"]) == 1.0
        ref, g_ref = oracle(b, lambda lp, old, a: -a * torch.exp((lp - old).clamp(-20, 20)))[1:]
        torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=1e-14)


# ------------------------------------------------------------------ refusals and edges
@pytest.mark.parametrize("mode", SMOOTH)
def test_smooth_modes_refuse_a_second_weight(mode):
    b = batch(0)
    for kw, name in [(dict(is_level="sequence"), "is_level"), (dict(is_floor=0.5), "is_floor"),
                     (dict(is_batch_normalize=True), "is_batch_normalize"), (dict(is_cap=3.0), "is_cap"),
                     (dict(dual_clip=3.0), "dual_clip")]:
        with pytest.raises(ValueError, match=rf"^{name}: "):
            run(b, mode, **kw)
    # masks compose: IcePop bounds and a rejection rule
    out, _ = run(b, mode, is_mask=True, is_floor=0.5, is_cap=2.0, rejection="seq_mean_k3", rejection_threshold=0.5)
    assert float(out.metrics["masked_frac_correction"]) > 0


def test_smooth_mode_needs_a_divergence_region_and_a_direction():
    with pytest.raises(ValueError, match=r"^surrogate: 'smooth'"):
        pdmask.get_mode(MaskMode("x", pdmask.ratio_region(), ratio_sign(), "binary_tv", surrogate="smooth"))
    with pytest.raises(ValueError, match=r"^surrogate: 'smooth'"):
        pdmask.get_mode(MaskMode("x", divergence_region("binary_tv"), None, "binary_tv", surrogate="smooth"))
    with pytest.raises(ValueError, match=r"^mode: 'dppo-binary-tv' uses the dppo surrogate"):
        smooth_weight({}, torch.zeros(1), "dppo-binary-tv")


@pytest.mark.parametrize("mode", SMOOTH)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_smooth_modes_are_finite_at_extreme_logits(mode, dtype):
    """Logits of scale 60, -inf logits (also the sampled token's), log r beyond +-20 and a
    rollout log-prob of -inf-like size: loss, gradient and metrics finite, except that a float16
    gradient (the logits' dtype) above 65504 overflows to inf: these surrogates' ratio reaches
    e^20 (as ``none`` with ``is_cap=inf``), a float16 trainer's loss scaler skips such a step.
    Never NaN."""
    b = batch(7, extreme=True)
    z = b["logits"] * 25
    k = b["ids"]
    z[0, 0, k[0, 0]] = -math.inf
    z[2, 1] = torch.where(torch.arange(z.shape[-1]) == k[2, 1], z[2, 1], torch.tensor(-math.inf, dtype=F64))
    b = {**b, "logits": z.to(dtype), "rlp": b["rlp"].clamp(min=-80.0).float()}
    leaf = b["logits"].clone().requires_grad_(True)
    out = flat.policy_loss(leaf, b["ids"], b["rlp"], b["tk"], b["tlp"].float(), b["adv"], b["resp"], mode=mode)
    out.loss.backward()
    assert torch.isfinite(out.loss) and not bool(leaf.grad.isnan().any())
    if dtype != torch.float16:
        assert bool(torch.isfinite(leaf.grad).all())
    for name, v in out.metrics.items():
        assert bool(torch.isfinite(v).all()), name


def test_advantage_limits_of_the_smooth_surrogates():
    big = math.exp(20)
    f32 = torch.finfo(torch.float32)
    assert advantage_limit("drpo", 5.0, torch.float32, delta=0.1) == pytest.approx(f32.max / (big * 6))
    assert advantage_limit("spo", 5.0, torch.float32, delta=0.2) == pytest.approx(f32.max / (big + big * big / 0.4))
    lp = -math.log(f32.tiny)
    assert advantage_limit("smooth", 5.0, torch.float32, delta=0.05) == pytest.approx(f32.max / (big * (1 + lp / 0.05)))
    b = batch(0)
    b["logits"] = b["logits"].float()  # the limit is the loss's dtype's
    with pytest.raises(ValueError, match=r"^advantages: sum of \|A\|.*spo surrogate, delta=1e-30"):
        run(b, "spo", delta_low=1e-30, delta_high=1e-30)


def test_token_loss_refusals():
    x = torch.zeros(2, dtype=F64)
    keep = torch.ones(2, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"^weight: the drpo surrogate takes no separate IS weight"):
        token_loss(x, x, x, keep, surrogate="drpo", weight=x, delta_low=1.0, delta_high=1.0)
    with pytest.raises(ValueError, match=r"^weight: the smooth surrogate needs its weight"):
        token_loss(x, x, x, keep, surrogate="smooth")
    with pytest.raises(ValueError, match=r"^delta_low / delta_high: the spo surrogate needs"):
        token_loss(x, x, x, keep, surrogate="spo")
    with pytest.raises(ValueError, match=r"^surrogate: unknown value 'x'"):
        token_loss(x, x, x, keep, surrogate="x")
