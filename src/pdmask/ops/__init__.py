"""Row reductions over the vocabulary: the only code of the library that reads (N, V).

:func:`row_stats` reduces a *row source* -- (N, V) logits, or :class:`Hidden` states with
the LM-head weight, whose logits exist one chunk of rows at a time -- to :class:`Reductions`
of ``pi = softmax(z / T)``, through one ``autograd.Function`` (:class:`_LogProb`: ``logp``
carries the gradient ``G = g (e_k - pi) / T``; ``dh = G W``, ``dW = G^T h``) and one chunk rule
(:func:`rows_per_chunk`). Backends (``Compute.impl``): ``"torch"`` (below), ``"triton"`` (CUDA
logits; :mod:`pdmask.ops._kernel`, imported when used), ``"auto"``; truncated sampling is the
torch backend over the kept set (:mod:`pdmask.ops._truncate`). The plain-torch oracle every
path is tested against lives with the tests (``tests/ops/reference.py``); docs/ops.md.

Torch backend, per chunk with ``z = x * (1/T)`` (compute dtype) and ``m`` its row max::

    y = z - m,  e = exp(y),  s = sum e,  q = sum e^2,  w = sum e y
    lse = m + log s,  sum_p2 = q / s^2,  entropy = log s - w / s,  logp = z_k - m - log s

with the tail of ``S' = topK ∪ {k}`` summed on its own (the support entries of e zeroed):
``lse_tail = m + log t``, ``sum_p2_tail = qt / s^2``, never ``s`` minus the support.
Naive torch: ``logq = log_softmax(logits.float() / T, -1)``, ``logp = logq.gather(1, k[:, None])``,
``sum_p2 = logq.exp().pow(2).sum(-1)``, ``lse_tail = logsumexp(z.masked_fill(~tail, -inf), -1)``.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field, fields, replace
from functools import lru_cache

import torch
from torch.autograd.function import once_differentiable

from .._validate import SpecError, check_choice, check_chunk_size
from ..divergences import floor_log
from ._shared import interpreting, tail_rows

IMPLS = ("auto", "torch", "triton")
#: Elements of one (rows, V) chunk of logits. CPU: 4 Mi (16 MiB of float32): enough rows that
#: a hidden-state source's matmul is not starved (it reads the LM head once per chunk), few
#: enough for the reductions to stay near the cache. GPU: 16 Mi; the chunk only bounds memory.
CHUNK_ELEMENTS = {"cpu": 1 << 22, "cuda": 1 << 24}


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else (bf16, fp16, fp32) is reduced in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rows_per_chunk(vocab_size: int, chunk_rows: int | None = None, device="cpu") -> int:
    """The one chunk rule: ``chunk_rows`` when given, else :data:`CHUNK_ELEMENTS` of the
    device divided by the vocabulary size."""
    check_chunk_size("chunk_rows", chunk_rows)
    if chunk_rows is not None:
        return chunk_rows
    budget = CHUNK_ELEMENTS["cuda" if torch.device(device).type == "cuda" else "cpu"]
    return max(1, budget // max(vocab_size, 1))


@lru_cache(maxsize=1)
def triton_available() -> bool:
    """Whether the optional ``triton`` package is installed (not imported here)."""
    return importlib.util.find_spec("triton") is not None


@dataclass(frozen=True)
class Compute:
    """How the vocabulary reductions run (no effect on the numbers beyond rounding):
    ``impl`` one of :data:`IMPLS`; ``chunk_rows`` rows per chunk (None: :func:`rows_per_chunk`)."""

    impl: str = "auto"
    chunk_rows: int | None = None

    def __post_init__(self) -> None:
        check_choice("impl", self.impl, IMPLS)
        check_chunk_size("chunk_rows", self.chunk_rows)


@dataclass(frozen=True)
class Sampling:
    """The engine's sampling distribution: ``pi = softmax(logits / temperature)``, truncated
    by ``top_k``, ``top_p``, ``min_p`` (vLLM's names and order; :mod:`pdmask.ops._truncate`).
    vLLM's "off" values are stored as None: ``top_k`` 0 or -1, ``top_p`` 1, ``min_p`` 0.
    Naive equivalent of the truncation: :func:`sampling_kept_mask`."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0 or math.isinf(t):
            raise SpecError("temperature", f"must be a positive finite number, got {t!r}")
        k = self.top_k
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < -1):
            raise SpecError("top_k", f"expected an int >= 1 (0, -1 or None: off), got {k!r}")
        for name, lo_open in (("top_p", True), ("min_p", False)):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1
                                  or (lo_open and v == 0)):
                raise SpecError(name, f"expected a number in {'(0, 1]' if lo_open else '[0, 1]'}, got {v!r}")
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_k", None if k in (None, 0, -1) else int(k))
        object.__setattr__(self, "top_p", None if self.top_p in (None, 1) else float(self.top_p))
        object.__setattr__(self, "min_p", None if self.min_p in (None, 0) else float(self.min_p))

    @property
    def truncated(self) -> bool:
        """Some truncation rule is in force."""
        return self.top_k is not None or self.top_p is not None or self.min_p is not None


def sampling_kept_mask(scaled_logits: torch.Tensor, *, top_k: int | None = None, top_p: float | None = None,
                       min_p: float | None = None) -> torch.Tensor:
    """(N, V) bool: the tokens top-k / top-p / min-p sampling keeps from temperature-scaled
    logits, in vLLM's order (:mod:`pdmask.ops._truncate`); all True when every rule is off."""
    from ._truncate import rule_threshold

    s = Sampling(top_k=top_k, top_p=top_p, min_p=min_p)
    if not s.truncated:
        return torch.ones(scaled_logits.shape, dtype=torch.bool, device=scaled_logits.device)
    return scaled_logits >= rule_threshold(scaled_logits, s)[:, None]


@dataclass(frozen=True)
class Hidden:
    """A row source without logits: final hidden states ``hidden`` (..., H) and the LM-head
    ``weight`` (V, H) (same dtype and device; no bias, no soft-capping): ``hidden @ weight.T``."""

    hidden: torch.Tensor
    weight: torch.Tensor

    def __post_init__(self) -> None:
        h, w = self.hidden, self.weight
        if not isinstance(h, torch.Tensor) or not h.is_floating_point() or h.dim() < 2:
            raise SpecError("hidden", "expected a floating-point (..., H) tensor, got "
                                      f"{getattr(h, 'dtype', type(h).__name__)} {tuple(getattr(h, 'shape', ()))}")
        H = h.shape[-1]
        if not isinstance(w, torch.Tensor) or not w.is_floating_point() or w.dim() != 2 or w.shape[1] != H \
                or w.shape[0] < 1:
            raise SpecError("lm_head_weight", f"expected a floating-point (V, {H}) tensor (H of hidden), got "
                                              f"{getattr(w, 'dtype', type(w).__name__)} {tuple(getattr(w, 'shape', ()))}")
        if w.dtype != h.dtype or w.device != h.device:
            raise SpecError("lm_head_weight", f"must have the dtype and device of hidden ({h.dtype}, {h.device}), "
                                              f"got {w.dtype}, {w.device}")


def _out(pad):
    """A :class:`Reductions` field: None when not computed; ``pad(V)`` is its value on padding
    rows, that of a uniform pi = mu (:meth:`Reductions.padded`)."""
    return field(default=None, metadata={"pad": pad})


@dataclass(frozen=True, eq=False)
class Reductions:
    """Row reductions of ``pi = softmax(z / T)`` (module docstring), float32 (float64 for
    float64 input); ``logp`` differentiable, the rest detached. With the top-K: ``topk_logp``
    (N, K), the tail of ``S'`` (``log pi_T = lse_tail - lse``, -inf when empty; ``sum_p2_tail``).
    With mu's full logits: ``full_kl``, ``full_tv``, ``full_mu_k``, ``sum_p_mu`` = sum pi mu,
    ``sum_p_s`` = sum pi s, ``sum_p2_s`` = sum pi^2 s (``s = 1/2 sign(pi - mu)``). Truncated
    (pi over the kept set S): ``kept_mass`` = pi(S), ``kept_size`` = |S|, ``sampled_outside``."""

    lse: torch.Tensor = _out(lambda V: 0.0)
    logp: torch.Tensor = _out(lambda V: -math.log(V))
    sum_p2: torch.Tensor = _out(lambda V: 1.0 / V)
    entropy: torch.Tensor = _out(lambda V: math.log(V))
    topk_logp: torch.Tensor | None = _out(lambda V: -math.log(V))
    lse_tail: torch.Tensor | None = _out(lambda V: -math.log(V))
    sum_p2_tail: torch.Tensor | None = _out(lambda V: 0.0)
    full_kl: torch.Tensor | None = _out(lambda V: 0.0)
    full_tv: torch.Tensor | None = _out(lambda V: 0.0)
    full_mu_k: torch.Tensor | None = _out(lambda V: 1.0 / V)
    sum_p_mu: torch.Tensor | None = _out(lambda V: 1.0 / V)
    sum_p_s: torch.Tensor | None = _out(lambda V: 0.0)
    sum_p2_s: torch.Tensor | None = _out(lambda V: 0.0)
    kept_mass: torch.Tensor | None = _out(lambda V: 1.0)
    kept_size: torch.Tensor | None = _out(lambda V: float(V))
    sampled_outside: torch.Tensor | None = _out(lambda V: False)

    def padded(self, valid: torch.Tensor, V: int) -> "Reductions":
        """Padding rows (``~valid``) replaced by those of a uniform pi = mu. Padding logits may
        hold anything (NaN, inf); ``where`` cuts the value and the gradient path there."""
        if not valid.is_cuda and bool(valid.all()):
            return self  # CPU without padding: nothing to replace (the test is free on CPU)
        out = {}
        for f in fields(self):
            x = getattr(self, f.name)
            if x is not None:
                m = valid if x.dim() == 1 else valid[:, None]
                out[f.name] = torch.where(m, x, torch.full_like(x, f.metadata["pad"](V)))
        return replace(self, **out)


# ------------------------------------------------------------------ the torch backend
def support_ids(topk_ids: torch.Tensor, sampled_ids: torch.Tensor) -> torch.Tensor:
    """(N, K+1) the ids of ``S' = topK ∪ {k}`` (k repeated when it is in the top-K)."""
    return torch.cat([topk_ids, sampled_ids[:, None]], 1)


def tail_rescue_below(dtype: torch.dtype, vocab_size: int) -> float:
    """A tail sum ``t = sum_{tail} exp(z - m)`` below this may have lost terms to underflow
    (together at most ``V tiny``, one ulp of t only while ``t >= V tiny / eps``)."""
    fi = torch.finfo(compute_dtype(dtype))
    return vocab_size * fi.tiny / fi.eps


def full_terms(logq, p, rollout_z, sampled_ids) -> dict[str, torch.Tensor]:
    """The full-vocabulary fields of :class:`Reductions` for rows of ``log pi``, ``pi`` and the
    rollout's scaled logits (logs floored as in :mod:`pdmask.divergences`)."""
    logm = torch.log_softmax(rollout_z, -1)
    m = logm.exp()
    kl = torch.where(m > 0, m * (floor_log(logm) - floor_log(logq)), torch.zeros_like(m))
    sgn = 0.5 * torch.sign(p - m)
    return {"full_kl": kl.sum(-1).clamp(min=0.0), "full_tv": 0.5 * (p - m).abs().sum(-1),
            "full_mu_k": m.gather(1, sampled_ids[:, None]).squeeze(1), "sum_p_mu": (p * m).sum(-1),
            "sum_p_s": (p * sgn).sum(-1), "sum_p2_s": (p * p * sgn).sum(-1)}


class _Job:
    """One reduction: what every chunk needs, in the forward and again in the backward."""

    def __init__(self, x, w, ids, topk, sampling: Sampling, chunk_rows, impl, rollout_logits, kept_mask):
        self.N, self.V = x.shape[0], (x.shape[1] if w is None else w.shape[0])
        self.cdt, self.temperature, self.c = compute_dtype(x.dtype), sampling.temperature, 1.0 / sampling.temperature
        self.ids, self.topk, self.impl = ids, topk, impl
        self.sup = None if topk is None else support_ids(topk, ids)
        self.step = rows_per_chunk(self.V, chunk_rows, x.device)
        self.sampling = sampling if sampling.truncated else None
        self.kept_mask, self.rollout_logits = kept_mask, rollout_logits
        self.truncated = self.sampling is not None or kept_mask is not None
        self.rescue = tail_rescue_below(x.dtype, self.V)
        self.tau = self.result = None  # the kept sets' thresholds (truncated); the forward's Reductions

    def logits(self, x, w, a, b):
        """The source's logits of rows ``a:b`` in the model's dtype (the same call in both passes)."""
        return x[a:b] if w is None else x[a:b] @ w.T

    def forward(self, x, w) -> Reductions:
        if self.impl == "triton":
            from . import _kernel

            red = Reductions(**_kernel.forward(x, self.ids, self.topk, temperature=self.temperature,
                                               rescue=tail_rescue_below(torch.float32, self.V)))
            if self.rollout_logits is not None:  # no Triton pass for them: torch reads the logits again
                full = _Job(x, None, self.ids, None, Sampling(self.temperature), None, "torch", self.rollout_logits,
                            None)
                red = replace(red, **{f: getattr(full.forward(x, None), f) for f in _FULL})
            return red
        if self.truncated:
            from ._truncate import forward

            return Reductions(**forward(self, x, w))
        return _torch_forward(self, x, w)

    def backward(self, x, w, lse, g, need_x: bool, need_w: bool):
        if self.impl == "triton":
            from . import _kernel

            return _kernel.backward(x, self.ids, lse, g, temperature=self.temperature), None
        return _torch_backward(self, x, w, lse, g, need_x, need_w)


_FULL = ("full_kl", "full_tv", "full_mu_k", "sum_p_mu", "sum_p_s", "sum_p2_s")


def _logp_at(x, ids, m, log_s, c) -> torch.Tensor:
    """``z_ids - m - log s`` (r, J), gathered from the input (so -inf stays -inf)."""
    xg = x.gather(1, ids).to(m.dtype)
    if c != 1.0:
        xg.mul_(c)
    return xg.sub_(m).sub_(log_s)


def _chunk(job: _Job, z, a, b, y, e, o) -> None:
    """The torch backend on rows ``a:b`` (logits ``z``, buffers ``y``, ``e``) into ``o``."""
    c, cdt = job.c, job.cdt
    m = torch.empty(b - a, 1, dtype=cdt, device=z.device)
    # an all -inf row has max -inf: shifted by 0 instead, so that x - m stays -inf (not NaN)
    # and s = 0 gives lse = -inf, which the caller reports (as torch.logsumexp does)
    if z.dtype == cdt and c == 1.0:
        torch.amax(z, -1, keepdim=True, out=m).masked_fill_(m == float("-inf"), 0.0)
        torch.sub(z, m, out=y)
    else:  # upcast (and scale) into the buffer first: float32 is the fast path on CPU
        if z.dtype == cdt:
            torch.mul(z, c, out=y)
        else:
            y.copy_(z)
            if c != 1.0:
                y.mul_(c)
        torch.amax(y, -1, keepdim=True, out=m).masked_fill_(m == float("-inf"), 0.0)
        y.sub_(m)
    torch.exp(y, out=e)
    s = e.sum(-1)
    if job.rollout_logits is not None:  # before y and e are overwritten below
        sc = s[:, None]
        terms = full_terms(y - sc.log(), e / sc, job.rollout_logits[a:b].to(cdt) / job.temperature, job.ids[a:b])
        for k, v in terms.items():
            o[k][a:b] = v
    if job.sup is not None:  # the tail's sum: the K+1 support entries zeroed, then put back
        ids_s = job.sup[a:b]
        es = e.gather(1, ids_s)
        e.scatter_(1, ids_s, 0.0)
        o["t"][a:b] = e.sum(-1)
        e.scatter_(1, ids_s, es)
    y.mul_(e)  # e y; NaN where x = -inf (0 * -inf), fixed after the pass
    o["w"][a:b] = y.sum(-1)
    e.mul_(e)
    o["q"][a:b] = e.sum(-1)
    if job.sup is not None:  # e holds e^2 now: the tail's with the support zeroed again
        e.scatter_(1, ids_s, 0.0)
        o["qt"][a:b] = e.sum(-1)
    o["m"][a:b], o["s"][a:b] = m, s
    o["logp"][a:b] = _logp_at(z, job.ids[a:b, None], m, s.log()[:, None], c).squeeze(1)
    if job.topk is not None:
        o["topk_logp"][a:b] = _logp_at(z, job.topk[a:b], m, s.log()[:, None], c)


def _redo(job: _Job, x, w, bad: torch.Tensor, fn) -> None:
    """``fn(z, rows)`` on the rare rows flagged ``bad`` (one sync): ``z`` their scaled logits,
    made again by the very call of the pass (the same bits)."""
    if not bool(bad.any()):
        return
    rows = bad.nonzero().squeeze(1)
    for a in sorted(set((rows - rows % job.step).tolist())):
        r = rows[(rows >= a) & (rows < a + job.step)]
        z = job.logits(x, w, a, a + job.step)[r - a].to(job.cdt)
        fn(z.mul_(job.c) if job.c != 1.0 else z, r)


def _torch_forward(job: _Job, x, w) -> Reductions:
    N, V, cdt, dev = job.N, job.V, job.cdt, x.device
    names = ["m", "s", "q", "w", "logp"] + (["t", "qt"] if job.sup is not None else []) \
        + (list(_FULL) if job.rollout_logits is not None else [])
    o = {k: torch.empty(N, dtype=cdt, device=dev) for k in names}
    o["m"] = o["m"][:, None]
    if job.topk is not None:
        o["topk_logp"] = torch.empty(job.topk.shape, dtype=cdt, device=dev)
    rows = min(job.step, N)
    ybuf, ebuf = (torch.empty(rows, V, dtype=cdt, device=dev) for _ in range(2))
    for a in range(0, N, job.step):
        b = min(a + job.step, N)
        _chunk(job, job.logits(x, w, a, b), a, b, ybuf[: b - a], ebuf[: b - a], o)
    del ybuf, ebuf
    m, s, wsum = o["m"], o["s"], o["w"]

    def fix_w(y, r):  # a -inf logit made 0 * -inf = NaN in w (s finite positive: the row is not NaN)
        y.sub_(m[r])
        e = y.exp()
        wsum[r] = torch.where(e > 0, e * y, torch.zeros_like(y)).sum(-1)

    _redo(job, x, w, torch.isnan(wsum) & (s > 0) & torch.isfinite(s), fix_w)
    log_s = s.log()
    lse = m.squeeze(1) + log_s
    red = Reductions(lse=lse, logp=o["logp"], sum_p2=o["q"] / (s * s), entropy=log_s - wsum / s,
                     **{k: o[k] for k in _FULL if k in o})
    if job.sup is None:
        return red
    lse_tail, p2_tail = m.squeeze(1) + o["t"].log(), o["qt"] / (s * s)

    def rescue(z, r):  # underflowed tail terms could matter: the tail with its own max
        lse_tail[r], p2_tail[r] = tail_rows(z, job.sup[r], lse[r])

    _redo(job, x, w, o["t"] < job.rescue, rescue)
    return replace(red, topk_logp=o["topk_logp"], lse_tail=lse_tail, sum_p2_tail=p2_tail)


def _torch_backward(job: _Job, x, w, lse, g, need_x: bool, need_w: bool):
    """``G = g (e_k - pi) / T`` chunk by chunk (pi over the kept set when truncated): the
    logits' gradient in their dtype (in place for float32/float64), or ``dh = G W`` and
    ``dW = G^T h`` (accumulated in float32) for hidden states."""
    cdt, c = lse.dtype, job.c
    if job.truncated:
        from ._truncate import members
    lse = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, math.inf))  # all -inf rows: pi = 0
    gc = g.to(cdt) * c
    # rows without upstream gradient (padding) get exactly 0, whatever their logits hold (NaN * 0 is NaN)
    zero = gc == 0
    zero = zero if bool(zero.any()) else None
    if w is None:
        grad = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        buf = None if x.dtype == cdt else torch.empty(min(job.step, job.N), job.V, dtype=cdt, device=x.device)
    else:
        dx = torch.empty_like(x) if need_x else None
        dw = torch.zeros(w.shape, dtype=cdt, device=w.device) if need_w else None
        x_live = x if zero is None or not need_w else torch.where(zero[:, None], torch.zeros_like(x), x)
        buf = torch.empty(min(job.step, job.N), job.V, dtype=cdt, device=x.device)
    for a in range(0, job.N, job.step):
        b = min(a + job.step, job.N)
        z = job.logits(x, w, a, b)
        G = grad[a:b] if buf is None else buf[: b - a]
        ins = None if not job.truncated else members(job, z, a, b)
        if G.dtype == z.dtype and c == 1.0:
            torch.sub(z, lse[a:b, None], out=G)
        else:
            G.copy_(z)
            if c != 1.0:
                G.mul_(c)
            G.sub_(lse[a:b, None])
        G.exp_()
        if ins is not None:
            G.masked_fill_(~ins, 0.0)
        G.mul_(gc[a:b, None].neg())  # -g p / T
        G.scatter_add_(1, job.ids[a:b, None], gc[a:b, None])  # + g e_k / T
        if zero is not None:
            G.masked_fill_(zero[a:b, None], 0.0)
        if w is None:
            if buf is not None:
                grad[a:b].copy_(G)
            continue
        if need_x:
            dx[a:b] = G.to(x.dtype) @ w  # as autograd through the logits would
        if need_w:
            dw.addmm_(G.T, x_live[a:b].to(cdt))
    if w is None:
        return grad, None
    return dx, (dw.to(w.dtype) if need_w else None)


class _LogProb(torch.autograd.Function):
    """``logp = log pi_k`` of a row source, every other reduction computed on the side
    (``job.result``, detached). Backward: the torch backend's or the Triton kernel's ``G``."""

    @staticmethod
    def forward(ctx, x, w, job: _Job):
        job.result = red = job.forward(x, w)
        job.rollout_logits = None  # the backward needs only the source, the ids and lse
        ctx.save_for_backward(x, w, red.lse)
        ctx.job = job
        return red.logp

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        x, w, lse = ctx.saved_tensors
        gx, gw = ctx.job.backward(x, w, lse, g, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return gx, gw, None


# ------------------------------------------------------------------ the entry point
def check_truncation(impl: str, sampling: Sampling, kept_mask, rollout_logits, *, prefix: str = "") -> bool:
    """The rules of truncated sampling, in one place: not both a kept set and the truncation
    parameters, no full-vocabulary terms, no Triton. Returns whether the reduction is
    truncated. ``prefix`` (``"rollout."``) names the tensors as the caller holds them."""
    if kept_mask is not None and sampling.truncated:
        raise SpecError(f"{prefix}kept_mask", "give either the engine's kept set or the truncation parameters "
                                              "(top_k / top_p / min_p), not both")
    truncated = sampling.truncated or kept_mask is not None
    if truncated and rollout_logits is not None:
        raise SpecError(f"{prefix}logits" if prefix else "rollout_logits",
                        "the full-vocabulary terms are not available with truncated sampling")
    if truncated and impl == "triton":
        raise SpecError("impl", "'triton' has no kernel for truncated sampling; use impl='torch' or 'auto'")
    return truncated


def resolve_impl(impl: str, x: torch.Tensor, *, truncated: bool = False, hidden: bool = False) -> str:
    """The backend ``impl`` stands for on this source (``"auto"`` resolved); Triton's needs checked."""
    check_choice("impl", impl, IMPLS)
    if impl == "auto":
        ok = x.is_cuda and x.dtype in (torch.float16, torch.bfloat16, torch.float32) and triton_available()
        return "triton" if ok and not truncated and not hidden else "torch"
    if impl == "triton":
        if hidden:
            raise SpecError("impl", "'triton' reduces logits; hidden states run on 'torch' (leave impl='auto')")
        if not triton_available():
            where = "" if x.is_cuda else " and CUDA logits (on CPU use impl='torch' or 'auto')"
            raise SpecError("impl", f"'triton' needs the optional triton package (pip install -e '.[triton]' from a pdmask checkout){where}")
        if not x.is_cuda and not interpreting():
            raise SpecError("impl", f"'triton' needs CUDA tensors (got logits on {x.device}); on CPU use impl='torch' "
                                    "or 'auto', or set TRITON_INTERPRET=1 before triton is first imported to run "
                                    "the kernel in Triton's (slow) interpreter")
        if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise SpecError("logits", f"impl='triton' supports float16/bfloat16/float32, got {x.dtype}")
    return impl


def _check_ids(name, t, N, V, values: bool, two_d: bool) -> None:
    if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise SpecError(name, "expected an integer tensor of token ids")
    if (two_d and (t.dim() != 2 or t.shape[0] != N or t.shape[1] < 1)) or (not two_d and tuple(t.shape) != (N,)):
        raise SpecError(name, f"expected shape {(N, 'K') if two_d else (N,)}{' with K >= 1' if two_d else ''}, "
                              f"got {tuple(t.shape)}")
    if values and t.numel() and bool(((t < 0) | (t >= V)).any()):
        raise SpecError(name, f"ids must lie in [0, {V})")


def row_stats(source, sampled_ids: torch.Tensor, topk_ids: torch.Tensor | None = None, *,
              sampling: Sampling | None = None, compute: Compute | None = None,
              rollout_logits: torch.Tensor | None = None, kept_mask: torch.Tensor | None = None,
              validate: bool = True) -> Reductions:
    """:class:`Reductions` of ``pi = softmax(z / sampling.temperature)`` over the rows of ``source``
    ((N, V) logits, or :class:`Hidden`); ``sampling``'s truncation or ``kept_mask`` renormalises pi
    over the kept set, ``rollout_logits`` (mu's) adds the full-vocabulary fields; ``validate``
    checks the id ranges (Triton reads NaN for a bad id)."""
    sampling = Sampling() if sampling is None else sampling
    compute = Compute() if compute is None else compute
    x, w = (source.hidden, source.weight) if isinstance(source, Hidden) else (source, None)
    if w is None and (not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() != 2):
        raise SpecError("logits", "expected a floating-point (N, V) tensor, got "
                                  f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    if w is not None and x.dim() != 2:
        raise SpecError("hidden", f"expected (N, H) rows, got shape {tuple(x.shape)}")
    N, V = x.shape[0], (x.shape[1] if w is None else w.shape[0])
    if V < 1:
        raise SpecError("logits", "the vocabulary dimension is empty")
    _check_ids("sampled_ids", sampled_ids, N, V, validate, False)
    if topk_ids is not None:
        _check_ids("topk_ids", topk_ids, N, V, validate, True)
    for name, t, what in (("rollout_logits", rollout_logits, "a floating-point"), ("kept_mask", kept_mask, "a bool")):
        if t is not None and (not isinstance(t, torch.Tensor) or (t.dtype == torch.bool) != (name == "kept_mask")
                              or not (name == "kept_mask" or t.is_floating_point())):
            raise SpecError(name, f"expected {what} tensor, got {getattr(t, 'dtype', type(t).__name__)}")
        if t is not None and tuple(t.shape) != (N, V):
            raise SpecError(name, f"expected shape {(N, V)} (the logits'), got {tuple(t.shape)}")
    truncated = check_truncation(compute.impl, sampling, kept_mask, rollout_logits)
    impl = resolve_impl(compute.impl, x, truncated=truncated, hidden=w is not None)
    tk = None if topk_ids is None else topk_ids.long()
    job = _Job(x, w, sampled_ids.long(), tk, sampling, compute.chunk_rows, impl, rollout_logits, kept_mask)
    if not (torch.is_grad_enabled() and (x.requires_grad or (w is not None and w.requires_grad))):
        return job.forward(x.detach(), None if w is None else w.detach())
    logp = _LogProb.apply(x, w, job)
    red, job.result = job.result, None  # (the job stays with the graph; the result would tie it in a cycle)
    return replace(red, logp=logp)


__all__ = ["CHUNK_ELEMENTS", "IMPLS", "Compute", "Hidden", "Reductions", "Sampling", "check_truncation",
           "compute_dtype", "full_terms", "interpreting", "resolve_impl", "row_stats",
           "rows_per_chunk", "sampling_kept_mask", "support_ids", "tail_rescue_below", "tail_rows",
           "triton_available"]
