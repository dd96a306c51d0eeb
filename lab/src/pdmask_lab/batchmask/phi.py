"""``Phi = sum_{s in O} D_s``: the out-of-region divergence of a batch, differentiable in the logits.

The value comes from the core's statistics (:func:`pdmask.token_stats`), so it is the
very number the proximity test compared with delta. The gradient with respect to the
logits is written in closed form and computed chunk by chunk in the backward (like
:class:`pdmask.stats.SampledLogprob`), so autograd never holds a float32 copy of the
(N, V) logits. With ``pi = softmax(z / T)``, ``S' = topK ∪ {k}``, the tail bucket
``pi_T = sum_{i not in S'} pi_i`` (``mu_T`` likewise) and ``g = dD/dpi``,
``gbar = sum_i pi_i g_i``::

    dD/dz_i = pi_i (g_i - gbar) / T

- top-K KL: ``g_i = -mu_i / pi_i`` on S', ``-mu_T / pi_T`` in the tail, ``gbar = -M`` with
  ``M = sum_{S'} mu + mu_T`` (1 unless the engine's mass on S' rounded above 1), so
  ``T dD/dz_i = M pi_i - mu_i`` on S' and ``pi_i (M - mu_T / pi_T)`` in the tail.
- top-K TV: ``g_i = s_i = 1/2 sign(pi_i - mu_i)`` on S', ``s_T = 1/2 sign(pi_T - mu_T)``
  in the tail (a subgradient at ties, as autograd's ``abs``).

Naive torch equivalent (what the tests compare with)::

    logq = torch.log_softmax(logits / T, -1)                 # (N, V), with autograd
    sup = build_support(k, logq[k], log_mu_k, topk_ids, logq[topk_ids], ...)
    Phi = (topk_kl(sup) * in_region).sum(); Phi.backward()
"""

from __future__ import annotations

import torch

from pdmask._validate import check_choice
from pdmask.divergences import build_support
from pdmask.ops import compute_dtype

#: Divergences the batch-aware mask is defined for (the ones its modes use).
PHI_DIVERGENCES = ("topk_kl", "topk_tv")


def divergence_grad_rows(
    logits: torch.Tensor,  # (c, V) raw logits of some rows
    sampled_ids: torch.Tensor,  # (c,)
    sampled_logprob: torch.Tensor,  # (c,)
    topk_ids: torch.Tensor,  # (c, K)
    topk_logprobs: torch.Tensor,  # (c, K)
    *,
    divergence: str,
    temperature: float,
) -> torch.Tensor:
    """``dD_t / dz_t`` (c, V) of each row's top-K divergence, in the compute dtype (see module doc)."""
    check_choice("divergence", divergence, PHI_DIVERGENCES)
    V = logits.shape[-1]
    logq = torch.log_softmax(logits.to(compute_dtype(logits.dtype)) / temperature, -1)  # (c, V)
    p = logq.exp()
    logp = logq.gather(1, sampled_ids[:, None]).squeeze(1)
    # sum_p2 only feeds the Ddot estimators (tail_p2), never D: a placeholder is enough
    sup = build_support(sampled_ids, logp, sampled_logprob.to(logq.dtype), topk_ids, logq.gather(1, topk_ids),
                        topk_logprobs.to(logq.dtype), torch.zeros_like(logp), V)
    cols = torch.cat([topk_ids, sampled_ids[:, None]], 1)  # (c, K+1) ids of S' (last column: k if extra)
    in_support = torch.zeros_like(p, dtype=torch.bool).scatter_(1, cols, True)  # k is always in S'
    # the tail mass summed directly (1 - sum_{S'} pi would cancel catastrophically when small)
    pi_tail = torch.where(in_support, torch.zeros_like(p), p).sum(-1)  # (c,)
    tiny = torch.finfo(p.dtype).tiny
    share = (p / pi_tail.clamp(min=tiny)[:, None]).clamp(max=1.0)  # pi_i / pi_T in [0, 1]
    if divergence == "topk_kl":
        M = sup.mu.sum(-1) + sup.mu_tail  # (c,)
        grad = p * M[:, None] - sup.mu_tail[:, None] * share  # tail rows of the formula
        on_support = sup.pi * M[:, None] - sup.mu  # (c, K+1)
    else:  # topk_tv
        s = 0.5 * torch.sign(sup.pi - sup.mu) * sup.valid
        s_tail = 0.5 * torch.sign(sup.pi_tail - sup.mu_tail)  # the sign the forward's |.| used
        gbar = (sup.pi * s).sum(-1) + pi_tail * s_tail
        grad = p * (s_tail - gbar)[:, None]
        on_support = sup.pi * (s - gbar[:, None])
    # the empty extra column (k already in the top-K) repeats k's own value, so the
    # duplicate index writes the same number and the scatter stays deterministic
    dup = on_support.gather(1, sup.k_col[:, None]).squeeze(1)
    on_support[:, -1] = torch.where(sup.valid[:, -1], on_support[:, -1], dup)
    return grad.scatter_(1, cols, on_support).div_(temperature)


class OutOfRegionDivergence(torch.autograd.Function):
    """``Phi = sum_t weight_t D_t`` whose value is given (the core's D) and whose gradient
    in the (N, V) logits is :func:`divergence_grad_rows`, chunked."""

    @staticmethod
    def forward(ctx, logits, value, weight, sampled_ids, sampled_logprob, topk_ids, topk_logprobs,
                divergence, temperature, chunk_rows):
        ctx.save_for_backward(logits, weight, sampled_ids, sampled_logprob, topk_ids, topk_logprobs)
        ctx.divergence, ctx.temperature, ctx.chunk_rows = divergence, temperature, chunk_rows
        return value.detach().clone()

    @staticmethod
    def backward(ctx, g):
        logits, weight, ids, lp, tk, tlp = ctx.saved_tensors
        grad = torch.zeros_like(logits)
        for s in range(0, logits.shape[0], ctx.chunk_rows):
            e = min(s + ctx.chunk_rows, logits.shape[0])
            rows = divergence_grad_rows(logits[s:e], ids[s:e], lp[s:e], tk[s:e], tlp[s:e],
                                        divergence=ctx.divergence, temperature=ctx.temperature)
            grad[s:e] = (rows * (g * weight[s:e]).to(rows.dtype)[:, None]).to(grad.dtype)
        return grad, None, None, None, None, None, None, None, None, None


def out_of_region_divergence(logits, value, weight, sampled_ids, sampled_logprob, topk_ids, topk_logprobs, *,
                             divergence: str, temperature: float, chunk_rows: int) -> torch.Tensor:
    """Differentiable ``Phi`` (a scalar) on flat (N, V) logits; ``value`` is its precomputed value."""
    return OutOfRegionDivergence.apply(logits, value, weight, sampled_ids, sampled_logprob, topk_ids,
                                       topk_logprobs, divergence, temperature, chunk_rows)
