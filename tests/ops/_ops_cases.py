"""Shared inputs and tolerances for the pdmask.ops tests (random and adversarial rows)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

KEYS = ("lse", "logp", "sum_p2", "entropy", "topk_logp", "lse_tail", "sum_p2_tail")


def tol(dtype: torch.dtype, zmax: float = 10.0) -> dict:
    """Agreement with the reference, which reduces the same input values in the same
    compute dtype (float32 for bf16/fp16/fp32, float64 for fp64): the two differ by the
    order of roundings over V terms and by rounding ``z = x / T`` (x/T vs x*(1/T), base-2
    scaling in Triton), an error of a few ulps of the largest ``|z|`` (``zmax``)."""
    eps = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
    return {"atol": 64 * eps + 8 * eps * zmax, "rtol": 64 * eps}


def make_logits(N, V, dtype, *, seed=0, scale=3.0, kind="random"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, V, generator=g, dtype=torch.float64) * scale
    if kind == "peaked":  # one token holds nearly all the mass: entropy ~ 1e-20, sum_p2 ~ 1
        x[torch.arange(N), torch.randint(0, V, (N,), generator=g)] += 60.0
    elif kind == "neginf":  # vocabulary masking: a third of each row is -inf
        x[torch.rand(N, V, generator=g) < 0.33] = float("-inf")
        x[:, 0] = 0.5  # at least one finite logit per row
    elif kind == "offset":  # large common offset: only the shift-invariant form survives
        x = x + 1000.0
    elif kind == "flat":  # uniform rows: entropy = log V, sum_p2 = 1 / V exactly
        x = torch.zeros(N, V, dtype=torch.float64)
    return x.to(dtype)


def make_ids(N, V, K, *, seed=1, sampled_in_topk=None):
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(0, V, (N,), generator=g)
    if K is None:
        return k, None
    tk = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(N)])
    if sampled_in_topk is True:
        tk[:, -1] = k
        # keep rows duplicate-free: if k was already present elsewhere, swap it into place
        for i in range(N):
            dup = (tk[i, :-1] == k[i]).nonzero()
            if dup.numel():
                rest = [j for j in range(V) if j not in set(tk[i].tolist())]
                tk[i, dup[0, 0]] = rest[0] if rest else tk[i, dup[0, 0]]
    elif sampled_in_topk is False and K < V:
        for i in range(N):
            if (tk[i] == k[i]).any():
                k[i] = next(j for j in range(V) if j not in set(tk[i].tolist()))
    return k, tk


def naive(logits, ids, topk_ids, temperature=1.0):
    """float64 full-softmax oracle (for independence from the chunked reference)."""
    z = logits.double() / temperature
    logq = torch.log_softmax(z, -1)
    p = logq.exp()
    out = {
        "lse": torch.logsumexp(z, -1),
        "logp": logq.gather(1, ids[:, None]).squeeze(1),
        "sum_p2": (p * p).sum(-1),
        "entropy": -torch.where(p > 0, p * logq, torch.zeros_like(p)).sum(-1),
    }
    if topk_ids is not None:
        out["topk_logp"] = logq.gather(1, topk_ids)
        # the tail of S' = topK ∪ {k}, from the full float64 softmax, term by term
        tail = torch.ones_like(z, dtype=torch.bool)
        tail.scatter_(1, topk_ids, False).scatter_(1, ids[:, None], False)
        out["lse_tail"] = torch.logsumexp(z.masked_fill(~tail, float("-inf")), -1)
        out["sum_p2_tail"] = torch.where(tail, p * p, torch.zeros_like(p)).sum(-1)
    return out


def grad_tol(dtype: torch.dtype, zmax: float, gmax: float) -> dict:
    """Gradient ``g (e_k - p) / T``: ``p = exp(z - lse)`` carries a relative error of a few
    ulps of ``zmax`` (compute dtype), then one rounding into the logits' dtype."""
    ceps = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
    oeps = torch.finfo(dtype).eps
    rtol = 2 * oeps + 8 * ceps * zmax
    # absolute: the e_k - p_k cancellation at the sampled token
    return {"atol": gmax * (8 * ceps * zmax + 64 * ceps), "rtol": rtol}


def zmax_of(logits, temperature=1.0) -> float:
    a = logits.double().abs()
    return max(float(a[torch.isfinite(a)].max()) / temperature, 1.0) if a.numel() else 1.0


def assert_agree(got, want, dtype, keys=KEYS, rows=None, zmax=10.0):
    t = tol(dtype, zmax)
    for k in keys:
        if k not in want:
            assert k not in got, k
            continue
        a, b = got[k].detach().double(), want[k].detach().double()
        if rows is not None:
            a, b = a[rows], b[rows]
        torch.testing.assert_close(a, b, **t, msg=lambda m, k=k: f"{k}: {m}")


class AllocRecorder(TorchDispatchMode):
    """Records the element count of every fresh tensor an op returns (views, in-place and
    out= results share storage with an input and are not allocations)."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
               if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.untyped_storage().data_ptr() not in ins:
                self.sizes.append((func.__name__, t.numel()))
        return out


#: Tail masses of the extreme-tail cases: from an ordinary 1e-3 down to just above float32's
#: smallest normal (1.18e-38), where ``1 - sum_{S'} pi`` has long rounded to 0 in float32.
PI_TAILS = (1e-3, 3e-6, 6e-8, 1e-10, 1e-15, 1e-20, 1e-26, 1e-30, 1e-34, 2e-38)


def tail_case(pi_tails=PI_TAILS, V=300, K=12, *, seed=0, dtype=torch.float64):
    """Rows whose mass outside ``S' = topK ∪ {k}`` is ``pi_tails[n]`` (of the float64 logits;
    the dtype's rounding moves it a little): the support's logits are lifted by the offset
    that leaves exactly that mass to the tail. ``k`` is in the top-K on every other row.
    Returns ``(x, k, topk_ids)``."""
    N = len(pi_tails)
    g = torch.Generator().manual_seed(seed)
    k, tk = make_ids(N, V, K, seed=seed + 1)
    for n in range(0, N, 2):  # k inside the top-K on even rows
        if not (tk[n] == k[n]).any():
            tk[n, 0] = k[n]
    z = torch.randn(N, V, generator=g, dtype=torch.float64)
    sup = torch.zeros(N, V, dtype=torch.bool).scatter_(1, tk, True).scatter_(1, k[:, None], True)
    p = torch.tensor(pi_tails, dtype=torch.float64)
    lt = torch.logsumexp(z.masked_fill(sup, float("-inf")), -1)
    ls = torch.logsumexp(z.masked_fill(~sup, float("-inf")), -1)
    lift = lt - ls + torch.log1p(-p) - torch.log(p)
    z = torch.where(sup, z + lift[:, None], z)
    return z.to(dtype), k, tk


def naive_tail(x, k, topk_ids, temperature=1.0, keep=None):
    """float64 ``(log pi_T, sum_{tail} pi^2)`` of the input values, pi renormalised over
    ``keep`` when given: every tail term exponentiated relative to its own row max."""
    z = x.double() / temperature
    if keep is not None:
        z = z.masked_fill(~keep, float("-inf"))
    tail = torch.ones_like(z, dtype=torch.bool).scatter_(1, topk_ids, False).scatter_(1, k[:, None], False)
    zt = z.masked_fill(~tail, float("-inf"))
    lse = torch.logsumexp(z, -1)
    logp = z - lse[:, None]
    p2 = torch.where(tail & (zt > float("-inf")), (2 * logp).exp(), torch.zeros_like(z)).sum(-1)
    return torch.logsumexp(zt, -1) - lse, p2


def assert_tail_agrees(got, x, k, topk_ids, dtype, temperature=1.0, keep=None):
    """``lse_tail - lse`` (log pi_T) and ``sum_p2_tail`` of an op against :func:`naive_tail`:
    the log to a few ulps of the largest logit (the two log-sum-exps round on that scale),
    the sum of squares relatively to a few ulps of it, absolutely to float32's smallest
    normal (it underflows below that)."""
    want_log, want_p2 = naive_tail(x, k, topk_ids, temperature, keep)
    zmax = zmax_of(x, temperature)
    log_pt = (got["lse_tail"].double() - got["lse"].double())
    torch.testing.assert_close(log_pt, want_log, **tol(dtype, zmax), msg=lambda m: f"log pi_T: {m}")
    ceps = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
    tiny = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).tiny
    torch.testing.assert_close(got["sum_p2_tail"].double(), want_p2, rtol=16 * ceps * zmax, atol=tiny,
                               msg=lambda m: f"sum_p2_tail: {m}")


# ------------------------------------------------------------------ calling the op in the tests' flat spelling
def row_stats(logits, sampled_ids, topk_ids=None, *, temperature=1.0, impl="auto", chunk_rows=None, validate=True,
              rollout_logits=None, truncation=None, kept_mask=None) -> dict:
    """:func:`pdmask.ops.row_stats` (``logits``: (N, V), or a :class:`pdmask.ops.Hidden`) as a dict of the fields it computed, from flat keywords;
    ``impl="reference"`` is the tests' plain-torch oracle (``tests/ops/reference.py``), which
    the library no longer ships. ``truncation``: a Sampling whose top_k / top_p / min_p apply."""
    from dataclasses import fields

    from pdmask import ops

    from tests.ops import reference

    trunc = {} if truncation is None else {k: getattr(truncation, k) for k in ("top_k", "top_p", "min_p")}
    if impl == "reference":
        if trunc or kept_mask is not None:
            return reference.truncated_row_stats(logits, sampled_ids, topk_ids, temperature=temperature,
                                                 kept_mask=kept_mask, **trunc)
        return reference.row_stats(logits, sampled_ids, topk_ids, temperature=temperature, chunk_rows=chunk_rows,
                                   rollout_logits=rollout_logits)
    red = ops.row_stats(logits, sampled_ids, topk_ids, sampling=ops.Sampling(temperature, **trunc),
                        compute=ops.Compute(impl, chunk_rows), rollout_logits=rollout_logits, kept_mask=kept_mask,
                        validate=validate)
    return {f.name: getattr(red, f.name) for f in fields(red) if getattr(red, f.name) is not None}


def hidden_row_stats(hidden, weight, sampled_ids, topk_ids=None, **kw) -> dict:
    """:func:`row_stats` of the :class:`pdmask.ops.Hidden` source ``hidden @ weight.T``."""
    from pdmask import ops

    return row_stats(ops.Hidden(hidden, weight), sampled_ids, topk_ids, **kw)


def oracle_rows():
    """A context in which :func:`pdmask.ops.row_stats` is the tests' plain-torch oracle
    (``impl="reference"`` of :func:`row_stats`, the same :class:`pdmask.ops.Reductions`): the
    core's statistics and loss on the oracle's reductions, to compare the op's against."""
    import contextlib

    from pdmask import ops

    def oracle(source, sampled_ids, topk_ids=None, *, sampling=None, compute=None, rollout_logits=None,
               kept_mask=None, validate=True):
        s = ops.Sampling() if sampling is None else sampling
        x = source.hidden @ source.weight.T if isinstance(source, ops.Hidden) else source
        return ops.Reductions(**row_stats(x, sampled_ids, topk_ids, temperature=s.temperature, impl="reference",
                                          rollout_logits=rollout_logits, kept_mask=kept_mask,
                                          truncation=s if s.truncated else None))

    @contextlib.contextmanager
    def swapped():
        real, ops.row_stats = ops.row_stats, oracle
        try:
            yield
        finally:
            ops.row_stats = real

    return swapped()
