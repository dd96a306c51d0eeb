"""Direction criteria: would this token's policy-gradient step push pi away from mu?

The step on token t moves the (temperature-scaled) logits of its position along
``u = A w (e_k - pi)`` with ``w > 0``. The first-order change of a divergence D is
``A w Ddot`` with ``Ddot = grad_z D . (e_k - pi)`` (METHOD.md section 4). A token is
*outward* iff ``A * Ddot > 0`` (predictive) or ``A * (r - 1) > 0`` (ratio, PPO/DPPO).

General closed form for softmax policies, with ``g = dD/dpi`` and ``gbar = sum pi g``::

    Ddot = pi_k (g_k - gbar) - sum_i pi_i^2 (g_i - gbar)

Top-K estimators. On the support S' the trainer knows pi and mu; in the tail it knows
pi exactly but only the total ``mu_T`` of mu. Both exact top-K derivatives treat the
tail of mu as proportional to pi (that is what bucketing the tail into one term
means), so the tail enters only through ``P2 = sum_{i not in S'} pi_i^2``. The four
estimators differ in the value they use for P2:

=============  =====================  ===============================================
estimator      P2                     meaning
=============  =====================  ===============================================
exact          sum_{tail} pi_i^2      exact derivative of the top-K divergence
aggregated     pi_T^2                 tail treated as one token (the paper)
uniform        pi_T^2 / (V - |S'|)    tail spread evenly over its tokens (the paper)
truncated      0                      tail's global contribution ignored (baseline)
=============  =====================  ===============================================

For KL this gives the tail contribution ``mu_T q - P2`` with ``q = P2 / pi_T`` to the
global term ``sum_i pi_i (mu_i - pi_i)``, which is METHOD.md's table.

With the support ``"topk"`` (:data:`pdmask.keys.SUPPORTS`) a sampled token outside the
top-K lies in the tail bucket. Its ``g_k = dD/dpi_k`` is then the tail's (KL:
``-mu_T / pi_T``, TV: ``s_T``), so the local term reads ``pi_k - pi_k mu_T / pi_T`` (mu_k
estimated as the tail's share ``mu_T pi_k / pi_T``) and ``P2`` includes ``pi_k^2``; nothing
else changes (METHOD.md section 4).
"""

from __future__ import annotations

from typing import Callable

import torch

from .divergences import Support
from .keys import ESTIMATORS


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
    raise ValueError(f"estimator: unknown value {estimator!r}; valid values are: {', '.join(ESTIMATORS)}")


def _tail_mean_pi(s: Support, p2: torch.Tensor) -> torch.Tensor:
    """``q = P2 / pi_T``: the pi-weighted mean of pi over the tail, in [0, pi_T].

    Written as a clamped ratio so that an empty or rounded-away tail (pi_T ~ 0) gives
    q ~ 0 instead of 0/0.
    """
    tiny = torch.finfo(p2.dtype).tiny
    q = p2 / s.pi_tail.clamp(min=tiny)
    return torch.minimum(q, s.pi_tail)


# ----------------------------------------------------------------------- ratio
def log_ratio(logp: torch.Tensor, sampled_logprob: torch.Tensor) -> torch.Tensor:
    """``log r = log pi_k - log mu_k``: the ratio direction's signed value (sign of ``r - 1``)."""
    return logp - sampled_logprob


# ---------------------------------------------------------------------- binary
def _dpik(logp: torch.Tensor, sum_p2: torch.Tensor) -> torch.Tensor:
    """``d pi_k`` along ``e_k - pi``: ``pi_k (1 - 2 pi_k + sum pi^2)`` (> 0 unless one-hot).

    ``1 - 2 pi_k + sum pi^2 = (1 - pi_k)^2 + sum_{i != k} pi_i^2`` is floored at the
    smallest normal so that the sign (the whole point) survives rounding.
    """
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
    """``Ddot`` of the top-K KL: ``(pi_k - mu_k) + sum_S pi_i (mu_i - pi_i) + mu_T q - P2``
    (``mu_k``: :func:`_mu_k_seen`).

    Naive torch (exact estimator): build the bucketed top-K KL as a function of the
    full logits and take ``autograd.grad(D, z) @ (e_k - pi)``; see :func:`ddot_autograd`.
    """
    local = s.pi_k - _mu_k_seen(s)
    body = (s.pi * (s.mu - s.pi)).sum(-1)
    p2 = tail_p2(s, estimator)
    tail = s.mu_tail * _tail_mean_pi(s, p2) - p2
    return local + body + tail


def ddot_topk_tv(s: Support, estimator: str) -> torch.Tensor:
    """``Ddot`` of the top-K TV with ``s_i = 1/2 sign(pi_i - mu_i)`` on S' and ``s_T`` on the tail::

        gbar = sum_{S'} pi_i s_i + pi_T s_T
        Ddot = pi_k (s_k - gbar) - sum_{S'} pi_i^2 (s_i - gbar) - P2 (s_T - gbar)

    (``s_k = s_T`` for a sampled token in the tail bucket, support ``"topk"``.)

    With the exact P2 this equals METHOD.md's
    ``sum_{S'} s_i pi_i (u_i - ubar) + s_T (-sum_tail pi_i^2 - pi_T ubar)``. A
    subgradient at ties (sign 0).
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


# ---------------------------------------------------------------- autograd oracle
def ddot_autograd(
    divergence: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    logits: torch.Tensor,
    sampled_ids: torch.Tensor,
    mu: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
) -> torch.Tensor:
    """``Ddot`` of any divergence through autograd: ``grad_z D(mu, softmax(z)) . (e_k - pi)``.

    ``divergence(mu, pi)`` maps (N, V) probabilities (``mu`` may be None if the
    function closes over what it needs) to (N,) values. ``z = logits / temperature``
    and the derivative is taken with respect to ``z`` (a positive rescaling of the
    logit step, which does not change any sign). Slow and memory-hungry by design: the
    research path and the test oracle, not for training.
    """
    z = (logits.detach().to(torch.float64 if logits.dtype == torch.float64 else torch.float32) / temperature)
    z = z.reshape(-1, z.shape[-1]).requires_grad_(True)
    pi = torch.softmax(z, -1)
    m = None if mu is None else mu.reshape(-1, mu.shape[-1]).to(z.dtype)
    d = divergence(m, pi)
    (g,) = torch.autograd.grad(d.sum(), z)
    u = -pi.detach()
    u.scatter_add_(1, sampled_ids.reshape(-1, 1).long(), torch.ones_like(u[:, :1]))
    return (g * u).sum(-1).reshape(sampled_ids.shape)
