"""Truncated sampling: row statistics of pi renormalised over the engine's kept set.

With top-k / top-p / min-p sampling the engine samples from, and reports the log-probs of,
``mu' = mu / mu(S)`` on its kept set ``S`` (vLLM ``processed_logprobs``). Comparing that
with the trainer's full-vocabulary ``pi`` biases the ratio: ``E_{k ~ mu'}[pi_k / mu'_k] =
pi(S) < 1`` on-policy. The matching trainer policy is ``pi' = pi / pi(S)`` on ``S``::

    log pi'_k = z_k / T - lse_S,   lse_S = log sum_{i in S} exp(z_i / T)
    d log pi'_k / dz = (e_k - pi') / T        (pi' = 0 outside S)

``S`` is either given (``kept_mask`` (N, V) bool, the engine's own set) or rebuilt on the
trainer's logits from the sampling parameters, in vLLM's order (``vllm/v1/sample``):

1. temperature: ``y = z / T``;
2. min-p: keep ``p_i >= min_p * max p`` (i.e. ``y_i >= max y + log min_p``);
3. top-k: keep ``y_i >=`` the k-th largest ``y`` (ties at the k-th value kept);
4. top-p: over the survivors, sorted ascending, drop the prefix whose cumulative
   renormalised probability is ``<= 1 - top_p`` (the largest token always stays).

Every rule keeps the tokens at or above a per-row threshold ``tau``, so the rebuilt set
is ``{i: y_i >= tau}`` (one float per row to keep for the backward). The sampled token
always joins ``S``: the engine drew it, so it was in the engine's set; a token the
trainer's rule would have dropped is counted in ``sampled_outside``.

Outputs beyond :data:`pdmask.ops.KEYS` (all statistics are those of ``pi'``; ``lse`` is
``lse_S``): ``kept_mass`` = ``pi(S)`` (the full-vocabulary mass kept: the on-policy mean
of the uncorrected ratio), ``kept_size`` = ``|S|``, ``sampled_outside`` (bool).
Top-K ids outside ``S`` get ``topk_logp = -inf``; the tail keys (``lse_tail``,
``sum_p2_tail``) are those of the kept tokens outside ``topK ∪ {k}``, summed on their own
as in :mod:`pdmask.ops._torch`.

Peak extra memory: a few (rows, V) chunk buffers (the top-p sort included), never (N, V).
Naive equivalent: :func:`pdmask.ops._reference.truncated_row_stats` (the oracle).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._autograd import KEYS, as_dict
from ._reference import compute_dtype, support_ids, tail_rescue_below, tail_rows
from ._torch import rows_per_chunk

#: Extra outputs of a truncated reduction (see the module docstring).
TRUNC_KEYS = ("kept_mass", "kept_size", "sampled_outside")


@dataclass(frozen=True)
class Sampling:
    """The engine's sampling distribution: temperature and truncation (vLLM's names and order).

    ``pi = softmax(logits / temperature)``; ``top_k``, ``top_p``, ``min_p`` truncate it
    (module docstring). vLLM's "off" values are accepted and stored as None: ``top_k``
    None, 0 or -1; ``top_p`` None or 1; ``min_p`` None or 0. Checked here, once: an error
    names the field (``top_p: ...``). Naive equivalent of the truncation:
    :func:`pdmask.ops.sampling_kept_mask`.
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0 or math.isinf(t):
            raise ValueError(f"temperature: must be a positive finite number, got {t!r}")
        k = self.top_k
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < -1):
            raise ValueError(f"top_k: expected an int >= 1 (0, -1 or None: off), got {k!r}")
        for name in ("top_p", "min_p"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1
                                  or (name == "top_p" and v == 0)):
                rng = "(0, 1]" if name == "top_p" else "[0, 1]"
                raise ValueError(f"{name}: expected a number in {rng}, got {v!r}")
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_k", None if k in (None, 0, -1) else int(k))
        object.__setattr__(self, "top_p", None if self.top_p is None or self.top_p == 1 else float(self.top_p))
        object.__setattr__(self, "min_p", None if self.min_p is None or self.min_p == 0 else float(self.min_p))

    @property
    def truncated(self) -> bool:
        """Some truncation rule is in force."""
        return self.top_k is not None or self.top_p is not None or self.min_p is not None


def rule_threshold(y: torch.Tensor, s: Sampling) -> torch.Tensor:
    """Per-row threshold ``tau`` (rows,) of the kept set ``{y >= tau}`` of temperature-scaled
    logits ``y`` (rows, V), rules applied in vLLM's order (module docstring)."""
    V = y.shape[1]
    tau = torch.full(y.shape[:1], -math.inf, dtype=y.dtype, device=y.device)
    if s.min_p is not None:
        tau = y.amax(-1) + math.log(s.min_p)
    if s.top_k is not None and s.top_k < V:
        tau = torch.maximum(tau, y.topk(s.top_k, dim=-1).values[:, -1])
    if s.top_p is not None:
        ys = y.masked_fill(y < tau[:, None], -math.inf).sort(dim=-1).values  # ascending
        cum = ys.softmax(-1).cumsum_(-1)
        drop = cum <= 1 - s.top_p
        drop[:, -1] = False  # the largest token always stays
        tau = ys.gather(1, drop.sum(-1, keepdim=True)).squeeze(1)
    return tau


def _members(y, ids, tau, mask):
    """(rows, V) bool membership before the sampled token is forced in."""
    return mask.clone() if mask is not None else y >= tau[:, None]


def forward(logits, sampled_ids, topk_ids, *, temperature, chunk_rows, sampling=None, kept_mask=None):
    """Statistics of ``pi'`` (module docstring) in row chunks; also returns ``tau`` (N,)
    (``-inf`` with ``kept_mask``), which the backward needs."""
    N, V = logits.shape
    cdt = compute_dtype(logits.dtype)
    dev = logits.device
    c = 1.0 / temperature
    step = rows_per_chunk(V, chunk_rows, dev)
    out = {k: torch.empty(N, dtype=cdt, device=dev)
           for k in ("lse", "logp", "sum_p2", "entropy", "kept_mass", "kept_size")}
    outside = torch.empty(N, dtype=torch.bool, device=dev)
    tau = torch.full((N,), -math.inf, dtype=cdt, device=dev)
    tk_out = None if topk_ids is None else torch.empty(topk_ids.shape, dtype=cdt, device=dev)
    if topk_ids is not None:
        sup = support_ids(topk_ids, sampled_ids)
        tail = {k: torch.empty(N, dtype=cdt, device=dev) for k in ("lse_tail", "sum_p2_tail")}
        rescue = tail_rescue_below(logits.dtype, V)
    for a in range(0, N, step):
        b = min(a + step, N)
        y = logits[a:b].to(cdt, copy=True).mul_(c)  # (rows, V) chunk copy; the exp is the other buffer
        mask = None if kept_mask is None else kept_mask[a:b]
        if mask is None:
            tau[a:b] = rule_threshold(y, sampling)
        ins = _members(y, None, tau[a:b], mask)
        kk = sampled_ids[a:b, None]
        outside[a:b] = ~ins.gather(1, kk).squeeze(1)
        ins.scatter_(1, kk, True)
        m = y.masked_fill(~ins, -math.inf).amax(-1)  # max over S
        m = m.masked_fill_(torch.isneginf(m), 0.0)
        y.sub_(m[:, None])
        e = y.exp()
        s_all = e.sum(-1)
        e.masked_fill_(~ins, 0.0)
        s = e.sum(-1)
        q = torch.linalg.vecdot(e, e)
        w = torch.where(e > 0, e * y, torch.zeros_like(e)).sum(-1)
        if topk_ids is not None:  # e is spent: the kept tail alone, the support zeroed
            e.scatter_(1, sup[a:b], 0.0)
            t = e.sum(-1)
            qt = torch.linalg.vecdot(e, e)
        log_s = s.log()
        out["lse"][a:b] = m + log_s
        out["logp"][a:b] = y.gather(1, kk).squeeze(1) - log_s
        out["sum_p2"][a:b] = q / (s * s)
        out["entropy"][a:b] = log_s - w / s
        out["kept_mass"][a:b] = s / s_all
        out["kept_size"][a:b] = ins.sum(-1).to(cdt)
        if tk_out is not None:
            tk = topk_ids[a:b]
            tk_out[a:b] = torch.where(ins.gather(1, tk), y.gather(1, tk) - log_s[:, None],
                                      torch.full_like(log_s[:, None], -math.inf))
            tail["lse_tail"][a:b] = m + t.log()  # the kept tokens outside S' = topK ∪ {k}
            tail["sum_p2_tail"][a:b] = qt / (s * s)
            bad = t < rescue  # underflowed terms could matter: the tail's own max (tail_rows)
            if bool(bad.any()):
                lt, p2 = tail_rows(y[bad], sup[a:b][bad], log_s[bad], keep=ins[bad])
                tail["lse_tail"][a:b][bad] = m[bad] + lt
                tail["sum_p2_tail"][a:b][bad] = p2
    out["sampled_outside"] = outside
    if tk_out is not None:
        out["topk_logp"] = tk_out
        out.update(tail)
    return out, tau


def backward(logits, sampled_ids, lse, grad_logp, tau, kept_mask, *, temperature, chunk_rows):
    """``g (e_k - pi') / T`` chunk by chunk, in the logits' dtype."""
    N, V = logits.shape
    cdt = lse.dtype
    c = 1.0 / temperature
    step = rows_per_chunk(V, chunk_rows, logits.device)
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    lse = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, math.inf))  # no NaN from padding rows
    gc = grad_logp.to(cdt) * c
    for a in range(0, N, step):
        b = min(a + step, N)
        y = logits[a:b].to(cdt).mul(c)
        ins = _members(y, None, tau[a:b], None if kept_mask is None else kept_mask[a:b])
        kk = sampled_ids[a:b, None]
        ins.scatter_(1, kk, True)
        p = y.sub_(lse[a:b, None]).exp_().masked_fill_(~ins, 0.0)
        p.mul_(-gc[a:b, None]).scatter_add_(1, kk, gc[a:b, None])
        # a row without upstream gradient (padding) is exactly 0, whatever its logits hold:
        # NaN/inf logits make p NaN there, and 0 * NaN is NaN
        p.masked_fill_(gc[a:b, None] == 0, 0.0)
        grad[a:b] = p.to(grad.dtype)
    return grad


class TruncatedRowStats(torch.autograd.Function):
    """Row statistics of ``pi'``; only ``logp`` is differentiable (as :class:`FusedRowStats`)."""

    @staticmethod
    def forward(ctx, logits, sampled_ids, topk_ids, temperature, chunk_rows, sampling, kept_mask):
        out, tau = forward(logits, sampled_ids, topk_ids, temperature=temperature, chunk_rows=chunk_rows,
                           sampling=sampling, kept_mask=kept_mask)
        ctx.save_for_backward(logits, sampled_ids, out["lse"], tau, kept_mask)
        ctx.temperature, ctx.chunk_rows = temperature, chunk_rows
        return outputs_tuple(ctx, out)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_lse, g_logp, *rest):
        logits, ids, lse, tau, kept_mask = ctx.saved_tensors
        grad = backward(logits, ids, lse, g_logp, tau, kept_mask, temperature=ctx.temperature,
                        chunk_rows=ctx.chunk_rows)
        return grad, None, None, None, None, None, None


ALL_KEYS = KEYS + TRUNC_KEYS


def outputs_tuple(ctx, out: dict) -> tuple:
    """The dict as an output tuple (absent ``topk_logp``: an empty tensor); only ``logp``
    is differentiable."""
    res = tuple(out.get(k, out["lse"].new_empty(0)) for k in ALL_KEYS)
    ctx.mark_non_differentiable(*(t for k, t in zip(ALL_KEYS, res) if k != "logp"))
    return res


def row_stats(logits, sampled_ids, topk_ids, *, temperature, chunk_rows, sampling, kept_mask):
    """The truncated reduction with ``logp`` differentiable when the logits require it."""
    if logits.requires_grad and torch.is_grad_enabled():
        res = TruncatedRowStats.apply(logits, sampled_ids, topk_ids, float(temperature), chunk_rows, sampling,
                                      kept_mask)
        return as_dict(res, topk_ids is not None, ALL_KEYS)
    return forward(logits.detach(), sampled_ids, topk_ids, temperature=float(temperature), chunk_rows=chunk_rows,
                   sampling=sampling, kept_mask=kept_mask)[0]
