"""Off-policy corrections, a stage after the token mask, on the detached ``log r`` of a (B, T)
batch (docs/corrections.md): 1. the **IS weight** of the DPPO surrogate (``is_level`` None /
``"token"`` / ``"sequence"``, bounded to ``[is_floor, is_cap]``: truncated, or masked with
``is_mask``; ``is_batch_normalize``); 2. verl 0.9.1's **rejection rules** (``l = clamp(log r,
-20, 20)``, ``k1 = -l``, ``k2 = l^2 / 2``, ``k3 = exp(l) - 1 - l`` per token, or a sequence's
sum / mean / max; k1 keeps ``log(lo) <= stat <= log(hi)``, k2/k3 ``stat <= hi``); 3.
DeepSeek-V3.2's **off-policy sequence mask** (``A < 0`` and the sequence's mean
``log mu_k - log pi_k`` above the threshold). Keep flag: ``M_mode & M_is & M_rules & M_opsm``.
Naive torch of a sequence TIS weight and a ``seq_mean_k3`` rule::

    lr = (logp - sampled_logprob).where(mask, 0); w = lr.sum(-1).exp().clamp(max=C)[:, None]
    keep = ((lr.clamp(-20, 20).exp() - 1 - lr.clamp(-20, 20)) * mask).sum(-1) / mask.sum(-1) <= hi
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import torch

from ._validate import SpecError, check_bool, check_choice, check_positive
from .divergences import floor_neginf, masked_mean
from .stats import MAX_LOG_RATIO
from .surrogates import RATIO_LOG_BOUND, is_weight  # noqa: F401  (is_weight: the DPPO weight, re-exported)

#: IS weight levels (verl ``rollout_is``): ``None`` (no weight), per token, per sequence.
IS_LEVELS = (None, "token", "sequence")
#: Rejection rules (verl 0.9.1 ``rollout_rs`` options).
RULES = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
         "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
#: |log r| bound of the rules' statistics (verl's SAFETY_BOUND; the smooth surrogates' ratio bound too).
RULE_LOG_BOUND = RATIO_LOG_BOUND
#: The IS cap C when none is given (``Corrections(is_cap=None)``).
DEFAULT_IS_CAP = 5.0


# ------------------------------------------------------------------ arguments
@dataclass(frozen=True)
class Rule:
    """One parsed rejection rule: ``name`` in :data:`RULES`, bounds ``lo`` (k1 only), ``hi``."""

    name: str
    lo: float | None
    hi: float


@dataclass(frozen=True)
class Corrections:
    """The off-policy corrections of one loss (module docstring), checked here, once: ``is_cap``
    None is :data:`DEFAULT_IS_CAP` with :attr:`is_cap_given` False (a given cap that would do
    nothing is refused; in ``grpo`` it is also the dual clip unless ``Thresholds.dual_clip``);
    ``rejection`` / ``rejection_threshold`` are parsed into :attr:`rules`."""

    is_level: str | None = "token"
    is_cap: float | None = None
    is_floor: float | None = None
    is_mask: bool = False
    is_batch_normalize: bool = False
    rejection: str | tuple | list | None = None
    rejection_threshold: object = None
    off_policy_mask_threshold: float | None = None
    rules: tuple = field(init=False, default=(), compare=False)
    #: the caller gave ``is_cap`` (not the None default): a cap that would do nothing is then refused
    is_cap_given: bool = field(init=False, default=False, compare=False, repr=False)
    #: the weight is the plain token TIS ``min(r, is_cap)`` (computed by the surrogate itself)
    default_weight: bool = field(init=False, default=True, compare=False, repr=False)
    #: anything beyond the default token TIS (a mask, a rule, another weight): the loss applies them
    active: bool = field(init=False, default=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "is_cap_given", self.is_cap is not None)
        if self.is_cap is None:
            object.__setattr__(self, "is_cap", DEFAULT_IS_CAP)
        is_level, is_cap, is_floor = self.is_level, self.is_cap, self.is_floor
        check_choice("is_level", is_level, IS_LEVELS)
        check_positive("is_cap", is_cap, allow_inf=True)
        if is_floor is not None:
            check_positive("is_floor", is_floor)
            if is_floor >= is_cap:
                raise SpecError("is_floor", f"must be below is_cap = {is_cap}, got {is_floor}")
        for name, why in (("is_mask", "the ratio whose bounds mask"), ("is_batch_normalize", "a weight to normalise")):
            check_bool(name, getattr(self, name))
            if getattr(self, name) and is_level is None:
                raise SpecError(name, f"needs is_level='token' or 'sequence' ({why})")
        check_positive("off_policy_mask_threshold", self.off_policy_mask_threshold)
        object.__setattr__(self, "rules", parse_rejection(self.rejection, self.rejection_threshold))
        for name in ("is_cap", "is_floor", "off_policy_mask_threshold"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, float(getattr(self, name)))
        default = is_level == "token" and is_floor is None and not self.is_mask and not self.is_batch_normalize
        object.__setattr__(self, "default_weight", default)
        object.__setattr__(self, "active", not default or bool(self.rules) or self.off_policy_mask_threshold is not None)

    @classmethod
    def from_fields(cls, obj, **overrides) -> "Corrections":
        """The corrections of a config object whose attributes carry these field names
        (the trainer's and the TRL config); ``overrides`` replace single fields."""
        kw = {name: getattr(obj, name) for name in FIELDS}
        kw.update(overrides)
        return cls(**kw)



#: The correction fields, in one place: what a config object maps onto :class:`Corrections`.
FIELDS = tuple(f.name for f in fields(Corrections) if f.init)


def _number(name: str, text) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        raise SpecError(name, f"expected a number, got {text!r}") from None


def parse_rejection(rejection, rejection_threshold) -> tuple[Rule, ...]:
    """Rules from verl's syntax: ``rejection="token_k1,seq_mean_k3"`` (or a list of names,
    duplicates dropped) and ``rejection_threshold`` = one entry per rule or one shared by
    all, as a comma-separated string or a list. An entry is a number (k2/k3: the upper
    bound; k1: the upper bound ``hi`` with ``lo = 1/hi``), a ``"lo_hi"`` string or a
    ``(lo, hi)`` pair (k1 only)."""
    if rejection is None:
        if rejection_threshold is not None:
            raise SpecError("rejection_threshold", "given without rejection rules (set rejection=...)")
        return ()
    if isinstance(rejection, str):
        names = [s.strip() for s in rejection.split(",") if s.strip()]
    elif isinstance(rejection, (list, tuple)) and all(isinstance(s, str) for s in rejection):
        names = [s.strip() for s in rejection]
    else:
        raise SpecError("rejection", f"expected a rule name, a comma-separated string or a list of names, "
                         f"got {rejection!r}")
    if not names:
        raise SpecError("rejection", "no rule given")
    names = list(dict.fromkeys(names))
    for n in names:
        check_choice("rejection", n, RULES)
    if rejection_threshold is None:
        raise SpecError("rejection_threshold", f"required with rejection={','.join(names)}")
    if isinstance(rejection_threshold, bool):
        raise SpecError("rejection_threshold", f"expected a number, 'lo_hi' or a list, got {rejection_threshold!r}")
    if isinstance(rejection_threshold, (int, float)):
        specs = [rejection_threshold]
    elif isinstance(rejection_threshold, str):
        specs = [s.strip() for s in rejection_threshold.split(",") if s.strip()]
    elif isinstance(rejection_threshold, (list, tuple)):
        specs = list(rejection_threshold)
    else:
        raise SpecError("rejection_threshold", f"expected a number, 'lo_hi' or a list, got {rejection_threshold!r}")
    if len(specs) not in (1, len(names)):
        raise SpecError("rejection_threshold", f"expected 1 or {len(names)} entries (one per rule), got {len(specs)}")
    specs = specs * len(names) if len(specs) == 1 else specs
    return tuple(_rule(n, s) for n, s in zip(names, specs))


def _rule(name: str, spec) -> Rule:
    arg = "rejection_threshold"
    if isinstance(spec, str) and "_" in spec:
        lo_s, hi_s = spec.split("_", 1)
        lo, hi = _number(arg, lo_s), _number(arg, hi_s)
        pair = True
    elif isinstance(spec, (list, tuple)):
        if len(spec) != 2:
            raise SpecError(arg, f"a (lo, hi) pair for {name} must have 2 entries, got {spec!r}")
        lo, hi = _number(arg, spec[0]), _number(arg, spec[1])
        pair = True
    else:
        lo, hi, pair = None, _number(arg, spec), False
    if pair and not name.endswith("k1"):
        raise SpecError(arg, f"{name} takes one upper bound, got the pair {spec!r} (lo_hi is for k1 rules)")
    if not (hi > 0) or math.isinf(hi) or (lo is not None and not (0 < lo <= hi)):
        raise SpecError(arg, f"bounds of {name} must satisfy 0 < lo <= hi < inf, got {spec!r}")
    if name.endswith("k1") and lo is None:
        lo = 1.0 / hi
    return Rule(name, lo, hi)


# ------------------------------------------------------------------ helpers
def _floored(log_ratio: torch.Tensor) -> torch.Tensor:
    """``log r`` detached, with -inf at the dtype's floor so that sums and means stay finite."""
    return floor_neginf(log_ratio.detach())


def _frac(flags: torch.Tensor, valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (flags & valid).sum().to(dtype) / valid.sum().clamp(min=1).to(dtype)


def _seq_frac(tok_flags: torch.Tensor, valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Share of non-empty sequences with at least one flagged response token."""
    has = valid.any(-1)
    return ((tok_flags & valid).any(-1) & has).sum().to(dtype) / has.sum().clamp(min=1).to(dtype)


def _seq_sum(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid, x, torch.zeros_like(x)).sum(-1)  # (B,)


def _seq_mean(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return _seq_sum(x, valid) / valid.sum(-1).clamp(min=1).to(x.dtype)


# ------------------------------------------------------------------ the three stages
def importance_weights(log_ratio: torch.Tensor, response_mask: torch.Tensor,
                       corrections: Corrections | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The IS weight of each response token (``corrections``' ``is_*`` fields; None: the
    default) from the (B, T) ``log_ratio`` (padding may hold anything): ``(w, keep, metrics)``,
    ``w`` detached (0 on padding and masked tokens), ``keep`` False where ``is_mask`` rejects,
    metrics ``is_weight_mean/min/max``, ``is_truncated_frac`` (TIS) or ``masked_frac_is`` /
    ``seq_masked_frac_is`` (``is_mask``)."""
    spec = Corrections() if corrections is None else corrections
    valid = response_mask.bool()
    lr = _floored(log_ratio)
    if spec.is_level is None:
        w = torch.ones_like(lr)
        keep = torch.ones_like(valid)
        m = {}
    else:
        log_w = lr if spec.is_level == "token" else _seq_sum(lr, valid)[:, None].expand_as(lr)  # (B, T)
        raw = log_w.clamp(max=MAX_LOG_RATIO).exp()  # the ratio (or its sequence product), overflow-capped
        lo = 0.0 if spec.is_floor is None else spec.is_floor
        out = (raw > spec.is_cap) | (raw < lo)
        if spec.is_mask:
            keep = ~out
            w = torch.where(keep, raw, torch.zeros_like(raw))
            m = {"masked_frac_is": _frac(out, valid, lr.dtype),
                 "seq_masked_frac_is": _seq_frac(out, valid, lr.dtype)}
        else:
            keep = torch.ones_like(valid)
            w = raw.clamp(min=lo, max=spec.is_cap)
            m = {"is_truncated_frac": _frac(out, valid, lr.dtype)}
        if spec.is_batch_normalize:
            if spec.is_level == "token":
                mean = masked_mean(w, valid)
            else:
                has = valid.any(-1)
                seq_w = _seq_mean(w, valid)
                mean = torch.where(has, seq_w, torch.zeros_like(seq_w)).sum() / has.sum().clamp(min=1)
            ok = mean > 1e-8  # verl's guard against an all-zero batch
            w = torch.where(ok, w / torch.where(ok, mean, torch.ones_like(mean)), w)
            m["is_batch_norm_factor"] = torch.where(ok, mean, torch.ones_like(mean))
    w = torch.where(valid, w, torch.zeros_like(w))
    big = torch.finfo(w.dtype).max
    w_min = torch.where(valid, w, torch.full_like(w, big)).min() if w.numel() else w.new_zeros(())
    m.update({
        "is_weight_mean": masked_mean(w, valid),
        "is_weight_min": torch.where(valid.any(), w_min, torch.zeros_like(w_min)),  # 0 for an empty batch
        "is_weight_max": torch.where(valid, w, torch.zeros_like(w)).max() if w.numel() else w.new_zeros(()),
    })
    return w.detach(), keep | ~valid, {k: v.detach() for k, v in m.items()}


def rule_statistic(name: str, log_ratio: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """The statistic a rule thresholds: (B, T) for ``token_*``, (B,) for ``seq_*``."""
    check_choice("rejection", name, RULES)
    valid = response_mask.bool()
    lr = _floored(log_ratio).clamp(-RULE_LOG_BOUND, RULE_LOG_BOUND)
    k = name[-2:]
    tok = -lr if k == "k1" else (0.5 * lr * lr if k == "k2" else torch.expm1(lr) - lr)
    if name.startswith("token_"):
        return tok
    if name.startswith("seq_sum_"):
        return _seq_sum(tok, valid)
    if name.startswith("seq_mean_"):
        return _seq_mean(tok, valid)
    # seq_max: 0 for a sequence without response tokens (as verl)
    mx = torch.where(valid, tok, torch.full_like(tok, -math.inf)).max(-1).values if tok.shape[-1] else \
        tok.new_zeros(tok.shape[:-1])
    return torch.where(torch.isneginf(mx), torch.zeros_like(mx), mx)


def rejection_mask(log_ratio: torch.Tensor, response_mask: torch.Tensor, rejection,
                   rejection_threshold) -> tuple[torch.Tensor, dict]:
    """The tokens every rule keeps (verl's ``rollout_rs`` syntax, :func:`parse_rejection`):
    ``(keep (B, T) bool, metrics)``, per rule ``masked_frac_rs_<rule>`` (response tokens it
    rejects) and ``seq_masked_frac_rs_<rule>`` (sequences with a rejected token)."""
    return _rejection(parse_rejection(rejection, rejection_threshold), log_ratio, response_mask.bool())


def _rejection(rules, log_ratio, valid):
    keep = torch.ones_like(valid)
    m = {}
    for rule in rules:
        stat = rule_statistic(rule.name, log_ratio, valid)
        if rule.lo is not None:  # k1: log(lo) <= stat <= log(hi)
            ok = (stat >= math.log(rule.lo)) & (stat <= math.log(rule.hi))
        else:
            ok = stat <= rule.hi
        ok = ok if ok.dim() == 2 else ok[:, None].expand_as(valid)
        rej = ~ok & valid
        m[f"masked_frac_rs_{rule.name}"] = _frac(rej, valid, log_ratio.dtype)
        m[f"seq_masked_frac_rs_{rule.name}"] = _seq_frac(rej, valid, log_ratio.dtype)
        keep = keep & ~rej
    return keep, {k: v.detach() for k, v in m.items()}


def off_policy_mask(log_ratio: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
                    off_policy_mask_threshold: float) -> tuple[torch.Tensor, dict]:
    """DeepSeek-V3.2's off-policy sequence mask: a token is masked iff ``A < 0`` and its
    sequence's mean ``log mu_k - log pi_k`` exceeds the threshold. ``(keep, metrics)``."""
    check_positive("off_policy_mask_threshold", off_policy_mask_threshold)
    valid = response_mask.bool()
    adv = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(valid)
    return _opsm(float(off_policy_mask_threshold), log_ratio, adv, valid)


def _opsm(delta, log_ratio, adv, valid):
    seq_kl = _seq_mean(-_floored(log_ratio), valid)  # (B,) mean log(mu/pi)
    rej = (adv < 0) & (seq_kl > delta)[:, None] & valid
    m = {"masked_frac_opsm": _frac(rej, valid, log_ratio.dtype),
         "seq_masked_frac_opsm": _seq_frac(rej, valid, log_ratio.dtype)}
    return ~rej, {k: v.detach() for k, v in m.items()}


@dataclass
class CorrectionResult:
    """``weight`` (B, T) detached IS weight, or None for the plain token TIS (the loss's
    ``min(r, is_cap)``) and for ``ppo-clip``; ``keep`` (B, T) bool; ``metrics`` detached."""

    weight: torch.Tensor | None
    keep: torch.Tensor
    metrics: dict


def apply_corrections(spec: Corrections, log_ratio: torch.Tensor, advantages: torch.Tensor,
                      response_mask: torch.Tensor, *, weighted: bool = True) -> CorrectionResult:
    """All three stages on (B, T) tensors. ``weighted``: the surrogate takes an IS weight
    (:attr:`pdmask.surrogates.Surrogate.takes_is_weight`); the weight is returned only where it
    differs from the surrogate's own (a non-default spec); the metrics add
    ``masked_frac_correction`` / ``seq_masked_frac_correction`` (what any correction masks)."""
    valid = response_mask.bool()
    keep = torch.ones_like(valid)
    m: dict = {}
    weight = None
    if not spec.default_weight:
        w, k_is, m_is = importance_weights(log_ratio, valid, spec)
        weight = w if weighted else None
        keep = keep & k_is
        # a surrogate without an IS weight applies the masks only: its weight is its ratio, not this one
        m.update({k: v for k, v in m_is.items() if weighted or not k.startswith("is_weight")})
    if spec.rules:
        k_rs, m_rs = _rejection(spec.rules, log_ratio, valid)
        keep = keep & k_rs
        m.update(m_rs)
    if spec.off_policy_mask_threshold is not None:
        k_op, m_op = _opsm(spec.off_policy_mask_threshold, log_ratio, advantages, valid)
        keep = keep & k_op
        m.update(m_op)
    if spec.active:
        rej = ~keep & valid
        m["masked_frac_correction"] = _frac(rej, valid, log_ratio.dtype).detach()
        m["seq_masked_frac_correction"] = _seq_frac(rej, valid, log_ratio.dtype).detach()
    return CorrectionResult(weight, keep | ~valid, m)
