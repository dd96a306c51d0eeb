"""Row statistics from hidden states and the LM-head weight, without the (N, V) logits.

Cut-Cross-Entropy style, in plain torch: the vocabulary is walked in column chunks; each
chunk's logits ``z_c = (h @ W_c^T) / T`` (N, Vc) exist only while the chunk is reduced
with an online log-sum-exp. With the running row max ``m`` and, per chunk,
``m' = max(m, max z_c)``, ``a = exp(m - m')``, ``d = m - m'``, ``y = z_c - m'``, ``e = exp(y)``::

    s <- a s + sum e,   q <- a^2 q + sum e^2,   w <- a (w + d s) + sum e y

then ``lse = m + log s``, ``sum_p2 = q / s^2``, ``entropy = log s - w / s`` (as in the
kernel of :mod:`pdmask.ops._kernel`). The sampled and top-K logits are picked out of the
chunk that holds them, so they carry exactly the roundings of the chunk's logits. With the
top-K the tail of ``S' = topK ∪ {k}`` is summed on its own in the same walk (after ``s``,
``q``, ``w``, ``e`` zeroed at the chunk's support ids: ``t``, ``qt`` rescaled like ``s``,
``q``), and rows whose tail could have underflowed are recomputed with its own max (as in
:mod:`pdmask.ops._torch`).

Backward of ``sum_n g_n log pi_{k_n}`` (``G = g (e_k - p) / T``, (N, V), never whole)::

    dh = G W      dW = G^T h      chunk by chunk, p recomputed from h, W and lse.

Naive equivalent: ``pdmask.ops.row_stats(h @ W.T, ...)``. Extra memory: a few
(N, Vc) float32 chunk buffers plus the gradients themselves.
"""

from __future__ import annotations

import torch

from ._autograd import outputs_tuple
from ._reference import compute_dtype, support_ids, tail_rescue_below, tail_rows

#: Elements of one (N, Vc) float32 chunk of logits.
CHUNK_ELEMENTS = 1 << 22


def cols_per_chunk(n_rows: int, vocab_size: int, chunk_cols: int | None) -> int:
    if chunk_cols is not None:
        return chunk_cols
    return max(1, min(vocab_size, CHUNK_ELEMENTS // max(n_rows, 1)))


def _chunk_logits(h, W, a, b, c, cdt):
    z = (h @ W[a:b].T).to(cdt)  # (N, Vc): the logits in the model's own dtype, then upcast
    return z.mul_(c) if c != 1.0 else z


def _pick(dst, z, ids, a, b):
    """Copy ``z[n, ids[n, j] - a]`` into ``dst[n, j]`` where ``a <= ids < b``."""
    inside = (ids >= a) & (ids < b)
    vals = z.gather(1, (ids - a).clamp_(0, b - a - 1))
    dst.copy_(torch.where(inside, vals, dst))


def forward(h, W, sampled_ids, topk_ids, *, temperature, chunk_cols):
    N, V = h.shape[0], W.shape[0]
    cdt = compute_dtype(h.dtype)
    c = 1.0 / temperature
    step = cols_per_chunk(N, V, chunk_cols)
    ninf = float("-inf")
    m = torch.full((N,), ninf, dtype=cdt, device=h.device)
    s, q, w = (torch.zeros(N, dtype=cdt, device=h.device) for _ in range(3))
    zk = torch.full((N, 1), float("nan"), dtype=cdt, device=h.device)
    zt = None if topk_ids is None else torch.full(topk_ids.shape, float("nan"), dtype=cdt, device=h.device)
    sup = None if topk_ids is None else support_ids(topk_ids, sampled_ids)
    t, qt = (torch.zeros(N, dtype=cdt, device=h.device) for _ in range(2))  # the tail's s and q
    for a in range(0, V, step):
        b = min(a + step, V)
        z = _chunk_logits(h, W, a, b, c, cdt)
        _pick(zk, z, sampled_ids[:, None], a, b)
        if zt is not None:
            _pick(zt, z, topk_ids, a, b)
        m_new = torch.maximum(m, z.amax(-1))
        m_sub = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
        first = torch.isneginf(m)
        alpha = torch.where(first, torch.zeros_like(m), torch.exp(m - m_sub))
        d = torch.where(first, torch.zeros_like(m), m - m_sub)
        y = z.sub_(m_sub[:, None])
        e = torch.exp(y)
        se = e.sum(-1)
        qe = torch.linalg.vecdot(e, e)
        we = torch.where(e > 0, e * y, torch.zeros_like(e)).sum(-1)
        if sup is not None:
            # e is spent: this chunk's support entries zeroed (a product by 0 where inside,
            # by 1 for ids clamped in from elsewhere: collisions cannot matter), the tail summed
            inside = (sup >= a) & (sup < b)
            e.scatter_reduce_(1, (sup - a).clamp_(0, b - a - 1), (~inside).to(cdt), "prod")
            t = alpha * t + e.sum(-1)
            qt = alpha * alpha * qt + torch.linalg.vecdot(e, e)
        w = alpha * (w + d * s) + we
        s = alpha * s + se
        q = alpha * alpha * q + qe
        m = m_new
    log_s = s.log()
    m_fin = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    lse = m_fin + log_s
    out = {"lse": lse, "logp": zk.squeeze(1) - lse, "sum_p2": q / (s * s), "entropy": log_s - w / s}
    if zt is not None:
        out["topk_logp"] = zt - lse[:, None]
        out["lse_tail"] = m_fin + t.log()
        out["sum_p2_tail"] = qt / (s * s)
        _rescue_tails(h, W, sup, t, lse, out, c, cdt)
    return out


def _rescue_tails(h, W, sup, t, lse, out, c, cdt) -> None:
    """Rows whose tail could have underflowed: the logits again, a few rows at a time, and
    :func:`._reference.tail_rows` (the tail's own max)."""
    V = W.shape[0]
    bad = t < tail_rescue_below(h.dtype, V)
    if not bool(bad.any()):
        return
    idx = bad.nonzero().squeeze(1)
    step = max(1, CHUNK_ELEMENTS // V)
    for a in range(0, idx.numel(), step):
        r = idx[a : a + step]
        z = (h[r] @ W.T).to(cdt)
        if c != 1.0:
            z.mul_(c)
        out["lse_tail"][r], out["sum_p2_tail"][r] = tail_rows(z, sup[r], lse[r])


def backward(h, W, sampled_ids, lse, g, *, temperature, chunk_cols, need_h=True, need_W=True):
    """``(dh, dW)`` of ``sum_n g_n log pi_{k_n}``; float32 accumulation, cast at the end."""
    N, V = h.shape[0], W.shape[0]
    cdt = lse.dtype
    c = 1.0 / temperature
    step = cols_per_chunk(N, V, chunk_cols)
    lse = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, float("inf")))
    gc = g.to(cdt) * c  # (N,)
    # rows without upstream gradient (padding) contribute exactly 0, even when their hidden
    # states (hence logits) are NaN/inf: with h zeroed, G = -0 * p = 0 there (lse non-finite
    # was set to +inf above, so p = 0)
    live = (gc != 0)[:, None]
    h = torch.where(live, h, torch.zeros_like(h))
    dh = torch.zeros(h.shape, dtype=cdt, device=h.device) if need_h else None
    dW = torch.empty(W.shape, dtype=W.dtype, device=W.device) if need_W else None
    hc = h.to(cdt) if need_W else None
    for a in range(0, V, step):
        b = min(a + step, V)
        G = _chunk_logits(h, W, a, b, c, cdt).sub_(lse[:, None]).exp_().mul_(-gc[:, None])  # (N, Vc) -g p / T
        inside = (sampled_ids >= a) & (sampled_ids < b)
        rows = inside.nonzero().squeeze(1)
        G[rows, sampled_ids[rows] - a] += gc[rows]  # + g e_k / T
        if need_h:
            dh.addmm_(G, W[a:b].to(cdt))
        if need_W:
            dW[a:b] = (G.T @ hc).to(W.dtype)
    return (dh.to(h.dtype) if need_h else None), dW


class HiddenRowStats(torch.autograd.Function):
    """Row statistics of ``softmax(h W^T / T)``; ``logp`` differentiable in ``h`` and ``W``."""

    @staticmethod
    def forward(ctx, h, W, sampled_ids, topk_ids, temperature, chunk_cols):
        out = forward(h, W, sampled_ids, topk_ids, temperature=temperature, chunk_cols=chunk_cols)
        ctx.save_for_backward(h, W, sampled_ids, out["lse"])
        ctx.temperature, ctx.chunk_cols = temperature, chunk_cols
        return outputs_tuple(ctx, out)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_lse, g_logp, *rest):
        h, W, ids, lse = ctx.saved_tensors
        dh, dW = backward(h, W, ids, lse, g_logp, temperature=ctx.temperature, chunk_cols=ctx.chunk_cols,
                          need_h=ctx.needs_input_grad[0], need_W=ctx.needs_input_grad[1])
        return dh, dW, None, None, None, None


# ------------------------------------------------------------------ truncated sampling
# The kept set is decided on the logits themselves (a threshold per row), so the forward
# statistics and the backward must see the very same logit values: both walk the rows in
# the same chunks and recompute ``h[rows] @ W^T`` with the same call. Rows, not columns:
# top-p needs each row's whole sorted distribution.
def rows_per_chunk(n_rows: int, vocab_size: int, chunk_rows: int | None) -> int:
    if chunk_rows is not None:
        return chunk_rows
    return max(1, CHUNK_ELEMENTS // max(vocab_size, 1))


def trunc_forward(h, W, sampled_ids, topk_ids, *, temperature, chunk_rows, sampling, kept_mask):
    """:func:`pdmask.ops._truncate.forward` of ``h @ W^T``, (rows, V) logits at a time."""
    from . import _truncate

    N, V = h.shape[0], W.shape[0]
    step = rows_per_chunk(N, V, chunk_rows)
    outs, taus = [], []
    for a in range(0, max(N, 1), step):
        b = min(a + step, N)
        z = h[a:b] @ W.T  # (rows, V) in the model's dtype: the only logits that exist
        out, tau = _truncate.forward(z, sampled_ids[a:b], None if topk_ids is None else topk_ids[a:b],
                                     temperature=temperature, chunk_rows=max(b - a, 1), sampling=sampling,
                                     kept_mask=None if kept_mask is None else kept_mask[a:b])
        outs.append(out)
        taus.append(tau)
    return {k: torch.cat([o[k] for o in outs]) for k in outs[0]}, torch.cat(taus)


def trunc_backward(h, W, sampled_ids, lse, g, tau, kept_mask, *, temperature, chunk_rows, need_h, need_W):
    """``(dh, dW)`` of ``sum_n g_n log pi'_{k_n}``: per row chunk ``G = g (e_k - pi') / T``
    (float32), ``dh = G W`` (in the model's dtype, as autograd through the logits would),
    ``dW += G^T h`` accumulated in float32."""
    from . import _truncate

    N, V = h.shape[0], W.shape[0]
    cdt = lse.dtype
    step = rows_per_chunk(N, V, chunk_rows)
    dh = torch.empty_like(h) if need_h else None
    dW = torch.zeros(W.shape, dtype=cdt, device=W.device) if need_W else None
    # rows without upstream gradient (padding) get G = 0 from _truncate.backward; their hidden
    # states may still be NaN/inf, and 0 * NaN in G^T h would spoil the whole weight gradient
    h_live = torch.where((g != 0)[:, None], h, torch.zeros_like(h)) if need_W else None
    for a in range(0, N, step):
        b = min(a + step, N)
        z = (h[a:b] @ W.T).to(cdt)  # the forward's logits, the same call, upcast after
        G = _truncate.backward(z, sampled_ids[a:b], lse[a:b], g[a:b], tau[a:b],
                               None if kept_mask is None else kept_mask[a:b], temperature=temperature,
                               chunk_rows=b - a)  # (rows, V) float32
        if need_h:
            dh[a:b] = G.to(h.dtype) @ W
        if need_W:
            dW.addmm_(G.T, h_live[a:b].to(cdt))
    return dh, (dW.to(W.dtype) if need_W else None)


class HiddenTruncRowStats(torch.autograd.Function):
    """Truncated row statistics of ``softmax(h W^T / T)``; ``logp`` differentiable in h and W."""

    @staticmethod
    def forward(ctx, h, W, sampled_ids, topk_ids, temperature, chunk_rows, sampling, kept_mask):
        from . import _truncate

        out, tau = trunc_forward(h, W, sampled_ids, topk_ids, temperature=temperature, chunk_rows=chunk_rows,
                                 sampling=sampling, kept_mask=kept_mask)
        ctx.save_for_backward(h, W, sampled_ids, out["lse"], tau, kept_mask)
        ctx.temperature, ctx.chunk_rows = temperature, chunk_rows
        return _truncate.outputs_tuple(ctx, out)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_lse, g_logp, *rest):
        h, W, ids, lse, tau, kept_mask = ctx.saved_tensors
        dh, dW = trunc_backward(h, W, ids, lse, g_logp, tau, kept_mask, temperature=ctx.temperature,
                                chunk_rows=ctx.chunk_rows, need_h=ctx.needs_input_grad[0],
                                need_W=ctx.needs_input_grad[1])
        return dh, dW, None, None, None, None, None, None
