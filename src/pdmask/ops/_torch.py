"""Chunked plain-torch implementation of the fused row statistics (CPU, and fallback).

One pass of ``exp`` per element, over row chunks small enough to stay in cache. For a
chunk of rows ``x`` (any float dtype), with ``z = x / T`` computed as ``x * (1/T)`` in the
compute dtype and ``m`` the row max of z::

    y = z - m                 # (rows, V) compute dtype, <= 0, one buffer
    e = exp(y)                # (rows, V) second buffer; the only exp
    s = sum e,  q = sum e^2,  w = sum e y

    lse     = m + log s
    sum_p2  = q / s^2                      (p = e / s)
    entropy = log s - w / s                (= -sum p log p; both terms >= 0, no cancellation)
    logp    = z_k - m - log s              (z_k gathered from the input, so -inf stays -inf)

With the rollout's top-K the chunk also gives the tail of the support ``S' = topK ∪ {k}``:
two more sums over the chunk with the K+1 support entries of ``e`` (then ``e^2``) zeroed,
``t = sum_{tail} e`` and ``qt = sum_{tail} e^2``, never ``s`` minus the support (that
difference rounds away a tail below ~6e-8 of the mass in float32). ``s``, ``q`` and ``w``
are summed exactly as without the top-K, so the other statistics keep their bits::

    lse_tail    = m + log t            (log pi_T = lse_tail - lse)
    sum_p2_tail = qt / s^2

Rows whose ``t`` is so small that underflowed terms could matter
(:func:`._reference.tail_rescue_below`) are recomputed with the tail's own max
(:func:`._reference.tail_rows`); rows of ordinary policies never are.

With the rollout policy's full logits (``rollout_logits``) the same chunk also gives the
full-vocabulary terms (:func:`._reference.full_terms` on ``log pi = y - log s`` and
``pi = e / s``), so the logits are read once; that costs a few more chunk buffers.

Peak extra memory: two (rows, V) buffers of the compute dtype plus O(N K) outputs.
Naive equivalent: :func:`pdmask.ops._reference.reduce_rows` (the test oracle).
"""

from __future__ import annotations

import torch

from ._reference import FULL_KEYS, compute_dtype, full_terms, support_ids, tail_rescue_below, tail_rows

#: Elements per chunk buffer (two buffers): 512 Ki elements = 2 MiB of float32 each,
#: small enough to stay in the last-level cache while the chunk is reduced.
CHUNK_ELEMENTS = 1 << 19

#: This backend honours ``chunk_rows`` (the Triton one streams rows and ignores it).
CHUNKED = True
#: This backend computes the full-vocabulary keys in its own pass (``rollout_logits``).
FUSES_FULL = True

#: On a GPU the chunk only bounds memory (each op is a kernel launch): 16 M elements,
#: 64 MiB of float32 per buffer, as the reference path.
CHUNK_ELEMENTS_CUDA = 1 << 24


def rows_per_chunk(vocab_size: int, chunk_rows: int | None, device: torch.device | str = "cpu") -> int:
    if chunk_rows is not None:
        return chunk_rows
    budget = CHUNK_ELEMENTS_CUDA if torch.device(device).type == "cuda" else CHUNK_ELEMENTS
    return max(1, budget // max(vocab_size, 1))


def _safe_max(m: torch.Tensor) -> torch.Tensor:
    # An all -inf row has max -inf; shift it by 0 instead so x - m stays -inf (not NaN)
    # and s = 0 gives lse = -inf, which the caller reports (as torch.logsumexp does).
    return m.masked_fill_(m == float("-inf"), 0.0)


def forward(
    logits: torch.Tensor,  # (N, V)
    sampled_ids: torch.Tensor,  # (N,) int64
    topk_ids: torch.Tensor | None,  # (N, K) int64
    *,
    temperature: float,
    chunk_rows: int | None,
    rollout_logits: torch.Tensor | None = None,  # (N, V)
) -> dict[str, torch.Tensor]:
    """Row statistics of ``softmax(logits / temperature)``; see the module docstring.

    With ``topk_ids`` the dict also holds the :data:`._reference.TAIL_KEYS`, with
    ``rollout_logits`` the :data:`._reference.FULL_KEYS`."""
    N, V = logits.shape
    cdt = compute_dtype(logits.dtype)
    dev = logits.device
    c = 1.0 / temperature
    step = rows_per_chunk(V, chunk_rows, logits.device)
    m = torch.empty(N, 1, dtype=cdt, device=dev)  # row max of z = x / T
    s = torch.empty(N, dtype=cdt, device=dev)
    q = torch.empty(N, dtype=cdt, device=dev)
    w = torch.empty(N, dtype=cdt, device=dev)
    rows = min(step, N)
    ybuf = torch.empty(rows, V, dtype=cdt, device=dev)
    ebuf = torch.empty(rows, V, dtype=cdt, device=dev)
    same = logits.dtype == cdt
    full = None if rollout_logits is None else {k: torch.empty(N, dtype=cdt, device=dev) for k in FULL_KEYS}
    sup = None if topk_ids is None else support_ids(topk_ids, sampled_ids)
    if sup is not None:
        t = torch.empty(N, dtype=cdt, device=dev)  # sum of e over the tail (outside S')
        qt = torch.empty(N, dtype=cdt, device=dev)  # sum of e^2 there
    for a in range(0, N, step):
        b = min(a + step, N)
        x, y, e, mc = logits[a:b], ybuf[: b - a], ebuf[: b - a], m[a:b]
        if same and c == 1.0:
            torch.amax(x, -1, keepdim=True, out=mc)
            _safe_max(mc)
            torch.sub(x, mc, out=y)
        else:
            # upcast (and scale) into the buffer first: reductions and arithmetic on
            # float32 run faster on CPU than on bf16/fp16 input
            if same:
                torch.mul(x, c, out=y)
            else:
                y.copy_(x)
                if c != 1.0:
                    y.mul_(c)
            torch.amax(y, -1, keepdim=True, out=mc)
            _safe_max(mc)
            y.sub_(mc)
        torch.exp(y, out=e)
        torch.sum(e, -1, out=s[a:b])
        if full is not None:  # before y and e are overwritten below
            sc = s[a:b, None]
            terms = full_terms(y - sc.log(), e / sc, rollout_logits[a:b].to(cdt) / temperature, sampled_ids[a:b])
            for k, v in terms.items():
                full[k][a:b] = v
        if sup is not None:  # the tail's sum: the K+1 support entries zeroed, then put back
            ids_s = sup[a:b]
            es = e.gather(1, ids_s)
            e.scatter_(1, ids_s, 0.0)
            torch.sum(e, -1, out=t[a:b])
            e.scatter_(1, ids_s, es)
        y.mul_(e)  # e y; NaN where x = -inf (0 * -inf), fixed below
        torch.sum(y, -1, out=w[a:b])
        e.mul_(e)
        torch.sum(e, -1, out=q[a:b])
        if sup is not None:  # e holds e^2 now: the tail's with the support zeroed again
            e.scatter_(1, ids_s, 0.0)
            torch.sum(e, -1, out=qt[a:b])
    del ybuf, ebuf
    _fix_neg_inf(logits, m, s, w, c, step)
    log_s = s.log()
    lse = m.squeeze(1) + log_s
    out = {
        "lse": lse,
        "logp": _logp_at(logits, sampled_ids[:, None], m, log_s[:, None], c).squeeze(1),
        "sum_p2": q / (s * s),
        "entropy": log_s - w / s,
    }
    if topk_ids is not None:
        out["topk_logp"] = _logp_at(logits, topk_ids, m, log_s[:, None], c)
        out["lse_tail"] = m.squeeze(1) + t.log()
        out["sum_p2_tail"] = qt / (s * s)
        rescue_tails(logits, sup, t, lse, out["lse_tail"], out["sum_p2_tail"], c, step)
    if full is not None:
        out.update(full)
    return out


def _logp_at(logits, ids, m, log_s, c) -> torch.Tensor:
    """``z_ids - m - log s`` (N, J), with the same roundings as the chunk's ``y``."""
    xg = logits.gather(1, ids).to(m.dtype)  # (N, J)
    if c != 1.0:
        xg.mul_(c)
    return xg.sub_(m).sub_(log_s)


def rescue_tails(logits, sup, t, lse, lse_tail, sum_p2_tail, c, step) -> None:
    """Recompute, in place, the tail of rows whose tail sum ``t`` (relative to the row max)
    is below :func:`._reference.tail_rescue_below`, with the tail's own max
    (:func:`._reference.tail_rows`). A row with NaN logits (NaN ``t``) is left alone."""
    bad = t < tail_rescue_below(logits.dtype, logits.shape[1])
    if not bool(bad.any()):
        return
    idx = bad.nonzero().squeeze(1)
    for a in range(0, idx.numel(), step):
        r = idx[a : a + step]
        z = logits[r].to(lse.dtype)
        if c != 1.0:
            z.mul_(c)
        lse_tail[r], sum_p2_tail[r] = tail_rows(z, sup[r], lse[r])


def _fix_neg_inf(logits, m, s, w, c, step) -> None:
    """Recompute ``w = sum e y`` on rows where a -inf logit made ``0 * -inf = NaN``.

    Only rows with a finite positive ``s`` (so the logits themselves are not NaN) and a
    NaN ``w`` are redone, in chunks, with ``e y`` set to 0 where ``e = 0``; rows without
    -inf logits never pay for this.
    """
    bad = torch.isnan(w) & (s > 0) & torch.isfinite(s)
    if not bool(bad.any()):
        return
    idx = bad.nonzero().squeeze(1)
    for a in range(0, idx.numel(), step):
        r = idx[a : a + step]
        y = logits[r].to(m.dtype)
        if c != 1.0:
            y.mul_(c)
        y.sub_(m[r])
        e = y.exp()
        w[r] = torch.where(e > 0, e * y, torch.zeros_like(y)).sum(-1)


def backward(
    logits: torch.Tensor,  # (N, V)
    sampled_ids: torch.Tensor,  # (N,)
    lse: torch.Tensor,  # (N,) compute dtype
    grad_logp: torch.Tensor,  # (N,)
    *,
    temperature: float,
    chunk_rows: int | None,
) -> torch.Tensor:
    """``d logp / d logits`` contracted with ``grad_logp``: ``g (e_k - p) / T``, chunked.

    Written straight into a gradient of the logits' dtype; for float32/float64 logits the
    chunk is computed in place in the output, so no extra buffer is used at all.
    """
    N, V = logits.shape
    cdt = lse.dtype
    c = 1.0 / temperature
    step = rows_per_chunk(V, chunk_rows, logits.device)
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    # rows whose lse is not finite (all -inf padding rows) get p = exp(-inf) = 0, not NaN
    lse = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, float("inf")))
    gc = grad_logp.to(cdt) * c  # (N,)
    same = logits.dtype == cdt
    buf = None if same else torch.empty(min(step, N), V, dtype=cdt, device=logits.device)
    for a in range(0, N, step):
        b = min(a + step, N)
        if same and c == 1.0:
            y = torch.sub(logits[a:b], lse[a:b, None], out=grad[a:b])
        else:
            y = grad[a:b] if same else buf[: b - a]
            y.copy_(logits[a:b])  # upcast first: float32 arithmetic is the fast path on CPU
            if c != 1.0:
                y.mul_(c)
            y.sub_(lse[a:b, None])
        y.exp_().mul_(gc[a:b, None].neg())  # -g p / T
        y.scatter_add_(1, sampled_ids[a:b, None], gc[a:b, None])  # + g e_k / T
        if not same:
            grad[a:b].copy_(y)
    _zero_rows_without_gradient(grad, gc)
    return grad


def _zero_rows_without_gradient(grad: torch.Tensor, gc: torch.Tensor) -> None:
    """Rows with a zero upstream gradient get exactly 0, whatever their logits hold.

    Padding rows may hold NaN/inf logits (``p`` is then NaN and ``0 * NaN = NaN``); their
    upstream gradient is 0, so their true gradient is 0. Only those rows are rewritten."""
    zero = gc == 0
    if zero.any():  # one sync on CUDA (this path is the fallback there), free on CPU
        grad.index_fill_(0, zero.nonzero().squeeze(1), 0)
