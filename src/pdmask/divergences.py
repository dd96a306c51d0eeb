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
    """The support ``S' = topK ∪ {k}`` of the top-K divergences, plus one tail bucket.

    Columns 0..K-1 are the rollout top-K ids; column K is the sampled token when it is
    outside the top-K (``extra``), else an empty column (weight 0).
    """

    pi: torch.Tensor  # (N, K+1) trainer probabilities on S' (0 on the empty column)
    mu: torch.Tensor  # (N, K+1) rollout probabilities on S' (0 on the empty column)
    logpi: torch.Tensor  # (N, K+1)
    logmu: torch.Tensor  # (N, K+1)
    valid: torch.Tensor  # (N, K+1) bool: column belongs to S'
    k_col: torch.Tensor  # (N,) column index of the sampled token
    pi_tail: torch.Tensor  # (N,) 1 - sum_{S'} pi, clamped to [0, 1]
    mu_tail: torch.Tensor  # (N,) 1 - sum_{S'} mu, clamped to [0, 1]
    mu_tail_clamped: torch.Tensor  # (N,) bool: sum_{S'} mu exceeded 1 by rounding
    n_tail: torch.Tensor  # (N,) number of vocabulary ids outside S' (V - |S'|)
    tail_p2: torch.Tensor  # (N,) sum_{i not in S'} pi_i^2, clamped to [0, pi_tail^2]

    @property
    def pi_k(self) -> torch.Tensor:
        return self.pi.gather(1, self.k_col[:, None]).squeeze(1)

    @property
    def mu_k(self) -> torch.Tensor:
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
) -> Support:
    """Assemble the S' view. When k is in the top-K its mu value is the top-K entry."""
    dt = logp.dtype
    N, K = topk_ids.shape
    hit = topk_ids == sampled_ids[:, None]  # (N, K)
    in_topk = hit.any(-1)  # (N,)
    extra = ~in_topk
    neg_inf = torch.full_like(logp, float("-inf"))
    logpi = torch.cat([topk_logp.to(dt), torch.where(extra, logp, neg_inf)[:, None]], 1)
    logmu = torch.cat([topk_logprobs.to(dt), torch.where(extra, sampled_logprob.to(dt), neg_inf)[:, None]], 1)
    valid = torch.cat([torch.ones_like(hit), extra[:, None]], 1)
    pi = logpi.exp()
    mu = logmu.exp()
    k_col = torch.where(in_topk, hit.to(torch.int64).argmax(-1), torch.full_like(sampled_ids, K))
    pi_tail = (1 - pi.sum(-1)).clamp(0.0, 1.0)
    mu_sum = mu.sum(-1)
    mu_tail_clamped = mu_sum > 1
    mu_tail = (1 - mu_sum).clamp(0.0, 1.0)
    n_tail = vocab_size - valid.sum(-1)
    tail_p2 = torch.minimum((sum_p2 - (pi * pi).sum(-1)).clamp(min=0.0), pi_tail * pi_tail)
    return Support(pi, mu, logpi, logmu, valid, k_col, pi_tail, mu_tail, mu_tail_clamped, n_tail, tail_p2)


def topk_kl(s: Support) -> torch.Tensor:
    """Top-K KL ``sum_{S'} mu_i log(mu_i/pi_i) + mu_T log(mu_T/pi_T)``.

    A lower bound of the full KL (data processing: S' plus one bucket is a coarsening).
    Naive torch with full mu: bucket the tail of both distributions, then ``kl_div``.
    """
    body = _xlog_ratio(s.mu, s.logmu, s.logpi).sum(-1)
    tail = _xlog_ratio(s.mu_tail, torch.log(s.mu_tail), torch.log(s.pi_tail))
    return (body + tail).clamp(min=0.0)


def topk_tv(s: Support) -> torch.Tensor:
    """Top-K TV ``1/2 (sum_{S'} |mu_i - pi_i| + |mu_T - pi_T|)``."""
    return 0.5 * ((s.mu - s.pi).abs().sum(-1) + (s.mu_tail - s.pi_tail).abs())
