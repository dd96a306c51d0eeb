"""The plain-torch reference of the row reductions: the test oracle of every fused path.

Every quantity the masks need is a reduction over one row of logits (log-sum-exp, the
sampled logit, the logits at the rollout's top-K ids, ``sum_i pi_i^2``, the entropy;
with the rollout's full logits also the full-vocabulary KL/TV terms). This module
computes them with plain torch, in row chunks, so that the extra memory is bounded by
the chunk and never by a float32 copy of the whole logits tensor. The fused paths
(:mod:`._torch`, :mod:`._kernel`) are tested against it, so it stays plain.

Naive torch equivalent of :func:`reduce_rows`::

    logq = torch.log_softmax(logits.float() / T, -1)           # (N, V) float32 copy
    lse, logp = torch.logsumexp(logits.float() / T, -1), logq.gather(1, k[:, None])
    topk_logp, sum_p2 = logq.gather(1, topk_ids), logq.exp().pow(2).sum(-1)
"""

from __future__ import annotations

import torch

from pdmask._validate import check_chunk_size
from pdmask.divergences import floor_log

#: Default chunk budget in elements: 16 M (64 MiB of float32 per temporary).
CHUNK_ELEMENTS = 1 << 24

#: Keys computed only when the rollout policy's full logits are given.
FULL_KEYS = ("full_kl", "full_tv", "full_mu_k", "sum_p_mu", "sum_p_s", "sum_p2_s")

#: Keys computed with the rollout's top-K: reductions over the complement of the support
#: ``S' = topK ∪ {k}`` (:func:`tail_rows`).
TAIL_KEYS = ("lse_tail", "sum_p2_tail")


def support_ids(topk_ids: torch.Tensor, sampled_ids: torch.Tensor) -> torch.Tensor:
    """(N, K+1) the ids of ``S' = topK ∪ {k}`` (k repeated when it is in the top-K)."""
    return torch.cat([topk_ids, sampled_ids[:, None]], 1)


def tail_rescue_below(dtype: torch.dtype, vocab_size: int) -> float:
    """A fused path's tail sum ``t = sum_{tail} exp(z - m)`` (``m`` the row max) below this
    value may have lost terms to underflow: each term under the smallest normal is flushed
    or subnormal, together at most ``V * tiny``, which is one ulp of ``t`` only while
    ``t >= V * tiny / eps``. Such rows are recomputed with :func:`tail_rows` (own max)."""
    fi = torch.finfo(compute_dtype(dtype))
    return vocab_size * fi.tiny / fi.eps


def tail_rows(z: torch.Tensor, sup: torch.Tensor, lse: torch.Tensor,
              keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lse_tail, sum_p2_tail)`` of rows of scaled logits ``z`` (r, V): the log-sum-exp of
    ``z`` and ``sum pi^2`` (``pi = exp(z - lse)``) over the ids outside ``sup`` (r, J) (and
    inside ``keep``, truncated sampling). The tail is summed on its own, with its own max,
    never as ``1 - sum_{S'} pi``: that difference rounds to 0 in float32 once the tail
    holds less than ~6e-8 of the mass. Plain torch; ``-inf`` for an empty tail.

    Naive torch: ``zt = z.scatter(1, sup, -inf); torch.logsumexp(zt, -1)``."""
    zt = z.masked_fill(~keep, float("-inf")) if keep is not None else z.clone()
    zt.scatter_(1, sup, float("-inf"))
    lse_t = torch.logsumexp(zt, -1)
    inside = zt > float("-inf")
    p2 = torch.where(inside, torch.exp(2 * (zt - lse[:, None])), torch.zeros_like(zt)).sum(-1)
    return lse_t, p2


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else (bf16, fp16, fp32) is reduced in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def chunk_rows_for(vocab_size: int, chunk_size: int | None) -> int:
    """Rows per chunk: ``chunk_size`` when given, else a 16 M-element budget."""
    check_chunk_size("chunk_size", chunk_size)
    if chunk_size is not None:
        return chunk_size
    return max(1, CHUNK_ELEMENTS // max(vocab_size, 1))


def full_terms(logq: torch.Tensor, p: torch.Tensor, rollout_z: torch.Tensor,
               sampled_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The full-vocabulary terms of one chunk of rows, from ``log pi`` / ``pi`` (c, V) and
    the rollout's scaled logits ``rollout_z`` (c, V), all in the compute dtype.

    ``full_kl = sum mu (log mu - log pi)`` (logs floored as in :mod:`pdmask.divergences`),
    ``full_tv = 1/2 sum |pi - mu|``, ``full_mu_k = mu_k``, ``sum_p_mu = sum pi mu``,
    ``sum_p_s = sum pi s``, ``sum_p2_s = sum pi^2 s`` with ``s = 1/2 sign(pi - mu)``.
    """
    logm = torch.log_softmax(rollout_z, -1)
    m = logm.exp()
    kl = torch.where(m > 0, m * (floor_log(logm) - floor_log(logq)), torch.zeros_like(m))
    sgn = 0.5 * torch.sign(p - m)
    return {
        "full_kl": kl.sum(-1).clamp(min=0.0),
        "full_tv": 0.5 * (p - m).abs().sum(-1),
        "full_mu_k": m.gather(1, sampled_ids[:, None]).squeeze(1),
        "sum_p_mu": (p * m).sum(-1),
        "sum_p_s": (p * sgn).sum(-1),
        "sum_p2_s": (p * p * sgn).sum(-1),
    }


@torch.no_grad()
def reduce_rows(
    logits: torch.Tensor,  # (N, V)
    sampled_ids: torch.Tensor,  # (N,)
    topk_ids: torch.Tensor | None,  # (N, K)
    *,
    temperature: float = 1.0,
    rollout_logits: torch.Tensor | None = None,  # (N, V)
    chunk_rows: int | None = None,
) -> dict[str, torch.Tensor]:
    """Row reductions of ``pi = softmax(logits / T)`` (and of mu when its logits are given).

    Returns (all detached, in float32 or float64):
      ``lse`` (N,), ``logp`` (N,) = log pi_k, ``sum_p2`` (N,) = sum pi^2,
      ``entropy`` (N,) = -sum pi log pi, ``topk_logp`` (N, K) = log pi at topk_ids;
    with ``topk_ids`` the :data:`TAIL_KEYS` over the ids outside ``topK ∪ {k}``
    (:func:`tail_rows`): ``lse_tail`` (so ``log pi_T = lse_tail - lse``) and
    ``sum_p2_tail`` = sum of pi^2 there; and with ``rollout_logits`` the
    :data:`FULL_KEYS` (see :func:`full_terms`).
    """
    N, V = logits.shape
    cdt = compute_dtype(logits.dtype)
    step = chunk_rows_for(V, chunk_rows)
    out: dict[str, list[torch.Tensor]] = {}
    sup = None if topk_ids is None else support_ids(topk_ids, sampled_ids)

    def put(name, val):
        out.setdefault(name, []).append(val)

    for s in range(0, max(N, 1), step):  # at least once, so that N = 0 gives empty outputs
        e = min(s + step, N)
        z = logits[s:e].to(cdt) / temperature  # (c, V): the only float copy, chunk-sized
        lse = torch.logsumexp(z, -1)  # (c,)
        if sup is not None:
            for k, v in zip(TAIL_KEYS, tail_rows(z, sup[s:e], lse)):
                put(k, v)
        logq = z.sub_(lse[:, None])  # in place: log pi
        p = logq.exp()
        put("lse", lse)
        put("logp", logq.gather(1, sampled_ids[s:e, None]).squeeze(1))
        put("sum_p2", (p * p).sum(-1))
        put("entropy", -torch.where(p > 0, p * logq, torch.zeros_like(p)).sum(-1))
        if topk_ids is not None:
            put("topk_logp", logq.gather(1, topk_ids[s:e]))
        if rollout_logits is not None:
            full = full_terms(logq, p, rollout_logits[s:e].to(cdt) / temperature, sampled_ids[s:e])
            for k, v in full.items():
                put(k, v)
    return {k: torch.cat(v) for k, v in out.items()}


class SampledLogprob(torch.autograd.Function):
    """``log pi_k = z_k / T - lse`` with a chunked backward.

    Forward gathers one logit per row (``lse`` comes from :func:`reduce_rows`). Backward
    writes ``g * (e_k - softmax(z / T)) / T`` chunk by chunk into a gradient of the
    logits' own dtype, so autograd never holds a float32 (N, V) tensor.
    """

    @staticmethod
    def forward(ctx, logits, sampled_ids, lse, temperature, chunk_rows):
        ctx.save_for_backward(logits, sampled_ids, lse)
        ctx.temperature, ctx.chunk_rows = temperature, chunk_rows
        zk = logits.gather(1, sampled_ids[:, None]).squeeze(1).to(lse.dtype)
        return zk / temperature - lse

    @staticmethod
    def backward(ctx, g):
        logits, ids, lse = ctx.saved_tensors
        T, step = ctx.temperature, ctx.chunk_rows
        grad = torch.empty_like(logits)
        cdt = lse.dtype
        for s in range(0, logits.shape[0], step):
            e = min(s + step, logits.shape[0])
            gc = g[s:e].to(cdt)
            p = torch.exp(logits[s:e].to(cdt) / T - lse[s:e, None])
            gz = p.mul_(-gc[:, None])
            gz.scatter_add_(1, ids[s:e, None], gc[:, None])
            # a row without upstream gradient (padding) is 0 even if its logits are NaN/inf
            gz = torch.where(gc[:, None] == 0, torch.zeros_like(gz), gz)
            grad[s:e] = gz.div_(T).to(grad.dtype)
        return grad, None, None, None, None


def sampled_logprob(logits, sampled_ids, lse, temperature, chunk_rows) -> torch.Tensor:
    """Differentiable ``log pi_k`` (N,) from (N, V) logits and the precomputed ``lse``."""
    if not logits.requires_grad:
        zk = logits.gather(1, sampled_ids[:, None]).squeeze(1).to(lse.dtype)
        return zk / temperature - lse
    return SampledLogprob.apply(logits, sampled_ids, lse, temperature, chunk_rows)


def row_stats(logits, sampled_ids, topk_ids, *, temperature: float, chunk_rows: int | None,
              rollout_logits: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """:func:`pdmask.ops.row_stats` with ``impl="reference"``: :func:`reduce_rows`, whose
    ``logp`` is replaced by the differentiable :func:`sampled_logprob` (same value)."""
    rows = chunk_rows_for(logits.shape[1], chunk_rows)
    red = reduce_rows(logits, sampled_ids, topk_ids, temperature=temperature,
                      rollout_logits=rollout_logits, chunk_rows=rows)
    red["logp"] = sampled_logprob(logits, sampled_ids, red["lse"], temperature, rows)
    return red


@torch.no_grad()
def full_rows(logits, sampled_ids, rollout_logits, *, temperature: float,
              chunk_rows: int | None) -> dict[str, torch.Tensor]:
    """Only the :data:`FULL_KEYS` of :func:`reduce_rows` (a second read of the logits)."""
    red = reduce_rows(logits, sampled_ids, None, temperature=temperature, rollout_logits=rollout_logits,
                      chunk_rows=chunk_rows_for(logits.shape[1], chunk_rows))
    return {k: red[k] for k in FULL_KEYS}


# ------------------------------------------------------------------ truncated sampling (the oracle)
def vllm_kept_mask(y: torch.Tensor, top_k=None, top_p=None, min_p=None) -> torch.Tensor:
    """(N, V) bool: the tokens vLLM's sampler keeps from temperature-scaled logits ``y``,
    transcribed step by step (``vllm/v1/sample``: min-p on the softmax, then top-k and
    top-p on the ascending sort, the top-p mask ``cumsum <= 1 - p`` keeping the last)."""
    x = y.clone()
    if min_p is not None:
        probs = torch.softmax(x, -1)
        x.masked_fill_(probs < probs.amax(-1, keepdim=True) * min_p, float("-inf"))
    if top_k is not None or top_p is not None:
        xs, idx = x.sort(dim=-1)
        if top_k is not None and top_k < x.shape[-1]:
            kth = xs.gather(1, torch.full((x.shape[0], 1), x.shape[-1] - top_k, device=x.device))
            xs.masked_fill_(xs < kth, float("-inf"))
        if top_p is not None:
            drop = torch.softmax(xs, -1).cumsum(-1) <= 1 - top_p
            drop[:, -1] = False
            xs.masked_fill_(drop, float("-inf"))
        x = x.scatter(1, idx, xs)
    return x > float("-inf")


def truncated_row_stats(logits, sampled_ids, topk_ids, *, temperature: float, kept_mask=None,
                        top_k=None, top_p=None, min_p=None) -> dict[str, torch.Tensor]:
    """Row statistics of ``pi' = softmax`` over the kept set (the engine's ``kept_mask``, or
    :func:`vllm_kept_mask` of the trainer's logits, plus the sampled token), in one plain
    (N, V) pass with autograd for ``logp`` (oracle only: it holds (N, V) float tensors)."""
    cdt = compute_dtype(logits.dtype)
    y = logits.to(cdt) / temperature
    with torch.no_grad():
        keep = kept_mask.clone() if kept_mask is not None else vllm_kept_mask(y, top_k, top_p, min_p)
        outside = ~keep.gather(1, sampled_ids[:, None]).squeeze(1)
        keep.scatter_(1, sampled_ids[:, None], True)
    ym = y.masked_fill(~keep, float("-inf"))
    with torch.no_grad():
        lq = torch.log_softmax(ym, -1)
        # a row without a finite log-sum-exp over its kept set (NaN/inf logits: padding may
        # hold anything) keeps its NaN values but takes no gradient: autograd through
        # log_softmax would give it (and, through 0 * NaN, nothing else) NaN
        bad = ~torch.isfinite(torch.logsumexp(ym, -1))
    logq = torch.log_softmax(ym.masked_fill(bad[:, None], 0.0), -1)
    k = sampled_ids[:, None]
    out = {"logp": torch.where(bad, lq.gather(1, k).squeeze(1), logq.gather(1, k).squeeze(1))}
    with torch.no_grad():
        p = lq.exp()
        out.update(
            lse=torch.logsumexp(ym.detach(), -1),
            sum_p2=(p * p).sum(-1),
            entropy=-torch.where(p > 0, p * lq, torch.zeros_like(p)).sum(-1),
            kept_mass=torch.exp(torch.logsumexp(ym.detach(), -1) - torch.logsumexp(y.detach(), -1)),
            kept_size=keep.sum(-1).to(cdt),
            sampled_outside=outside,
        )
        if topk_ids is not None:
            out["topk_logp"] = lq.gather(1, topk_ids)
            lse = out["lse"]
            for k, v in zip(TAIL_KEYS, tail_rows(ym.detach(), support_ids(topk_ids, sampled_ids), lse)):
                out[k] = v  # the kept set's tail: ym is -inf outside it
    return out
