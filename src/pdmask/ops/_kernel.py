"""Triton kernels of the row reductions and of the gradient of ``log pi_k`` (``impl="triton"``;
imported only then; built on first use, for Triton's CPU interpreter under ``TRITON_INTERPRET=1``).

Forward, one program per row, one pass in blocks with an online log-sum-exp in base 2 and
float32 accumulation: with ``z = x log2(e) / T`` and the running max ``m``, the row keeps
``s = sum 2^(z - m)``, ``q``, ``w`` as the torch backend (:mod:`pdmask.ops`); a block raising
the max to ``m'`` rescales them (``a = 2^(m - m')``: ``s <- a s + ...``, ``q <- a^2 q + ...``,
``w <- a (w + (m - m') s) + ...``). The tail of ``S'`` is summed beside them, the sorted support
ids (sentinel ``V``) walked along the blocks; a row whose tail could have underflowed walks
again with the tail's own max. Backward, one program per row: ``g (e_k - p) / T``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._shared import interpreting

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# globals a kernel reads must be constexpr for the compiler (the interpreter does not care)
_LN2 = tl.constexpr(LN2)
_LOG2E = tl.constexpr(LOG2E)

#: Launch configuration. Not tuned on hardware from this repository; ``bench_gpu.py
#: --tune`` measures alternatives.
FWD_BLOCK_V = 4096
BWD_BLOCK_V = 4096
NUM_WARPS = 8


def _row_stats_fwd(
    X, stride_x, IDS, TOPK, stride_tk, LSE, LOGP, SUMP2, ENT, TOPK_LOGP, stride_tl,
    SUP, stride_sup, LSE_TAIL, P2_TAIL,
    V, K, scale, rescue,
    BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, HAS_TOPK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x  # int64 offset: N * V exceeds 2^31 at T = 16k, V = 152k
    sup_row = SUP + row * stride_sup
    offs = tl.arange(0, BLOCK_V)
    neg_inf = float("-inf")
    m = tl.full((), neg_inf, tl.float32)
    s = tl.zeros((), tl.float32)
    q = tl.zeros((), tl.float32)
    w = tl.zeros((), tl.float32)
    t = tl.zeros((), tl.float32)  # s over the tail (outside S') only
    qt = tl.zeros((), tl.float32)  # q there
    ptr = tl.zeros((), tl.int64)  # the next support id not yet passed (sorted, sentinel V)
    nxt = tl.load(sup_row)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        z = tl.load(x_row + cols, mask=cols < V, other=neg_inf).to(tl.float32) * scale
        m_new = tl.maximum(m, tl.max(z, 0))
        # m_sub: a finite shift even while every value seen so far is -inf
        m_sub = tl.where(m_new == neg_inf, 0.0, m_new)
        a = tl.where(m == neg_inf, 0.0, tl.exp2(m - m_sub))
        d = tl.where(m == neg_inf, 0.0, m - m_sub)
        y = z - m_sub
        e = tl.exp2(y)
        ey = tl.where(e > 0.0, e * y, 0.0)  # 0 * -inf would be NaN
        se = tl.sum(e, 0)
        qe = tl.sum(e * e, 0)
        w = a * (w + d * s) + tl.sum(ey, 0)
        s = a * s + se
        q = a * a * q + qe
        m = m_new
        if HAS_TOPK:
            st = se
            qb = qe
            if (nxt < start + BLOCK_V) & (nxt < V):  # support ids in this block: sum without them
                et = e
                while (nxt < start + BLOCK_V) & (nxt < V):
                    et = tl.where(cols == nxt, 0.0, et)
                    ptr += 1
                    nxt = tl.load(sup_row + ptr)
                st = tl.sum(et, 0)
                qb = tl.sum(et * et, 0)
            t = a * t + st
            qt = a * a * qt + qb
    log2_s = tl.log2(s)
    m_fin = tl.where(m == neg_inf, 0.0, m)
    lse2 = m_fin + log2_s  # -inf when the whole row is -inf (s = 0)
    tl.store(LSE + row, lse2 * _LN2)
    tl.store(SUMP2 + row, q / (s * s))
    tl.store(ENT + row, (log2_s - w / s) * _LN2)
    if HAS_TOPK:
        lt2 = m_fin + tl.log2(t)
        p2t = qt / (s * s)
        if t < rescue:  # tail terms may have flushed to 0: again, with the tail's own max
            mt = tl.full((), neg_inf, tl.float32)
            tt = tl.zeros((), tl.float32)
            qq = tl.zeros((), tl.float32)
            ptr = tl.zeros((), tl.int64)
            nxt = tl.load(sup_row)
            for start in range(0, V, BLOCK_V):
                cols = start + offs
                z = tl.load(x_row + cols, mask=cols < V, other=neg_inf).to(tl.float32) * scale
                while (nxt < start + BLOCK_V) & (nxt < V):
                    z = tl.where(cols == nxt, neg_inf, z)
                    ptr += 1
                    nxt = tl.load(sup_row + ptr)
                mt_new = tl.maximum(mt, tl.max(z, 0))
                mt_sub = tl.where(mt_new == neg_inf, 0.0, mt_new)
                at = tl.where(mt == neg_inf, 0.0, tl.exp2(mt - mt_sub))
                et = tl.exp2(z - mt_sub)
                tt = at * tt + tl.sum(et, 0)
                qq = at * at * qq + tl.sum(et * et, 0)
                mt = mt_new
            mt_fin = tl.where(mt == neg_inf, 0.0, mt)
            lt2 = mt_fin + tl.log2(tt)
            p2t = tl.where(tt > 0.0, qq * tl.exp2(2.0 * (mt_fin - lse2)), 0.0)
        tl.store(LSE_TAIL + row, lt2 * _LN2)
        tl.store(P2_TAIL + row, p2t)
    k = tl.load(IDS + row)
    ok = (k >= 0) & (k < V)  # out-of-range ids give NaN instead of reading out of bounds
    zk = tl.load(x_row + k, mask=ok, other=float("nan")).to(tl.float32) * scale
    tl.store(LOGP + row, (zk - lse2) * _LN2)
    if HAS_TOPK:
        ko = tl.arange(0, BLOCK_K)
        kid = tl.load(TOPK + row * stride_tk + ko, mask=ko < K, other=0)
        kok = (kid >= 0) & (kid < V)
        zt = tl.load(x_row + kid, mask=(ko < K) & kok, other=float("nan")).to(tl.float32) * scale
        tl.store(TOPK_LOGP + row * stride_tl + ko, (zt - lse2) * _LN2, mask=ko < K)


def _logp_bwd(
    X, stride_x, IDS, LSE, G, DX, stride_dx, V, scale, inv_t,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    dx_row = DX + row * stride_dx
    offs = tl.arange(0, BLOCK_V)
    lse2 = tl.load(LSE + row) * _LOG2E
    g = tl.load(G + row).to(tl.float32) * inv_t
    k = tl.load(IDS + row)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        msk = cols < V
        z = tl.load(x_row + cols, mask=msk, other=float("-inf")).to(tl.float32) * scale
        p = tl.exp2(z - lse2)
        gz = g * (tl.where(cols == k, 1.0, 0.0) - p)
        gz = tl.where(g == 0.0, 0.0, gz)  # no upstream gradient (padding): 0 even for NaN/inf logits
        tl.store(dx_row + cols, gz.to(DX.dtype.element_ty), mask=msk)


_BUILT: dict[bool, tuple] = {}


def language_interpreted() -> bool:
    """Whether ``triton.language`` itself was imported in interpreter mode: Triton reads
    ``TRITON_INTERPRET`` when it decorates its own standard library (``tl.sum``...)."""
    return type(tl.sum).__name__ == "InterpretedFunction"


def _kernels():
    # Built lazily, and per mode, because triton.jit picks interpreter vs compiler from
    # TRITON_INTERPRET at decoration time.
    mode = interpreting()
    if mode != language_interpreted():
        raise RuntimeError(
            "TRITON_INTERPRET must have the same value when triton is first imported and when "
            f"the pdmask kernels run (now {int(mode)}, at import {int(language_interpreted())}); "
            "set it before anything imports triton"
        )
    if mode not in _BUILT:
        _BUILT[mode] = (triton.jit(_row_stats_fwd), triton.jit(_logp_bwd))
    return _BUILT[mode]


def _row_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def forward(logits: torch.Tensor, sampled_ids: torch.Tensor, topk_ids: torch.Tensor | None, *, temperature: float,
            rescue: float, block_v: int | None = None, num_warps: int | None = None) -> dict[str, torch.Tensor]:
    """Launch the forward kernel on (N, V) logits, (N,) and (N, K) int64 ids; returns float32 ``lse, logp, sum_p2, entropy`` and with
    ``topk_ids`` also ``topk_logp, lse_tail, sum_p2_tail``; rows whose tail sum falls below
    ``rescue`` (:func:`pdmask.ops.tail_rescue_below`) walk again with the tail's own max."""
    fwd, _ = _kernels()
    logits = _row_major(logits)
    N, V = logits.shape
    dev = logits.device
    f32 = torch.float32
    lse, logp, sp2, ent = (torch.empty(N, dtype=f32, device=dev) for _ in range(4))
    ids = sampled_ids.contiguous()
    has_topk = topk_ids is not None
    if has_topk:
        tk = _row_major(topk_ids)
        K = tk.shape[1]
        tlp = torch.empty(N, K, dtype=f32, device=dev)
        lt, p2t = (torch.empty(N, dtype=f32, device=dev) for _ in range(2))
        # S' = topK ∪ {k}, sorted, then the sentinel V that stops the kernel's walk
        sup = torch.cat([tk, ids[:, None], torch.full_like(ids[:, None], V)], 1).sort(1).values.contiguous()
    else:  # placeholders (HAS_TOPK is a compile-time False: only sup's first id is loaded, unused)
        K, tk, tlp, lt, p2t, sup = 1, ids[:, None], lse[:, None], lse, lse, ids[:, None]
    out = {"lse": lse, "logp": logp, "sum_p2": sp2, "entropy": ent}
    if has_topk:
        out.update(topk_logp=tlp, lse_tail=lt, sum_p2_tail=p2t)
    if N == 0:
        return out
    bv = block_v or min(FWD_BLOCK_V, triton.next_power_of_2(V))
    fwd[(N,)](
        logits, logits.stride(0), ids, tk, tk.stride(0), lse, logp, sp2, ent, tlp, tlp.stride(0),
        sup, sup.stride(0), lt, p2t,
        V, K, LOG2E / temperature, rescue,
        BLOCK_V=bv, BLOCK_K=triton.next_power_of_2(K), HAS_TOPK=has_topk,
        num_warps=num_warps or NUM_WARPS,
    )
    return out


def backward(logits: torch.Tensor, sampled_ids: torch.Tensor, lse: torch.Tensor, grad_logp: torch.Tensor, *,
             temperature: float, block_v: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """Launch the backward kernel: ``grad_logp (e_k - softmax(logits / T)) / T`` (``lse`` float32)."""
    _, bwd = _kernels()
    logits = _row_major(logits)
    N, V = logits.shape
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    if N == 0:
        return grad
    # rows with a non-finite lse (all -inf padding) get p = 2^(z - inf) = 0, not NaN
    lse = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, math.inf)).contiguous()
    bv = block_v or min(BWD_BLOCK_V, triton.next_power_of_2(V))
    bwd[(N,)](
        logits, logits.stride(0), sampled_ids.contiguous(), lse, grad_logp.contiguous(), grad,
        grad.stride(0), V, LOG2E / temperature, 1.0 / temperature,
        BLOCK_V=bv, num_warps=num_warps or NUM_WARPS,
    )
    return grad
