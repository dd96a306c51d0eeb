"""Per-token statistics: the single place that reads the (N, V) logits.

Every quantity the masks need is a reduction over one row of logits (log-sum-exp, the
sampled logit, the logits at the rollout's top-K ids, ``sum_i pi_i^2``, the entropy;
with the rollout's full logits also the full-vocabulary KL/TV terms). This module
computes them with plain torch, in row chunks, so that the extra memory is bounded by
the chunk and never by a float32 copy of the whole logits tensor. It is the reference
the fused kernels are tested against, so it stays plain.

Naive torch equivalent of :func:`reduce_rows`::

    logq = torch.log_softmax(logits.float() / T, -1)           # (N, V) float32 copy
    lse, logp = torch.logsumexp(logits.float() / T, -1), logq.gather(1, k[:, None])
    topk_logp, sum_p2 = logq.gather(1, topk_ids), logq.exp().pow(2).sum(-1)
"""

from __future__ import annotations

import torch

from . import directions as dirs
from . import divergences as divs
from ._validate import Batch, check_positive, prepare
from .keys import ESTIMATORS, ddot_key

#: Default chunk budget in elements: 16 M (64 MiB of float32 per temporary).
CHUNK_ELEMENTS = 1 << 24


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else (bf16, fp16, fp32) is reduced in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def chunk_rows_for(vocab_size: int, chunk_size: int | None) -> int:
    if chunk_size is not None:
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size: must be a positive int (rows per chunk), got {chunk_size!r}")
        return chunk_size
    return max(1, CHUNK_ELEMENTS // max(vocab_size, 1))


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
    and with ``rollout_logits``: ``full_kl``, ``full_tv``, ``full_mu_k`` (mu at k),
      ``sum_p_mu`` = sum pi mu, ``sum_p_s`` = sum pi s, ``sum_p2_s`` = sum pi^2 s with
      ``s = 1/2 sign(pi - mu)``.
    """
    N, V = logits.shape
    cdt = compute_dtype(logits.dtype)
    step = chunk_rows_for(V, chunk_rows)
    out: dict[str, list[torch.Tensor]] = {}

    def put(name, val):
        out.setdefault(name, []).append(val)

    for s in range(0, max(N, 1), step):  # at least once, so that N = 0 gives empty outputs
        e = min(s + step, N)
        z = logits[s:e].to(cdt) / temperature  # (c, V): the only float copy, chunk-sized
        lse = torch.logsumexp(z, -1)  # (c,)
        logq = z.sub_(lse[:, None])  # in place: log pi
        p = logq.exp()
        put("lse", lse)
        put("logp", logq.gather(1, sampled_ids[s:e, None]).squeeze(1))
        put("sum_p2", (p * p).sum(-1))
        put("entropy", -torch.where(p > 0, p * logq, torch.zeros_like(p)).sum(-1))
        if topk_ids is not None:
            put("topk_logp", logq.gather(1, topk_ids[s:e]))
        if rollout_logits is not None:
            logm = torch.log_softmax(rollout_logits[s:e].to(cdt) / temperature, -1)
            m = logm.exp()
            floor = divs._floor_log
            kl = torch.where(m > 0, m * (floor(logm) - floor(logq)), torch.zeros_like(m))
            sgn = 0.5 * torch.sign(p - m)
            put("full_kl", kl.sum(-1).clamp(min=0.0))
            put("full_tv", 0.5 * (p - m).abs().sum(-1))
            put("full_mu_k", m.gather(1, sampled_ids[s:e, None]).squeeze(1))
            put("sum_p_mu", (p * m).sum(-1))
            put("sum_p_s", (p * sgn).sum(-1))
            put("sum_p2_s", (p * p * sgn).sum(-1))
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
            grad[s:e] = gz.div_(T).to(grad.dtype)
        return grad, None, None, None, None


def sampled_logprob(logits, sampled_ids, lse, temperature, chunk_rows) -> torch.Tensor:
    """Differentiable ``log pi_k`` (N,) from (N, V) logits and the precomputed ``lse``."""
    if not logits.requires_grad:
        zk = logits.gather(1, sampled_ids[:, None]).squeeze(1).to(lse.dtype)
        return zk / temperature - lse
    return SampledLogprob.apply(logits, sampled_ids, lse, temperature, chunk_rows)


#: Keys only the reference path computes (they need the rollout's full logits).
FULL_KEYS = ("full_kl", "full_tv", "full_mu_k", "sum_p_mu", "sum_p_s", "sum_p2_s")


def _row_reductions(batch: Batch, temperature: float, chunk_rows: int | None, impl: str):
    """``(red, logp)``: the row reductions (detached) and the differentiable ``log pi_k``.

    ``impl`` picks the :mod:`pdmask.ops` implementation; ``"reference"`` is
    :func:`reduce_rows` + :class:`SampledLogprob`. The full-vocabulary keys
    (``rollout_logits`` given: simulation / oracle only) always come from the reference.
    """
    from . import ops  # lazy: pdmask.ops imports this module

    rows = chunk_rows_for(batch.vocab_size, chunk_rows)
    if ops.resolve_impl(impl, batch.logits) == "reference":
        red = reduce_rows(
            batch.logits, batch.sampled_ids, batch.topk_ids,
            temperature=temperature, rollout_logits=batch.rollout_logits, chunk_rows=rows,
        )
        return red, sampled_logprob(batch.logits, batch.sampled_ids, red["lse"], temperature, rows)
    red = ops.row_stats(batch.logits, batch.sampled_ids, batch.topk_ids, temperature=temperature,
                        chunk_rows=chunk_rows, impl=impl, validate=False)
    logp = red["logp"]
    red["logp"] = logp.detach()
    if batch.rollout_logits is not None:
        full = reduce_rows(batch.logits, batch.sampled_ids, None, temperature=temperature,
                           rollout_logits=batch.rollout_logits, chunk_rows=rows)
        red.update({k: full[k] for k in FULL_KEYS})
    return red, logp


def stats_from_batch(
    batch: Batch, *, temperature: float, chunk_rows: int | None = None, impl: str = "auto",
    validate: bool = True,
) -> dict[str, torch.Tensor]:
    """All per-token statistics on flattened (N,) rows; ``logp`` carries the gradient.

    ``chunk_rows`` (None: each implementation's default) and ``impl`` (see
    :func:`pdmask.ops.row_stats`; ``"auto"`` never needs Triton on CPU) are passed to
    :mod:`pdmask.ops`.
    """
    red, logp = _row_reductions(batch, temperature, chunk_rows, impl)
    lse = red["lse"]
    # a host sync: made only when validating (off on a trusted hot path)
    if validate and not torch.isfinite(lse[batch.valid]).all():
        raise ValueError("logits: a response row has no finite logit (all -inf, or NaN/inf values)")
    logp_d = red["logp"]  # detached
    rlp = batch.rollout_logprob.to(lse.dtype)
    sum_p2 = red["sum_p2"]
    log_ratio = dirs.ratio_direction(logp_d, rlp)
    st = {
        "logp": logp,
        "rollout_logp": rlp,
        "log_ratio": log_ratio,
        "ratio": log_ratio.clamp(max=80.0).exp(),
        "entropy": red["entropy"],
        "sum_p2": sum_p2,
        "binary_tv": divs.binary_tv(logp_d, rlp),
        "binary_kl": divs.binary_kl(logp_d, rlp),
        "ddot_binary_tv": dirs.ddot_binary_tv(logp_d, rlp, sum_p2),
        "ddot_binary_kl": dirs.ddot_binary_kl(logp_d, rlp, sum_p2),
    }
    if batch.topk_ids is not None:
        sup = divs.build_support(
            batch.sampled_ids, logp_d, rlp, batch.topk_ids, red["topk_logp"],
            batch.topk_logprobs.to(lse.dtype), sum_p2, batch.vocab_size,
        )
        st.update({
            "topk_kl": divs.topk_kl(sup),
            "topk_tv": divs.topk_tv(sup),
            "rollout_tail_mass": sup.mu_tail,
            "policy_tail_mass": sup.pi_tail,
            "tail_clamped": sup.mu_tail_clamped,
            "sampled_in_topk": sup.k_col < batch.topk_ids.shape[1],
        })
        for est in ESTIMATORS:
            st[ddot_key("topk_kl", est)] = dirs.ddot_topk_kl(sup, est)
            st[ddot_key("topk_tv", est)] = dirs.ddot_topk_tv(sup, est)
    if batch.rollout_logits is not None:
        st.update({
            "full_kl": red["full_kl"],
            "full_tv": red["full_tv"],
            "ddot_full_kl": dirs.ddot_full_kl(logp_d, red["full_mu_k"], red["sum_p_mu"], sum_p2),
            "ddot_full_tv": dirs.ddot_full_tv(logp_d, red["full_mu_k"], red["sum_p_s"], red["sum_p2_s"], sum_p2),
        })
    st["valid"] = batch.valid
    return st


def unflatten(stats: dict[str, torch.Tensor], lead_shape: tuple) -> dict[str, torch.Tensor]:
    return {k: v.reshape(lead_shape + tuple(v.shape[1:])) for k, v in stats.items()}


def token_stats(
    logits: torch.Tensor,
    sampled_ids: torch.Tensor,
    rollout_logprob: torch.Tensor,
    rollout_topk_ids: torch.Tensor | None = None,
    rollout_topk_logprobs: torch.Tensor | None = None,
    *,
    response_mask: torch.Tensor | None = None,
    rollout_logits: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    validate: bool = True,
    impl: str = "auto",
) -> dict[str, torch.Tensor]:
    """Every per-token statistic of the library, shaped like ``sampled_ids``.

    Args:
        logits: (B, T, V) trainer logits (any float dtype; reduced in float32, or
            float64 for float64 input). ``pi = softmax(logits / temperature)``.
        sampled_ids: (B, T) tokens the rollout engine sampled.
        rollout_logprob: (B, T) engine log-prob ``log mu_k`` of the sampled token.
        rollout_topk_ids, rollout_topk_logprobs: (B, T, K) engine top-K view of mu
            (optional; without them there are no top-K keys).
        response_mask: (B, T) positions to check (others are padding, sanitised).
        rollout_logits: (B, T, V) the rollout policy's full logits, same temperature
            (simulation / oracle path; adds the ``full_*`` keys).
        chunk_size: rows per chunk of the vocabulary reductions (default: a cache-sized
            chunk for ``impl="torch"``, 16 M elements for ``"reference"``).
        impl: row-reduction implementation (:func:`pdmask.ops.row_stats`): ``"auto"``
            (Triton for CUDA logits when installed, else the chunked torch path; never
            needs Triton on CPU), ``"torch"``, ``"triton"``, ``"reference"``.

    Returns a dict (``ratio = exp(log_ratio)``, ``log_ratio = log pi_k - log mu_k``):
      ``logp`` (differentiable log pi_k), ``rollout_logp``, ``log_ratio``, ``ratio``,
      ``entropy``, ``sum_p2``, ``binary_tv``, ``binary_kl``, ``ddot_binary_tv``,
      ``ddot_binary_kl``; with top-K: ``topk_kl``, ``topk_tv``,
      ``ddot_topk_{kl,tv}_{exact,aggregated,uniform,truncated}``,
      ``rollout_tail_mass`` (mu_T), ``policy_tail_mass`` (pi_T), ``tail_clamped``
      (sum of mu on S' exceeded 1 by rounding), ``sampled_in_topk``; with
      ``rollout_logits``: ``full_kl``, ``full_tv``, ``ddot_full_kl``, ``ddot_full_tv``;
      and ``valid`` (the response mask). ``Ddot`` is ``grad_{z/T} D . (e_k - pi)``.
    """
    check_positive("temperature", temperature)
    batch = prepare(logits, sampled_ids, rollout_logprob, rollout_topk_ids, rollout_topk_logprobs,
                    response_mask, rollout_logits, validate)
    chunk_rows_for(batch.vocab_size, chunk_size)  # validates chunk_size
    st = stats_from_batch(batch, temperature=temperature, chunk_rows=chunk_size, impl=impl,
                          validate=validate)
    return unflatten(st, batch.lead_shape)
