"""Input checking and sanitising for the public tensor functions.

Every check names the argument it is about, so a user reading the error knows which
tensor to look at. Checks are only made on response positions: padding may hold any
junk (pad ids, zeros, -inf), and is replaced by harmless placeholders before any
arithmetic so that it can never turn into a NaN that a multiplication by the mask
would spread.

All data-dependent checks on the inputs are gathered into one boolean vector
(:class:`Checks`) and read back with a single host sync before the logits are read; the
one data check that needs the reductions (every response row of ``logits`` and
``rollout_logits`` has a finite log-sum-exp and no NaN) is a second sync after them. Pass
``validate=False`` on a hot path whose inputs are known good: no sync, no check.
Metadata checks (types, shapes, devices) cost nothing and always run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: Engine log-probs may exceed 0 by rounding (bf16 engines, fp32 log-softmax); beyond
#: this they are a bug upstream (raw logits passed as log-probs, wrong temperature).
LOGPROB_TOL = 1e-3
#: Largest accepted excess of the top-K probability mass over 1 (also of the top-K mass
#: plus the sampled token's when the sampled token is not in the top-K).
MASS_TOL = 1e-3
#: The sampled token's ``sampled_logprob`` and its own entry in the top-K list are the
#: same number from the engine; they may differ by rounding only (bf16 rounding of either
#: is < 2^-8 relative): ``|a - b| <= MATCH_ATOL + MATCH_RTOL * |b|``.
MATCH_ATOL = 1e-3
MATCH_RTOL = 2.0 ** -7

from .keys import ESTIMATORS  # noqa: F401  (re-exported for the validators)
from .rollout import Rollout
#: The aggregation modes (verl 0.9.1's ``agg_loss``) and the denominators of
#: :class:`pdmask.Aggregation` each one reads, its count first (the count is required when
#: ``dp_size > 1``); a denominator the mode does not read is refused, not ignored.
LOSS_AGG_READS = {
    "token-mean": ("num_tokens",),
    "token-sum": (),
    "seq-mean-token-mean": ("num_seqs",),
    "seq-mean-token-sum": ("num_seqs",),
    "seq-mean-token-sum-norm": ("num_seqs", "loss_scale_factor"),
}
LOSS_AGGS = tuple(LOSS_AGG_READS)


@dataclass
class Batch:
    """Flattened, sanitised inputs. N = number of (b, t) positions."""

    logits: torch.Tensor  # (N, V), original dtype, a view where possible
    sampled_ids: torch.Tensor  # (N,) int64
    sampled_logprob: torch.Tensor  # (N,) float
    topk_ids: torch.Tensor | None  # (N, K) int64
    topk_logprobs: torch.Tensor | None  # (N, K) float
    rollout_logits: torch.Tensor | None  # (N, V)
    valid: torch.Tensor  # (N,) bool: response positions
    lead_shape: tuple  # (B, T) or whatever leading shape the caller used
    vocab_size: int
    kept_mask: torch.Tensor | None = None  # (N, V) bool: the engine's kept set (truncated sampling)
    hidden: torch.Tensor | None = None  # (N, H): instead of logits (logits = hidden @ lm_head_weight.T)
    lm_head_weight: torch.Tensor | None = None  # (V, H)


def _fail(arg: str, msg: str) -> None:
    raise ValueError(f"{arg}: {msg}")


class Checks:
    """Data-dependent checks gathered for one host sync: ``add(name, msg, flag)`` with a
    0-d bool tensor ``flag`` (True: bad), then :meth:`run` raises the first bad one."""

    def __init__(self) -> None:
        self.items: list[tuple[str, str, torch.Tensor]] = []

    def add(self, name: str, msg: str, flag: torch.Tensor) -> None:
        self.items.append((name, msg, flag))

    def run(self) -> None:
        if not self.items:
            return
        dev = self.items[0][2].device
        bad = torch.stack([f.reshape(()).to(dev) for _, _, f in self.items]).tolist()  # the one sync
        for (name, msg, _), b in zip(self.items, bad):
            if b:
                _fail(name, msg)


def check_positive(name: str, value: float, allow_inf: bool = False) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value <= 0:
        _fail(name, f"must be a positive number, got {value!r}")
    if math.isinf(value) and not allow_inf:
        _fail(name, f"must be finite, got {value!r}")


def check_count(name: str, value, checks: "Checks | None" = None) -> None:
    """A user-given denominator (``num_tokens``, ``num_seqs``, ``loss_scale_factor``):
    None, or a positive finite number, or a one-element real tensor holding one. A tensor's
    value is checked through ``checks`` (no sync here) when given, else not at all."""
    if value is None:
        return
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            _fail(name, f"must be a positive number or a one-element real tensor, got a {value.dtype} "
                        f"tensor of shape {tuple(value.shape)}")
        if checks is not None:
            v = value.detach().reshape(()).double()
            checks.add(name, "must be a positive finite number", ~(torch.isfinite(v) & (v > 0)))
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value <= 0 \
            or math.isinf(value):
        _fail(name, f"must be a positive finite number, got {value!r}")


def check_device(name: str, t: torch.Tensor, like) -> None:
    """``t`` lives on the device of ``like`` (the logits, or their device)."""
    dev = like.device if isinstance(like, torch.Tensor) else torch.device(like)
    if t.device != dev:
        _fail(name, f"is on device {t.device}, but logits are on {dev}; move it to {dev}")


def check_chunk_size(name: str, value, what: str = "rows per chunk") -> None:
    """``value`` is None (the implementation's default) or a positive int."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        _fail(name, f"must be a positive int ({what}), got {value!r}")


def check_choice(name: str, value: str, valid) -> None:
    if value not in valid:
        _fail(name, f"unknown value {value!r}; valid values are: {', '.join(valid)}")


def _check_tensor(name: str, t, float_: bool) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(name, f"must be a torch.Tensor, got {type(t).__name__}")
    if float_ and not t.is_floating_point():
        _fail(name, f"must be a floating-point tensor, got dtype {t.dtype}")
    if not float_ and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        _fail(name, f"must be an integer tensor of token ids, got dtype {t.dtype}")


def _check_shape(name: str, t: torch.Tensor, shape: tuple, what: str) -> None:
    if tuple(t.shape) != tuple(shape):
        _fail(name, f"expected shape {tuple(shape)} ({what}), got {tuple(t.shape)}")


def prepare(logits: torch.Tensor, rollout, validate: bool = True, checks: Checks | None = None) -> Batch:
    """Check the rollout against the logits (shapes, dtypes, devices, values); flatten to
    (N, ...) and sanitise padding.

    The value checks go into ``checks`` when given (the caller adds its own and runs them:
    one host sync for all), else they are run here; ``validate=False`` skips them."""
    _check_tensor("logits", logits, float_=True)
    if logits.dim() < 2:
        _fail("logits", f"expected shape (B, T, V) or (N, V), got {tuple(logits.shape)}")
    b = prepare_rows(tuple(logits.shape[:-1]), logits.shape[-1], logits.device, rollout, validate, checks)
    b.logits = logits.reshape(-1, logits.shape[-1])
    return b


def prepare_rows(lead: tuple, V: int, device, rollout, validate: bool = True, checks: Checks | None = None) -> Batch:
    """:func:`prepare` for rows whose logits (leading shape ``lead``, vocabulary ``V``) are
    not materialised; the returned batch has ``logits=None``. ``rollout`` is a
    :class:`pdmask.Rollout` (its types and top-K pair already checked there)."""
    if not isinstance(rollout, Rollout):
        _fail("rollout", f"must be a pdmask.Rollout, got {type(rollout).__name__}")
    r = rollout
    sampled_ids, sampled_logprob, topk_ids, topk_logprobs = r.sampled_ids, r.sampled_logprob, r.topk_ids, r.topk_logprobs
    _check_tensor("rollout.sampled_ids", sampled_ids, float_=False)
    _check_shape("rollout.sampled_ids", sampled_ids, lead, "the leading dims of logits")
    check_device("rollout.sampled_ids", sampled_ids, device)
    _check_tensor("rollout.sampled_logprob", sampled_logprob, float_=True)
    _check_shape("rollout.sampled_logprob", sampled_logprob, lead, "the leading dims of logits")
    check_device("rollout.sampled_logprob", sampled_logprob, device)
    if topk_ids is not None:
        _check_tensor("rollout.topk_ids", topk_ids, float_=False)
        _check_tensor("rollout.topk_logprobs", topk_logprobs, float_=True)
        if topk_ids.dim() != len(lead) + 1 or tuple(topk_ids.shape[:-1]) != lead:
            _fail("rollout.topk_ids", f"expected shape {lead + ('K',)}, got {tuple(topk_ids.shape)}")
        K = topk_ids.shape[-1]
        _check_shape("rollout.topk_logprobs", topk_logprobs, lead + (K,), "same as rollout.topk_ids")
        if K < 1:
            _fail("rollout.topk_ids", "K must be at least 1")
        if K > V:
            _fail("rollout.topk_ids", f"K = {K} exceeds the vocabulary size V = {V}")
        check_device("rollout.topk_ids", topk_ids, device)
        check_device("rollout.topk_logprobs", topk_logprobs, device)
    rollout_logits, kept_mask, response_mask = r.logits, r.kept_mask, r.response_mask
    if rollout_logits is not None:
        _check_tensor("rollout.logits", rollout_logits, float_=True)
        _check_shape("rollout.logits", rollout_logits, lead + (V,), "same as logits")
        check_device("rollout.logits", rollout_logits, device)
    if kept_mask is not None:
        if kept_mask.dtype != torch.bool:
            _fail("rollout.kept_mask", f"must be a bool tensor (the engine's kept set), got {kept_mask.dtype}")
        _check_shape("rollout.kept_mask", kept_mask, lead + (V,), "same as logits")
        check_device("rollout.kept_mask", kept_mask, device)
    mask_values = None
    if response_mask is None:
        valid = torch.ones(lead, dtype=torch.bool, device=device)
    else:
        if response_mask.is_complex():
            _fail("rollout.response_mask", f"must be bool or 0/1 values, got dtype {response_mask.dtype}")
        _check_shape("rollout.response_mask", response_mask, lead, "the leading dims of logits")
        check_device("rollout.response_mask", response_mask, device)
        valid = response_mask.bool()
        if response_mask.dtype != torch.bool:
            mask_values = response_mask.reshape(-1)

    valid = valid.reshape(-1)
    ids = sampled_ids.reshape(-1).long()
    lp = sampled_logprob.reshape(-1)
    tk_ids = tk_lp = None
    if topk_ids is not None:
        K = topk_ids.shape[-1]
        tk_ids = topk_ids.reshape(-1, K).long()
        tk_lp = topk_logprobs.reshape(-1, K)

    if validate:
        own = checks is None
        checks = Checks() if own else checks
        if mask_values is not None:
            checks.add("rollout.response_mask", "must hold only 0/1 (or bool) values",
                       ((mask_values != 0) & (mask_values != 1)).any())
        _check_values(V, valid, ids, lp, tk_ids, tk_lp, checks)
        if own:
            checks.run()

    # Sanitise padding: a consistent, harmless placeholder row (sampled id 0 in the
    # support, uniform-looking log-probs) so that no NaN/inf is ever computed there.
    pad = ~valid
    ids = torch.where(pad, torch.zeros_like(ids), ids)
    filler = -math.log(V)
    lp = torch.where(pad, torch.full_like(lp, filler), lp).clamp(max=0.0)
    if tk_ids is not None:
        K = tk_ids.shape[-1]
        ar = torch.arange(K, device=tk_ids.device).expand_as(tk_ids)
        tk_ids = torch.where(pad[:, None], ar, tk_ids)
        tk_lp = torch.where(pad[:, None], torch.full_like(tk_lp, filler), tk_lp).clamp(max=0.0)

    rl = rollout_logits.reshape(-1, V) if rollout_logits is not None else None
    return Batch(
        logits=None,
        sampled_ids=ids,
        sampled_logprob=lp,
        topk_ids=tk_ids,
        topk_logprobs=tk_lp,
        rollout_logits=rl,
        valid=valid,
        lead_shape=lead,
        vocab_size=V,
        kept_mask=None if kept_mask is None else kept_mask.reshape(-1, V),
    )


def _check_values(V, valid, ids, lp, tk_ids, tk_lp, checks: Checks) -> None:
    """Every value check of the loss inputs, on response positions, into ``checks``."""
    v = valid

    def add(name, msg, flag):
        checks.add(name, msg, flag)

    add("rollout.sampled_ids", f"ids must lie in [0, {V})", ((ids < 0) | (ids >= V))[v].any())
    add("rollout.sampled_logprob", "contains NaN", torch.isnan(lp)[v].any())
    add("rollout.sampled_logprob", f"log-probs must be <= 0 (tolerance {LOGPROB_TOL}); got a positive value",
        (lp > LOGPROB_TOL)[v].any())
    add("rollout.sampled_logprob", "the sampled token's log-prob must be finite (it was sampled, so mu_k > 0)",
        torch.isinf(lp)[v].any())
    if tk_ids is not None:
        tv = v[:, None].expand_as(tk_ids)
        add("rollout.topk_ids", f"ids must lie in [0, {V})", ((tk_ids < 0) | (tk_ids >= V))[tv].any())
        srt = tk_ids.sort(dim=-1).values
        dup = (srt[:, 1:] == srt[:, :-1]).any(-1) if tk_ids.shape[-1] > 1 else torch.zeros_like(v)
        add("rollout.topk_ids", "duplicate ids in a top-K row", (dup & v).any())
        add("rollout.topk_logprobs", "contains NaN", torch.isnan(tk_lp)[tv].any())
        add("rollout.topk_logprobs", f"log-probs must be <= 0 (tolerance {LOGPROB_TOL}); got a positive value",
            (tk_lp > LOGPROB_TOL)[tv].any())
        tk64 = tk_lp.double()
        mass = tk64.exp().sum(-1)
        add("rollout.topk_logprobs", f"top-K probability mass exceeds 1 + {MASS_TOL}",
            ((mass > 1 + MASS_TOL) & v).any())
        # the sampled token in its own top-K row: the two log-probs are one number
        hit = tk_ids == ids[:, None]  # (N, K)
        in_topk = hit.any(-1)
        lp64 = lp.double()
        own = torch.where(hit, tk64, torch.zeros_like(tk64)).sum(-1)  # its top-K entry (0 if absent)
        off = (own - lp64).abs() > MATCH_ATOL + MATCH_RTOL * lp64.abs()
        off = off | (hit & ~torch.isfinite(tk64)).any(-1)
        add("rollout.sampled_logprob", "the sampled token is in the top-K list with a different log-prob there "
            f"(rollout.topk_logprobs); they must agree within {MATCH_ATOL} + {MATCH_RTOL:.4g} * |log-prob|",
            (off & in_topk & v).any())
        # outside the top-K, the sampled token adds its own mass to the support
        total = mass + torch.where(in_topk, torch.zeros_like(lp64), lp64.exp())
        add("rollout.sampled_logprob", "the top-K mass plus the sampled token's probability (it is not in the "
            f"top-K list) exceeds 1 + {MASS_TOL}", ((total > 1 + MASS_TOL) & ~in_topk & v).any())
