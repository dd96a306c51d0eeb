"""Per-token divergences between the rollout policy mu and the trained policy pi.

All functions take (N,) / (N, K) tensors that :func:`pdmask.ops.row_stats` reduced from
the logits (called by :mod:`pdmask.stats`); none of them touches the vocabulary
dimension. METHOD.md section 3.

Conventions: every divergence is measured from the behaviour policy, D(mu || pi).
``0 log 0 = 0``; log pi is floored at ``log(tiny)`` of the compute dtype so a token the
trainer gives zero probability yields a large finite divergence, never inf/NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .keys import SUPPORTS


def log_floor(dtype: torch.dtype) -> float:
    """The log floor of a dtype: log(smallest normal) (-87.3 in fp32). The one definition."""
    return math.log(torch.finfo(dtype).tiny)


def floor_log(x: torch.Tensor) -> torch.Tensor:
    """Floor a log-probability at :func:`log_floor` of its dtype.

    The one floor of the divergences' logs: those here and the full-vocabulary KL of
    :mod:`pdmask.ops`.
    """
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
    """Binary KL ``mu_k log(mu_k/pi_k) + (1-mu_k) log((1-mu_k)/(1-pi_k))``.

    The Bernoulli KL of "sampled token vs everything else". Computed from log-probs with
    ``log1mexp`` so that pi_k -> 1 or mu_k -> 1 stays finite.
    """
    mu = sampled_logprob.exp()
    a = mu * (sampled_logprob - floor_log(logp))
    b = _xlog_ratio(-torch.expm1(sampled_logprob), log1mexp(sampled_logprob), log1mexp(logp))
    return (a + b).clamp(min=0.0)


# --------------------------------------------------------------------------- top-K
@dataclass
class Support:
    """The support ``S`` of the top-K divergences, plus one tail bucket.

    Columns 0..K-1 are the rollout top-K ids; column K is the sampled token when it is
    outside the top-K and the support adds it (``"topk+sampled"``), else an empty column
    (weight 0). With ``"topk"`` a sampled token outside the top-K lies in the tail.
    """

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


def build_support(
    sampled_ids: torch.Tensor,  # (N,)
    logp: torch.Tensor,  # (N,) log pi_k
    sampled_logprob: torch.Tensor,  # (N,) log mu_k
    topk_ids: torch.Tensor,  # (N, K)
    topk_logp: torch.Tensor,  # (N, K) log pi at the top-K ids
    topk_logprobs: torch.Tensor,  # (N, K) log mu at the top-K ids
    sum_p2: torch.Tensor,  # (N,) sum_i pi_i^2 over the whole vocabulary
    vocab_size: int,
    *,
    log_pi_tail: torch.Tensor | None = None,  # (N,) log pi outside topK ∪ {k}
    sum_p2_tail: torch.Tensor | None = None,  # (N,) sum pi^2 outside topK ∪ {k}
    support: str = "topk+sampled",
) -> Support:
    """Assemble the view of the support ``S`` (:data:`SUPPORTS`). When k is in the top-K its
    mu value is the top-K entry.

    ``log_pi_tail`` / ``sum_p2_tail``: pi's log-mass and sum of squares outside
    ``topK ∪ {k}``, reduced over the tail itself by :func:`pdmask.ops.row_stats` (keys
    ``lse_tail - lse``, ``sum_p2_tail``). Without them the tail is ``1 - sum_S pi`` and
    ``sum_p2 - sum_S pi^2``, which cancel catastrophically (pi_T rounds to 0 in float32
    below ~6e-8 of the mass): a fallback for callers with float64 or moderate tails only.
    With ``support="topk"`` a sampled token outside the top-K joins the tail:
    ``log pi_T = logaddexp(log_pi_tail, log pi_k)``, its ``pi_k^2`` joins ``sum_p2_tail``.
    """
    if support not in SUPPORTS:
        raise ValueError(f"support: unknown value {support!r}; valid values are: {', '.join(SUPPORTS)}")
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
    """Top-K KL ``sum_S mu_i log(mu_i/pi_i) + mu_T log(mu_T/pi_T)``.

    A lower bound of the full KL (data processing: S plus one bucket is a coarsening).
    ``log pi_T`` is the support's accurate ``logpi_tail``, never ``log(1 - sum_S pi)``.
    Naive torch with full mu: bucket the tail of both distributions, then ``kl_div``.
    """
    body = _xlog_ratio(s.mu, s.logmu, s.logpi).sum(-1)
    tail = _xlog_ratio(s.mu_tail, torch.log(s.mu_tail), s.logpi_tail)
    return (body + tail).clamp(min=0.0)


def topk_tv(s: Support) -> torch.Tensor:
    """Top-K TV ``1/2 (sum_S |mu_i - pi_i| + |mu_T - pi_T|)``."""
    return 0.5 * ((s.mu - s.pi).abs().sum(-1) + (s.mu_tail - s.pi_tail).abs())
