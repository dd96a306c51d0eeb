"""Random per-token cases with a known full rollout distribution, and autograd oracles."""

from __future__ import annotations

from typing import Callable

import torch
from tests import flat  # noqa: E402

F64 = torch.float64


def make_case(N=6, V=40, K=5, *, scale=1.5, mismatch=0.5, seed=0, dtype=F64, temperature=1.0,
              peaked_rows=0):
    """Trainer logits z, rollout logits y = z + noise; top-K and sampled token from mu.

    ``peaked_rows`` rows get a very large logit gap so that pi and mu are nearly one-hot.
    Returns a dict of flat (N, ...) tensors plus the rollout's full log-probs.
    """
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(N, V, generator=g, dtype=F64) * scale
    y = z + torch.randn(N, V, generator=g, dtype=F64) * mismatch
    for r in range(min(peaked_rows, N)):
        j = int(torch.randint(V, (1,), generator=g))
        z[r, j] += 40.0
        y[r, j] += 38.0
    logmu = torch.log_softmax(y / temperature, -1)
    top = logmu.topk(K, dim=-1)
    k = torch.multinomial(logmu.exp(), 1, generator=g).squeeze(1)
    return dict(
        logits=z.to(dtype), rollout_logits=y.to(dtype), logmu=logmu,
        sampled_ids=k, rollout_logprob=logmu.gather(1, k[:, None]).squeeze(1),
        topk_ids=top.indices, topk_logprobs=top.values, temperature=temperature,
    )


def stats_of(c, **kw):
    """token_stats on a flat case, treated as B=1 sequences of length N."""
    import pdmask

    return {k: v[0] for k, v in flat.token_stats(
        c["logits"][None], c["sampled_ids"][None], c["rollout_logprob"][None],
        c["topk_ids"][None], c["topk_logprobs"][None],
        rollout_logits=c["rollout_logits"][None], temperature=c["temperature"], **kw).items()}


def support_mask(topk_ids, sampled_ids, V):
    """(N, V) bool: membership in S' = topK ∪ {k}."""
    m = torch.zeros(topk_ids.shape[0], V, dtype=torch.bool)
    m.scatter_(1, topk_ids, True)
    m.scatter_(1, sampled_ids[:, None], True)
    return m


def _term(kind: str, m: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """One bucket's term of a divergence D(m || p) = sum_buckets term(m_b, p_b), 0 log 0 = 0."""
    def xlog(a, b):  # a log(a / b), 0 where a = 0
        return torch.where(a > 0, a * (torch.log(a.clamp_min(1e-300)) - torch.log(b.clamp_min(1e-300))),
                           torch.zeros_like(a))
    if kind == "kl":
        return xlog(m, p)
    if kind == "tv":
        return 0.5 * (m - p).abs()
    if kind == "js":
        mid = 0.5 * (m + p)
        return 0.5 * (xlog(m, mid) + xlog(p, mid))
    raise KeyError(kind)


#: the registered top-K divergences this file restates (an oracle per registration: a new one
#: fails tests/core/test_closed_forms.py until its oracle is here) -> the kind of _term
TOPK_ORACLES = {"topk_kl": "kl", "topk_tv": "tv", "topk_js": "js"}


def full_divergence_fn(kind: str):
    """The divergence over the whole vocabulary, ``fn(mu, pi)`` (the top-K one with K = V)."""
    return lambda mu, pi: _term(kind, mu, pi).sum(-1)


def topk_divergence_fn(c, kind: str, *, with_sampled: bool = True):
    """The top-K divergence as a function of the full pi (for autograd): S' = topK ∪ {k} plus one
    tail bucket; ``with_sampled=False``: S = topK only (the sampled token wherever it falls,
    the DPPO reference's support). ``kind``: kl, tv, js, or a registered name (``topk_js``)."""
    kind = TOPK_ORACLES.get(kind, kind)
    V = c["logits"].shape[-1]
    S = (support_mask(c["topk_ids"], c["sampled_ids"], V) if with_sampled else
         torch.zeros(c["topk_ids"].shape[0], V, dtype=torch.bool).scatter_(1, c["topk_ids"], True))
    mu_full = c["logmu"].exp()
    mu_S = torch.where(S, mu_full, torch.zeros_like(mu_full))
    # mu on S' as the engine reports it: top-K entries + the sampled token
    mu_T = torch.where(S, torch.zeros_like(mu_full), mu_full).sum(-1)  # exactly 0 when K = V

    def fn(_mu, pi):
        pi_S = torch.where(S, pi, torch.zeros_like(pi))
        pi_T = torch.where(S, torch.zeros_like(pi), pi).sum(-1)
        body = torch.where(S, _term(kind, mu_S, pi_S), torch.zeros_like(pi)).sum(-1)
        return body + _term(kind, mu_T, pi_T)

    return fn


def full_kl_fn(mu, pi):
    return (mu * (torch.log(mu) - torch.log(pi))).sum(-1)


def full_tv_fn(mu, pi):
    return 0.5 * (mu - pi).abs().sum(-1)


def ddot_autograd(
    divergence: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    logits: torch.Tensor,
    sampled_ids: torch.Tensor,
    mu: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
) -> torch.Tensor:
    """``Ddot`` of any divergence through autograd: ``grad_z D(mu, softmax(z)) . (e_k - pi)``.

    ``divergence(mu, pi)`` maps (N, V) probabilities (``mu`` may be None if the
    function closes over what it needs) to (N,) values. ``z = logits / temperature``
    and the derivative is taken with respect to ``z`` (a positive rescaling of the
    logit step, which does not change any sign). Slow and memory-hungry by design: the
    test oracle of every closed form.
    """
    z = (logits.detach().to(torch.float64 if logits.dtype == torch.float64 else torch.float32) / temperature)
    z = z.reshape(-1, z.shape[-1]).requires_grad_(True)
    pi = torch.softmax(z, -1)
    m = None if mu is None else mu.reshape(-1, mu.shape[-1]).to(z.dtype)
    d = divergence(m, pi)
    (g,) = torch.autograd.grad(d.sum(), z)
    u = -pi.detach()
    u.scatter_add_(1, sampled_ids.reshape(-1, 1).long(), torch.ones_like(u[:, :1]))
    return (g * u).sum(-1).reshape(sampled_ids.shape)
