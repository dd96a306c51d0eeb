"""Per-token divergences D(mu || pi) and their derivatives ``Ddot`` along a token's step
(METHOD.md sections 3 and 4), on the (N,) / (N, K) reductions of :func:`pdmask.ops.row_stats`.

``0 log 0 = 0``; log pi is floored at ``log(tiny)``, so a zero-probability token gives a large
finite divergence. The step on token t moves its logits along ``A w (e_k - pi)``, changing D
by ``A w Ddot``, ``Ddot = pi_k (g_k - gbar) - sum_i pi_i^2 (g_i - gbar)`` (``g = dD/dpi``,
``gbar = sum pi g``); outward iff ``A Ddot > 0``. The top-K tail enters only through
``P2 = sum_{tail} pi_i^2``, which the estimators take as the tail's own sum (``exact``),
``pi_T^2`` (``aggregated``), ``pi_T^2 / (V - |S'|)`` (``uniform``) or 0 (``truncated``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._validate import check_choice
from .keys import ESTIMATORS, SUPPORTS


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


def topk_tv(s: Support) -> torch.Tensor:
    """Top-K TV ``1/2 (sum_S |mu_i - pi_i| + |mu_T - pi_T|)``."""
    return 0.5 * ((s.mu - s.pi).abs().sum(-1) + (s.mu_tail - s.pi_tail).abs())


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
def _mu_k_seen(s: Support) -> torch.Tensor:
    """What the top-K divergence takes mu_k to be: its entry on the support, or, for a
    sampled token in the tail bucket (support ``"topk"``), the tail's share
    ``mu_T pi_k / pi_T`` (``pi_k <= pi_T``: a ratio of logs, accurate at any tail size)."""
    share = torch.exp(s.logpi_k - s.logpi_tail).clamp(max=1.0)
    share = torch.where(s.logpi_tail > float("-inf"), share, torch.zeros_like(share))  # pi_T = 0: pi_k = 0
    return torch.where(s.k_in, s.mu_k, s.mu_tail * share)


def ddot_topk_kl(s: Support, estimator: str) -> torch.Tensor:
    """``Ddot`` of the top-K KL: ``(pi_k - mu_k) + sum_S pi_i (mu_i - pi_i) + mu_T q - P2``.
    Naive torch (exact): ``autograd.grad(D, z) @ (e_k - pi)`` of the bucketed KL of the logits."""
    local = s.pi_k - _mu_k_seen(s)
    body = (s.pi * (s.mu - s.pi)).sum(-1)
    p2 = tail_p2(s, estimator)
    tail = s.mu_tail * _tail_mean_pi(s, p2) - p2
    return local + body + tail


def ddot_topk_tv(s: Support, estimator: str) -> torch.Tensor:
    """``Ddot`` of the top-K TV, ``s_i = 1/2 sign(pi_i - mu_i)`` on S' and ``s_T`` on the tail
    (also ``s_k`` of a sampled token in the tail bucket; a subgradient at ties)::

        gbar = sum_{S'} pi_i s_i + pi_T s_T
        Ddot = pi_k (s_k - gbar) - sum_{S'} pi_i^2 (s_i - gbar) - P2 (s_T - gbar)
    """
    sg = 0.5 * torch.sign(s.pi - s.mu) * s.valid
    s_t = 0.5 * torch.sign(s.pi_tail - s.mu_tail)
    gbar = (s.pi * sg).sum(-1) + s.pi_tail * s_t
    s_k = torch.where(s.k_in, sg.gather(1, s.k_col[:, None]).squeeze(1), s_t)  # k in the tail: s_T
    p2 = tail_p2(s, estimator)
    return s.pi_k * (s_k - gbar) - (s.pi * s.pi * (sg - gbar[:, None])).sum(-1) - p2 * (s_t - gbar)


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
