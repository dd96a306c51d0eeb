"""Truncated sampling: the torch backend's reductions of pi renormalised over the kept set S.

The engine reports ``mu' = mu / mu(S)`` (vLLM ``processed_logprobs``); the matching trainer
policy is ``pi' = pi / pi(S)``: ``log pi'_k = z_k / T - lse_S``, gradient ``(e_k - pi') / T``.
S is the engine's ``kept_mask``, or rebuilt on the trainer's logits in vLLM's order
(``vllm/v1/sample``: min-p, top-k with ties kept, top-p dropping the ascending prefix of mass
``<= 1 - top_p``), each rule a per-row threshold ``tau`` (``S = {y >= tau}``) the backward
reuses. The sampled token always joins S (``sampled_outside`` counts those the rule drops);
top-K ids outside S get ``topk_logp = -inf``. Naive equivalent: ``tests/ops/reference.py``.
"""

from __future__ import annotations

import math

import torch

from ._shared import tail_rows


def rule_threshold(y: torch.Tensor, s) -> torch.Tensor:
    """Per-row threshold ``tau`` (rows,) of the kept set ``{y >= tau}`` of temperature-scaled
    logits ``y`` (rows, V), a :class:`pdmask.Sampling`'s rules in vLLM's order (module docstring)."""
    tau = torch.full(y.shape[:1], -math.inf, dtype=y.dtype, device=y.device)
    if s.min_p is not None:
        tau = y.amax(-1) + math.log(s.min_p)
    if s.top_k is not None and s.top_k < y.shape[1]:
        tau = torch.maximum(tau, y.topk(s.top_k, dim=-1).values[:, -1])
    if s.top_p is not None:
        ys = y.masked_fill(y < tau[:, None], -math.inf).sort(dim=-1).values  # ascending
        drop = ys.softmax(-1).cumsum_(-1) <= 1 - s.top_p
        drop[:, -1] = False  # the largest token always stays
        tau = ys.gather(1, drop.sum(-1, keepdim=True)).squeeze(1)
    return tau


def members(job, z: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """(rows, V) bool: the kept set of rows ``a:b`` of logits ``z``, the sampled token forced
    in (the backward's; the forward builds the same set on its own scaled copy)."""
    ins = job.kept_mask[a:b].clone() if job.kept_mask is not None else z.to(job.cdt).mul(job.c) >= job.tau[a:b, None]
    return ins.scatter_(1, job.ids[a:b, None], True)


def forward(job, x, w) -> dict[str, torch.Tensor]:
    """The fields of :class:`pdmask.ops.Reductions` of ``pi'`` (module docstring) in the rule's
    row chunks; sets ``job.tau`` (``-inf`` with a kept mask), which the backward needs."""
    N, cdt, dev = job.N, job.cdt, x.device
    o = {k: torch.empty(N, dtype=cdt, device=dev) for k in ("lse", "logp", "sum_p2", "entropy", "kept_mass",
                                                            "kept_size")}
    o["sampled_outside"] = torch.empty(N, dtype=torch.bool, device=dev)
    job.tau = torch.full((N,), -math.inf, dtype=cdt, device=dev)
    if job.topk is not None:
        o["topk_logp"] = torch.empty(job.topk.shape, dtype=cdt, device=dev)
        o["lse_tail"], o["sum_p2_tail"] = (torch.empty(N, dtype=cdt, device=dev) for _ in range(2))
    for a in range(0, N, job.step):
        b = min(a + job.step, N)
        y = job.logits(x, w, a, b).to(cdt, copy=True).mul_(job.c)  # (rows, V); the exp is the other buffer
        if job.kept_mask is None:
            job.tau[a:b] = rule_threshold(y, job.sampling)
        kk = job.ids[a:b, None]
        ins = job.kept_mask[a:b].clone() if job.kept_mask is not None else y >= job.tau[a:b, None]
        o["sampled_outside"][a:b] = ~ins.gather(1, kk).squeeze(1)
        ins.scatter_(1, kk, True)
        m = y.masked_fill(~ins, -math.inf).amax(-1)  # max over S
        m = m.masked_fill_(torch.isneginf(m), 0.0)
        y.sub_(m[:, None])
        e = y.exp()
        s_all = e.sum(-1)
        e.masked_fill_(~ins, 0.0)
        s = e.sum(-1)
        q = torch.linalg.vecdot(e, e)
        wsum = torch.where(e > 0, e * y, torch.zeros_like(e)).sum(-1)
        log_s = s.log()
        o["lse"][a:b], o["logp"][a:b] = m + log_s, y.gather(1, kk).squeeze(1) - log_s
        o["sum_p2"][a:b], o["entropy"][a:b] = q / (s * s), log_s - wsum / s
        o["kept_mass"][a:b], o["kept_size"][a:b] = s / s_all, ins.sum(-1).to(cdt)
        if job.topk is None:
            continue
        tk, sup = job.topk[a:b], job.sup[a:b]
        o["topk_logp"][a:b] = torch.where(ins.gather(1, tk), y.gather(1, tk) - log_s[:, None],
                                          torch.full_like(log_s[:, None], -math.inf))
        e.scatter_(1, sup, 0.0)  # e is spent: the kept tail alone, the support zeroed
        t = e.sum(-1)
        o["lse_tail"][a:b], o["sum_p2_tail"][a:b] = m + t.log(), torch.linalg.vecdot(e, e) / (s * s)
        bad = t < job.rescue  # underflowed terms could matter: the tail's own max
        if bool(bad.any()):
            lt, p2 = tail_rows(y[bad], sup[bad], log_s[bad], keep=ins[bad])
            o["lse_tail"][a:b][bad] = m[bad] + lt
            o["sum_p2_tail"][a:b][bad] = p2
    return o
