"""Input checking and sanitising; every error is a :class:`SpecError` naming its field or
argument. Data checks (response positions only: padding is replaced by harmless placeholders)
are gathered in one :class:`Checks`, read back with one host sync before the logits are read
(``validate=False`` skips them); metadata checks always run.
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

from .rollout import Rollout


class SpecError(ValueError):
    """A refused setting or argument: ``field`` names it, ``problem`` says why; the message
    is ``"field: problem"``. An adapter that knows the field by another name re-raises it
    with :meth:`renamed` instead of parsing the message."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field, self.problem = field, problem

    def renamed(self, field: str) -> "SpecError":
        return SpecError(field, self.problem)


@dataclass
class Batch:
    """Flattened, sanitised inputs. N = number of (b, t) positions."""

    sampled_ids: torch.Tensor  # (N,) int64
    sampled_logprob: torch.Tensor  # (N,) float
    topk_ids: torch.Tensor | None  # (N, K) int64
    topk_logprobs: torch.Tensor | None  # (N, K) float
    rollout_logits: torch.Tensor | None  # (N, V)
    valid: torch.Tensor  # (N,) bool: response positions
    lead_shape: tuple  # (B, T) or whatever leading shape the caller used
    vocab_size: int
    kept_mask: torch.Tensor | None = None  # (N, V) bool: the engine's kept set (truncated sampling)


def _fail(arg: str, msg: str) -> None:
    raise SpecError(arg, msg)


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
    """``value`` is None (not set) or a positive number (finite unless ``allow_inf``)."""
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


def check_choice(name: str, value, valid) -> None:
    """``value`` is one of ``valid``: the one "valid values are" message of the library."""
    if value not in valid:
        _fail(name, f"unknown value {value!r}; valid values are: {', '.join(map(str, valid))}")


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        _fail(name, f"expected True or False, got {value!r}")


def _check_rollout_tensor(name: str, t: torch.Tensor, kind: str, shape: tuple, what: str, device) -> None:
    """``rollout.<name>``: its dtype (``kind``: ids, float, bool), its shape, its device."""
    if kind == "float" and not t.is_floating_point():
        _fail(name, f"must be a floating-point tensor, got dtype {t.dtype}")
    if kind == "ids" and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        _fail(name, f"must be an integer tensor of token ids, got dtype {t.dtype}")
    if kind == "bool" and t.dtype != torch.bool:
        _fail(name, f"must be a bool tensor (the engine's kept set), got {t.dtype}")
    if kind == "mask" and t.is_complex():
        _fail(name, f"must be bool or 0/1 values, got dtype {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        _fail(name, f"expected shape {tuple(shape)} ({what}), got {tuple(t.shape)}")
    check_device(name, t, device)


def prepare(lead: tuple, V: int, device, rollout, validate: bool = True, checks: Checks | None = None) -> Batch:
    """Check the rollout against the rows of a source (leading shape ``lead``, vocabulary
    ``V``, on ``device``): dtypes, shapes, devices, and (``validate``) values; flatten it to
    (N, ...) and sanitise padding. The value checks go into ``checks`` when given (the caller
    runs them with its own: one host sync for all), else they are run here."""
    if not isinstance(rollout, Rollout):
        _fail("rollout", f"must be a pdmask.Rollout, got {type(rollout).__name__}")
    r, dims = rollout, "the leading dims of logits"
    K = None if r.topk_ids is None else r.topk_ids.shape[-1]
    if r.topk_ids is not None and (r.topk_ids.dim() != len(lead) + 1 or tuple(r.topk_ids.shape[:-1]) != lead):
        _fail("rollout.topk_ids", f"expected shape {lead + ('K',)}, got {tuple(r.topk_ids.shape)}")
    for name, kind, shape, what in (("sampled_ids", "ids", lead, dims), ("sampled_logprob", "float", lead, dims),
                                    ("topk_ids", "ids", lead + (K,), "the rollout's top-K"),
                                    ("topk_logprobs", "float", lead + (K,), "same as rollout.topk_ids"),
                                    ("logits", "float", lead + (V,), "same as logits"),
                                    ("kept_mask", "bool", lead + (V,), "same as logits"),
                                    ("response_mask", "mask", lead, dims)):
        if getattr(r, name) is not None:
            _check_rollout_tensor(f"rollout.{name}", getattr(r, name), kind, shape, what, device)
    if K is not None and not 1 <= K <= V:
        _fail("rollout.topk_ids", "K must be at least 1" if K < 1 else f"K = {K} exceeds the vocabulary size V = {V}")
    valid = torch.ones(lead, dtype=torch.bool, device=device) if r.response_mask is None else r.response_mask.bool()
    valid, ids, lp = valid.reshape(-1), r.sampled_ids.reshape(-1).long(), r.sampled_logprob.reshape(-1)
    tk_ids = None if K is None else r.topk_ids.reshape(-1, K).long()
    tk_lp = None if K is None else r.topk_logprobs.reshape(-1, K)
    if validate:
        own = checks is None
        checks = Checks() if own else checks
        if r.response_mask is not None and r.response_mask.dtype != torch.bool:
            m = r.response_mask.reshape(-1)
            checks.add("rollout.response_mask", "must hold only 0/1 (or bool) values", ((m != 0) & (m != 1)).any())
        _check_values(V, valid, ids, lp, tk_ids, tk_lp, checks)
        if own:
            checks.run()
    # Sanitise padding: a consistent, harmless placeholder row (sampled id 0 in the support,
    # uniform-looking log-probs) so that no NaN/inf is ever computed there.
    pad, filler = ~valid, -math.log(V)
    ids = torch.where(pad, torch.zeros_like(ids), ids)
    lp = torch.where(pad, torch.full_like(lp, filler), lp).clamp(max=0.0)
    if K is not None:
        tk_ids = torch.where(pad[:, None], torch.arange(K, device=tk_ids.device).expand_as(tk_ids), tk_ids)
        tk_lp = torch.where(pad[:, None], torch.full_like(tk_lp, filler), tk_lp).clamp(max=0.0)
    flat = {k: None if getattr(r, k) is None else getattr(r, k).reshape(-1, V) for k in ("logits", "kept_mask")}
    return Batch(ids, lp, tk_ids, tk_lp, flat["logits"], valid, lead, V, flat["kept_mask"])


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
