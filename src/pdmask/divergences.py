"""Per-token divergences D(mu || pi) and their derivatives ``Ddot`` along a token's step
(METHOD.md sections 3 and 4), on the (N,) / (N, K) reductions of :func:`pdmask.ops.row_stats`.

``0 log 0 = 0``; log pi is floored at ``log(tiny)``, so a zero-probability token gives a large
finite divergence. The step on token t moves its logits along ``A w (e_k - pi)``, changing D
by ``A w Ddot``, ``Ddot = pi_k (g_k - gbar) - sum_i pi_i^2 (g_i - gbar)`` (``g = dD/dpi``,
``gbar = sum pi g``); outward iff ``A Ddot > 0``. The top-K tail enters only through
``P2 = sum_{tail} pi_i^2``, which the estimators take as the tail's own sum (``exact``),
``pi_T^2`` (``aggregated``), ``pi_T^2 / (V - |S'|)`` (``uniform``) or 0 (``truncated``).

The top-K divergences are registered objects (:class:`TopKDivergence`, :func:`register_divergence`):
each declares its value, its gradient ``g`` on the support and the tail bucket, and its default
delta; every top-K ``Ddot`` comes from that one formula (:func:`ddot_topk`), and a registration
whose gradient is not the derivative of its value is refused (:func:`check_divergence`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from ._validate import SpecError, check_choice, check_positive
from .keys import ESTIMATORS, SUPPORTS, TOPK_DIVERGENCES, add_topk_divergence

#: Default region thresholds delta: of the KL-like divergences (KL, binary KL) and of the
#: TV ones (top-K, binary and full TV); a registration may use them (docs/core.md's tables).
KL_DELTA = 0.05
TV_DELTA = 0.15
#: Default delta of the divergences computed outside the registry (the binary and full ones).
FIXED_DELTAS = {"binary_tv": TV_DELTA, "binary_kl": KL_DELTA, "full_kl": KL_DELTA, "full_tv": TV_DELTA}


def log_floor(dtype: torch.dtype) -> float:
    """The log floor of a dtype: log(smallest normal) (-87.3 in fp32). The one definition."""
    return math.log(torch.finfo(dtype).tiny)


def floor_log(x: torch.Tensor) -> torch.Tensor:
    """A log-probability floored at :func:`log_floor`: the one floor of the divergences' logs."""
    return x.clamp(min=log_floor(x.dtype))


def floor_neginf(x: torch.Tensor) -> torch.Tensor:
    """``x`` with -inf (a sampled token the trainer gives probability 0) at :func:`log_floor`,
    finite values untouched (their gradient too): the loss's and the corrections' floor."""
    return torch.where(torch.isneginf(x), torch.full_like(x, log_floor(x.dtype)), x)


def masked_mean(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over ``valid`` (0 when none): ``x[valid].mean()`` without the sync."""
    return torch.where(valid, x, torch.zeros_like(x)).sum() / valid.sum().clamp(min=1)


def _xlog_ratio(p: torch.Tensor, logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """p * (log p - log q) with 0 where p == 0 (also when logp is -inf)."""
    val = p * (floor_log(logp) - floor_log(logq))
    return torch.where(p > 0, val, torch.zeros_like(val))


def log1mexp(logp: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(logp)) for logp <= 0, accurate near 0 and near -inf; floored."""
    x = logp.clamp(max=0.0)
    out = torch.where(x > -0.6931, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))
    return floor_log(out)


# --------------------------------------------------------------------------- binary
def binary_tv(logp: torch.Tensor, sampled_logprob: torch.Tensor) -> torch.Tensor:
    """Binary TV ``|pi_k - mu_k|``. Naive torch: ``(logp.exp() - sampled_logprob.exp()).abs()``."""
    return (logp.exp() - sampled_logprob.exp()).abs()


def binary_kl(logp: torch.Tensor, sampled_logprob: torch.Tensor) -> torch.Tensor:
    """Binary KL ``mu_k log(mu_k/pi_k) + (1-mu_k) log((1-mu_k)/(1-pi_k))`` (sampled token vs the
    rest), from log-probs with ``log1mexp`` so that pi_k -> 1 or mu_k -> 1 stays finite."""
    mu = sampled_logprob.exp()
    a = mu * (sampled_logprob - floor_log(logp))
    b = _xlog_ratio(-torch.expm1(sampled_logprob), log1mexp(sampled_logprob), log1mexp(logp))
    return (a + b).clamp(min=0.0)


# --------------------------------------------------------------------------- top-K
@dataclass
class Support:
    """The support ``S`` of the top-K divergences, plus one tail bucket: columns 0..K-1 the
    rollout's top-K, column K the sampled token outside it (``"topk+sampled"``) or empty."""

    pi: torch.Tensor  # (N, K+1) trainer probabilities on S (0 on the empty column)
    mu: torch.Tensor  # (N, K+1) rollout probabilities on S (0 on the empty column)
    logpi: torch.Tensor  # (N, K+1)
    logmu: torch.Tensor  # (N, K+1)
    valid: torch.Tensor  # (N, K+1) bool: column belongs to S
    k_col: torch.Tensor  # (N,) column index of the sampled token (K, the empty column, when outside S)
    k_in: torch.Tensor  # (N,) bool: the sampled token is in S
    logpi_k: torch.Tensor  # (N,) log pi_k, wherever k lies
    logpi_tail: torch.Tensor  # (N,) log pi_T, pi_T = pi's mass outside S
    pi_tail: torch.Tensor  # (N,) pi_T = exp(logpi_tail)
    mu_tail: torch.Tensor  # (N,) 1 - sum_S mu, clamped to [0, 1]
    mu_tail_clamped: torch.Tensor  # (N,) bool: sum_S mu exceeded 1 by rounding
    n_tail: torch.Tensor  # (N,) number of vocabulary ids outside S (V - |S|)
    tail_p2: torch.Tensor  # (N,) sum_{i not in S} pi_i^2, clamped to [0, pi_T^2]

    @property
    def pi_k(self) -> torch.Tensor:
        on_support = self.pi.gather(1, self.k_col[:, None]).squeeze(1)
        return torch.where(self.k_in, on_support, self.logpi_k.exp())

    @property
    def mu_k(self) -> torch.Tensor:
        """mu_k on S (0 where the sampled token lies in the tail: the divergence does not see it)."""
        return self.mu.gather(1, self.k_col[:, None]).squeeze(1)


def build_support(sampled_ids, logp, sampled_logprob, topk_ids, topk_logp, topk_logprobs, sum_p2, vocab_size: int, *,
                  log_pi_tail=None, sum_p2_tail=None, support: str = "topk+sampled") -> Support:
    """The view of the support ``S`` (:data:`SUPPORTS`) from (N,) ``log pi_k``, ``log mu_k``,
    ``sum_i pi_i^2`` and (N, K) top-K ids, log pi and log mu there. ``log_pi_tail`` / ``sum_p2_tail``: pi's
    log-mass and sum of squares outside ``topK ∪ {k}``, reduced over the tail itself; without
    them ``1 - sum_S pi`` (cancels catastrophically in float32: a float64 fallback). With
    ``support="topk"`` a sampled token outside the top-K joins the tail."""
    check_choice("support", support, SUPPORTS)
    dt = logp.dtype
    N, K = topk_ids.shape
    hit = topk_ids == sampled_ids[:, None]  # (N, K)
    in_topk = hit.any(-1)  # (N,)
    extra = ~in_topk if support == "topk+sampled" else torch.zeros_like(in_topk)
    k_in = in_topk | extra
    neg_inf = torch.full_like(logp, float("-inf"))
    logpi = torch.cat([topk_logp.to(dt), torch.where(extra, logp, neg_inf)[:, None]], 1)
    logmu = torch.cat([topk_logprobs.to(dt), torch.where(extra, sampled_logprob.to(dt), neg_inf)[:, None]], 1)
    valid = torch.cat([torch.ones_like(hit), extra[:, None]], 1)
    pi = logpi.exp()
    mu = logmu.exp()
    k_col = torch.where(in_topk, hit.to(torch.int64).argmax(-1), torch.full_like(sampled_ids, K))
    if log_pi_tail is None:
        log_pi_tail = torch.log((1 - pi.sum(-1)).clamp(0.0, 1.0))
    else:
        log_pi_tail = log_pi_tail.to(dt)
        if support == "topk":  # k outside the top-K is in the tail too
            log_pi_tail = torch.where(in_topk, log_pi_tail, torch.logaddexp(log_pi_tail, logp))
    pi_tail = log_pi_tail.exp().clamp(max=1.0)
    mu_sum = mu.sum(-1)
    mu_tail_clamped = mu_sum > 1
    mu_tail = (1 - mu_sum).clamp(0.0, 1.0)
    n_tail = vocab_size - valid.sum(-1)
    if sum_p2_tail is None:
        p2 = sum_p2 - (pi * pi).sum(-1)
    else:
        p2 = sum_p2_tail.to(dt)
        if support == "topk":
            p2 = p2 + torch.where(in_topk, torch.zeros_like(logp), torch.exp(2 * logp))
    tail_p2 = torch.minimum(p2.clamp(min=0.0), pi_tail * pi_tail)
    return Support(pi, mu, logpi, logmu, valid, k_col, k_in, logp, log_pi_tail, pi_tail, mu_tail,
                   mu_tail_clamped, n_tail, tail_p2)


def topk_kl(s: Support) -> torch.Tensor:
    """Top-K KL ``sum_S mu_i log(mu_i/pi_i) + mu_T log(mu_T/pi_T)``, a lower bound of the full KL
    (a coarsening). Naive torch with full mu: bucket both tails, then ``kl_div``."""
    body = _xlog_ratio(s.mu, s.logmu, s.logpi).sum(-1)
    tail = _xlog_ratio(s.mu_tail, torch.log(s.mu_tail), s.logpi_tail)
    return (body + tail).clamp(min=0.0)


def topk_kl_grad(s: Support) -> tuple[torch.Tensor, torch.Tensor]:
    """``pi g`` of the top-K KL: ``g_i = -mu_i / pi_i``, so ``pi_i g_i = -mu_i`` (finite at pi = 0)."""
    return -s.mu, -s.mu_tail


def topk_tv(s: Support) -> torch.Tensor:
    """Top-K TV ``1/2 (sum_S |mu_i - pi_i| + |mu_T - pi_T|)``."""
    return 0.5 * ((s.mu - s.pi).abs().sum(-1) + (s.mu_tail - s.pi_tail).abs())


def topk_tv_grad(s: Support) -> tuple[torch.Tensor, torch.Tensor]:
    """``pi g`` of the top-K TV: ``g_i = 1/2 sign(pi_i - mu_i)`` (a subgradient at ties)."""
    return 0.5 * s.pi * torch.sign(s.pi - s.mu), 0.5 * s.pi_tail * torch.sign(s.pi_tail - s.mu_tail)


def _log_mid(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """``log((p + q) / 2)`` from log-probs (-inf where both are 0)."""
    return torch.logaddexp(logp, logq) - math.log(2.0)


def topk_js(s: Support) -> torch.Tensor:
    """Top-K Jensen-Shannon ``1/2 KL(mu || m) + 1/2 KL(pi || m)``, ``m = (mu + pi) / 2``, on the
    support's buckets and the tail bucket; at most log 2. Naive torch: bucket both tails, then
    ``0.5 * (kl(mu, m) + kl(pi, m))``."""
    logm, logm_t = _log_mid(s.logmu, s.logpi), _log_mid(torch.log(s.mu_tail), s.logpi_tail)
    body = (_xlog_ratio(s.mu, s.logmu, logm) + _xlog_ratio(s.pi, s.logpi, logm)).sum(-1)
    tail = _xlog_ratio(s.mu_tail, torch.log(s.mu_tail), logm_t) + _xlog_ratio(s.pi_tail, s.logpi_tail, logm_t)
    return (0.5 * (body + tail)).clamp(min=0.0)


def topk_js_grad(s: Support) -> tuple[torch.Tensor, torch.Tensor]:
    """``pi g`` of the top-K JS: ``g_i = 1/2 log(pi_i / m_i)`` (the mu terms' derivatives cancel)."""
    logm, logm_t = _log_mid(s.logmu, s.logpi), _log_mid(torch.log(s.mu_tail), s.logpi_tail)
    return 0.5 * _xlog_ratio(s.pi, s.logpi, logm), 0.5 * _xlog_ratio(s.pi_tail, s.logpi_tail, logm_t)


# =========================================================================== directions
def tail_p2(s: Support, estimator: str) -> torch.Tensor:
    """The estimator's value for ``sum_{i not in S'} pi_i^2`` (see the module table)."""
    if estimator == "exact":
        return s.tail_p2
    if estimator == "aggregated":
        return s.pi_tail * s.pi_tail
    if estimator == "uniform":
        n = s.n_tail.to(s.pi_tail.dtype)
        return torch.where(n > 0, s.pi_tail * s.pi_tail / n.clamp(min=1), torch.zeros_like(n))
    if estimator == "truncated":
        return torch.zeros_like(s.pi_tail)
    check_choice("estimator", estimator, ESTIMATORS)  # raises: the four are above


def _tail_mean_pi(s: Support, p2: torch.Tensor) -> torch.Tensor:
    """``q = P2 / pi_T`` in [0, pi_T] (a clamped ratio: an empty tail gives 0, not 0/0)."""
    tiny = torch.finfo(p2.dtype).tiny
    q = p2 / s.pi_tail.clamp(min=tiny)
    return torch.minimum(q, s.pi_tail)


# ----------------------------------------------------------------------- ratio
def log_ratio(logp: torch.Tensor, sampled_logprob: torch.Tensor) -> torch.Tensor:
    """``log r = log pi_k - log mu_k``: the ratio direction's signed value (sign of ``r - 1``)."""
    return logp - sampled_logprob


# ---------------------------------------------------------------------- binary
def _dpik(logp: torch.Tensor, sum_p2: torch.Tensor) -> torch.Tensor:
    """``d pi_k`` along ``e_k - pi``: ``pi_k (1 - 2 pi_k + sum pi^2)``, the factor floored at the
    smallest normal so that its sign (> 0 unless one-hot) survives rounding."""
    pk = logp.exp()
    c = (1 - 2 * pk + sum_p2).clamp(min=torch.finfo(pk.dtype).tiny)
    return pk, c


def ddot_binary_tv(logp, sampled_logprob, sum_p2) -> torch.Tensor:
    """``sign(pi_k - mu_k) * pi_k (1 - 2 pi_k + sum pi^2)``; its sign is the ratio direction."""
    pk, c = _dpik(logp, sum_p2)
    return torch.sign(logp - sampled_logprob) * pk * c


def ddot_binary_kl(logp, sampled_logprob, sum_p2) -> torch.Tensor:
    """``(pi_k - mu_k) / (pi_k (1 - pi_k)) * d pi_k``; sign equals the ratio direction."""
    pk, c = _dpik(logp, sum_p2)
    one_minus = (-torch.expm1(logp)).clamp(min=torch.finfo(pk.dtype).tiny)
    mag = (pk - sampled_logprob.exp()).abs() * c / one_minus
    return torch.sign(logp - sampled_logprob) * mag


# ----------------------------------------------------------------------- top-K
def _tail_share(s: Support) -> torch.Tensor:
    """``pi_k / pi_T`` of a sampled token in the tail bucket (support ``"topk"``; ``pi_k <= pi_T``):
    a ratio of logs, accurate at any tail size; 0 where pi_T = 0."""
    share = torch.exp(s.logpi_k - s.logpi_tail).clamp(max=1.0)
    return torch.where(s.logpi_tail > float("-inf"), share, torch.zeros_like(share))


def ddot_topk(s: Support, divergence: "TopKDivergence | str", estimator: str) -> torch.Tensor:
    """``Ddot`` of a registered top-K divergence from its gradient (:attr:`TopKDivergence.grad`:
    ``h = pi g`` on the support's columns, ``h_T = pi_T g_T`` on the tail) with the estimator's
    ``P2`` (module docstring), the one formula of every top-K divergence::

        gbar = sum_S h_i + h_T
        Ddot = pi_k (g_k - gbar) - sum_S pi_i^2 (g_i - gbar) - P2 (g_T - gbar)
             = h_k - pi_k gbar - sum_S pi_i h_i + gbar (sum_S pi_i^2 + P2) - (P2 / pi_T) h_T

    (``h_k`` the sampled token's column, or ``(pi_k / pi_T) h_T`` when it lies in the tail).
    Naive torch (exact): ``autograd.grad(D, z) @ (e_k - pi)`` of the bucketed divergence of the logits."""
    div = TOPK_DIVERGENCES[divergence] if isinstance(divergence, str) else divergence
    h, h_t = div.grad(s)
    h = torch.where(s.valid, h, torch.zeros_like(h))
    gbar = h.sum(-1) + h_t
    h_k = torch.where(s.k_in, h.gather(1, s.k_col[:, None]).squeeze(1), _tail_share(s) * h_t)
    p2 = tail_p2(s, estimator)
    sum_pi2 = (s.pi * s.pi).sum(-1)
    return h_k - s.pi_k * gbar - (s.pi * h).sum(-1) + gbar * (sum_pi2 + p2) - _tail_mean_pi(s, p2) * h_t


# ------------------------------------------------------------- full vocabulary
def ddot_full_kl(logp, full_mu_k, sum_p_mu, sum_p2) -> torch.Tensor:
    """``(pi_k - mu_k) + sum_i pi_i mu_i - sum_i pi_i^2``: the local (ratio) term plus the
    global term from the softmax normalisation that the sampled ratio cannot see."""
    return (logp.exp() - full_mu_k) + sum_p_mu - sum_p2


def ddot_full_tv(logp, full_mu_k, sum_p_s, sum_p2_s, sum_p2) -> torch.Tensor:
    """``pi_k (s_k - sbar) - sum_i pi_i^2 (s_i - sbar)`` with ``s = 1/2 sign(pi - mu)``,
    ``sbar = sum_i pi_i s_i`` (the reductions are made by :mod:`pdmask.ops`)."""
    pk = logp.exp()
    s_k = 0.5 * torch.sign(pk - full_mu_k)
    return pk * (s_k - sum_p_s) - (sum_p2_s - sum_p_s * sum_p2)


# =========================================================================== the registry
@dataclass(frozen=True)
class TopKDivergence:
    """A divergence on the top-K support with one tail bucket (METHOD.md section 3), by
    name (``topk_<...>``, its stat key). ``value(s) -> (N,)`` of a :class:`Support`;
    ``grad(s) -> (h, h_T)``: its gradient g = dD/dpi as ``h = pi g`` on the support's (N, K+1)
    columns and ``h_T = pi_T g_T`` on the tail bucket (``pi g``, the gradient along log pi,
    stays finite where pi -> 0: KL's is ``-mu``), from which :func:`ddot_topk` makes every
    ``Ddot``; ``default_delta`` the region threshold when the caller gives none; ``doc``."""

    name: str
    value: Callable[[Support], torch.Tensor]
    grad: Callable[[Support], tuple[torch.Tensor, torch.Tensor]] | None
    default_delta: float
    doc: str = ""


def register_divergence(div: TopKDivergence, *, overwrite: bool = False) -> TopKDivergence:
    """Add a top-K divergence: its statistics, its four ``Ddot`` (one per estimator) and its
    modes' default delta follow from the registration. Checked first (:func:`check_divergence`)."""
    check_divergence(div)
    if div.name in TOPK_DIVERGENCES and not overwrite:
        raise SpecError("divergence", f"{div.name!r} is already registered (pass overwrite=True to replace it)")
    add_topk_divergence(div.name, div)
    return div


def check_divergence(div: TopKDivergence) -> None:
    """A registration that would be silently wrong is refused: a name outside ``topk_*``, a
    value or gradient that is not callable, a default delta that is not a positive number, and
    a gradient that is not the derivative of the value (on a small float64 probe, both supports,
    the sampled token inside and outside the top-K: :func:`ddot_topk` against autograd)."""
    if not isinstance(div, TopKDivergence):
        raise SpecError("divergence", f"expected a pdmask.divergences.TopKDivergence, got {type(div).__name__}")
    if not (isinstance(div.name, str) and div.name.startswith("topk_") and div.name.isidentifier()):
        raise SpecError("divergence", f"a top-K divergence's name is its stat key, topk_<name>; got {div.name!r}")
    for part in ("value", "grad"):
        if not callable(getattr(div, part)):
            raise SpecError(part, f"divergence {div.name!r} needs a callable {part}(support) (its "
                                  f"{'derivative g = dD/dpi, as pi g' if part == 'grad' else 'per-token value'})")
    check_positive("default_delta", div.default_delta)
    if div.default_delta is None:
        raise SpecError("default_delta", f"divergence {div.name!r} needs its default delta")
    err = _derivative_error(div)
    if not err < 1e-6:
        raise SpecError("grad", f"divergence {div.name!r}: Ddot from grad differs from the derivative of value "
                                f"by {err:.3g} (relative) on the registration probe; grad must be pi * dD/dpi")


def _derivative_error(div: TopKDivergence) -> float:
    """Largest relative difference between :func:`ddot_topk` (exact) and autograd's ``Ddot`` of
    ``div.value`` on a fixed float64 probe (6 rows, V = 9, K = 3, both supports)."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(6, 9, generator=g, dtype=torch.float64).requires_grad_(True)
    logmu = torch.log_softmax(z.detach() + torch.randn(6, 9, generator=g, dtype=torch.float64), -1)
    top = logmu.topk(3, dim=-1)
    outside = (~torch.zeros(6, 9, dtype=torch.bool).scatter(1, top.indices, True)).to(torch.int64).argmax(-1)
    k = torch.where(torch.arange(6) % 2 == 0, top.indices[:, 1], outside)  # inside, outside, inside, ...
    worst = 0.0
    for support in SUPPORTS:
        logpi = torch.log_softmax(z, -1)
        lp_k = logpi.gather(1, k[:, None]).squeeze(1)
        s = build_support(k, lp_k, logmu.gather(1, k[:, None]).squeeze(1), top.indices, logpi.gather(1, top.indices),
                          top.values, logpi.exp().square().sum(-1), 9, support=support)
        (dz,) = torch.autograd.grad(div.value(s).sum(), z)
        pi = logpi.detach().exp()
        want = dz.gather(1, k[:, None]).squeeze(1) - (pi * dz).sum(-1)
        got = ddot_topk(_detached(s), div, "exact")
        worst = max(worst, float(((got - want).abs() / want.abs().clamp(min=1e-12)).max()))
    return worst


def _detached(s: Support) -> Support:
    return Support(*(getattr(s, f).detach() for f in Support.__dataclass_fields__))


def default_delta(divergence: str) -> float:
    """The default region threshold delta of a divergence (a registered top-K one's, or
    :data:`FIXED_DELTAS`'s)."""
    if divergence in TOPK_DIVERGENCES:
        return TOPK_DIVERGENCES[divergence].default_delta
    check_choice("divergence", divergence, [*TOPK_DIVERGENCES, *FIXED_DELTAS])
    return FIXED_DELTAS[divergence]


for _d in (TopKDivergence("topk_kl", topk_kl, topk_kl_grad, KL_DELTA, "KL(mu || pi) on the support, a lower bound "
                          "of the full KL"),
           TopKDivergence("topk_tv", topk_tv, topk_tv_grad, TV_DELTA, "total variation on the support"),
           TopKDivergence("topk_js", topk_js, topk_js_grad, KL_DELTA / 4, "Jensen-Shannon on the support, at most "
                          "log 2; about KL/4 near mu, hence delta = KL's / 4")):
    register_divergence(_d)
