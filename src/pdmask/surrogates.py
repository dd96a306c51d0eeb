"""Surrogates: the per-token loss forms a mode names, registered objects (:class:`Surrogate`,
:func:`register_surrogate`; docs/core.md). Each declares its per-token loss, what it accepts
(an IS weight, the cap, the floor, delta, eps, the dual clip), whether its trust region is a
smooth weight on the gradient rather than a 0/1 mask, and the bound on its weight the advantage
check needs; everything that validates a surrogate reads that declaration (:func:`token_loss`,
:func:`check_corrections`, :func:`advantage_limit`). The built-in ones (``r = pi_k / mu_k``,
``delta`` by the sign of A)::

    dppo      -M sg(min(r, C)) A log pi_k                  C = is_cap   (DPPO, METHOD.md section 2)
    ppo-clip  max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), -A C' where A < 0, r > C' (dual clip)
    drpo      -A r + |A| mu_k (r - 1)^2 / (2 delta)         (DRPO, UniRL's unirl/algorithms/drpo.py)
    spo       -A r + |A| (r - 1)^2 / (2 delta)              (SPO, arXiv 2401.16025)
    smooth    -A sg(w) r,   w = 1 - sign(A Ddot) D / delta   (the smooth predictive weight)

The last three mask nothing: their gradient is ``-A w r grad log pi_k``
(:func:`pdmask.masks.smooth_weight`, METHOD.md section 2b), ``r`` clamped to ``exp(±RATIO_LOG_BOUND)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from ._validate import Checks, SpecError, check_choice
from .divergences import floor_neginf
from .stats import MAX_LOG_RATIO


def is_weight(log_ratio: torch.Tensor, is_cap: float) -> torch.Tensor:
    """The detached IS weight ``min(r, C)`` of the DPPO surrogate, ``C = is_cap`` (``inf``:
    no cap but :data:`~pdmask.stats.MAX_LOG_RATIO`). Naive: ``log_ratio.exp().clamp(max=C)``."""
    max_log_w = min(math.log(is_cap), MAX_LOG_RATIO) if math.isfinite(is_cap) else MAX_LOG_RATIO
    return log_ratio.detach().clamp(max=max_log_w).exp()


def delta_by_sign(advantages: torch.Tensor, delta_low: float, delta_high: float) -> torch.Tensor:
    """``delta_high`` where ``A > 0``, else ``delta_low``: the scale of a smooth surrogate."""
    return torch.where(advantages > 0, torch.full_like(advantages, delta_high), torch.full_like(advantages, delta_low))


#: |log r| bound of the smooth surrogates' ratio: UniRL clamps its DRPO/SPO ratio here, verl the
#: statistics of its rollout corrections (``SAFETY_BOUND``, :data:`pdmask.corrections.RULE_LOG_BOUND`).
RATIO_LOG_BOUND = 20.0
#: What a surrogate may accept (:attr:`Surrogate.accepts`): ``is_weight``, a separate detached IS
#: weight multiplies its ``-A log pi_k`` (the corrections' weight, verl's ``is_weights``; a surrogate
#: without it differentiates its ratio pi/mu, already its weight, so only masks apply to it);
#: ``is_cap`` (caps that weight, or is the dual clip); ``is_floor`` (truncates it from below);
#: ``delta`` (its scale, needed); ``eps`` (the ratio clip); ``dual_clip``.
ACCEPTS = ("is_weight", "is_cap", "is_floor", "delta", "eps", "dual_clip")
#: What a surrogate may need of its mode (:attr:`Surrogate.mode_needs`).
MODE_NEEDS = ("divergence_region", "direction")


@dataclass(frozen=True)
class TokenArgs:
    """What a surrogate's per-token loss reads, all of one shape: ``logp`` (log pi_k, the one
    differentiable tensor) and the detached ``log_ratio`` (both with -inf floored), ``adv``,
    ``keep``; ``weight`` (an IS weight, or ``smooth``'s w; detached; None: none given);
    ``is_cap``, ``eps_low`` / ``eps_high``, ``dual_clip``; ``delta`` (by the sign of A, for a
    surrogate that accepts it); ``rollout_logp`` (log mu_k, or None)."""

    logp: torch.Tensor
    log_ratio: torch.Tensor
    adv: torch.Tensor
    keep: torch.Tensor
    weight: torch.Tensor | None
    is_cap: float
    eps_low: float
    eps_high: float
    dual_clip: float | None
    delta: torch.Tensor | None
    rollout_logp: torch.Tensor | None


@dataclass(frozen=True)
class Surrogate:
    """A per-token loss form, registered by name (:func:`register_surrogate`). ``loss(TokenArgs)
    -> (per-token loss, effective keep)``: 0 with gradient 0 where a token is masked (or a
    constant, as PPO's clipped tokens); ``accepts`` a subset of :data:`ACCEPTS`;
    ``weight_bound(cap, delta, log_floor) -> W``: the largest ``|loss| / |A|`` of a token (``cap``
    finite, ``log_floor = |log tiny|``), the advantage check's bound; ``smooth(stats, mode,
    estimator) -> (D, direction)``: its trust region is the weight ``1 - sign(A direction) D /
    delta`` on the gradient, not a mask (None: a 0/1 mask); ``needs_weight``: its loss reads that
    weight; ``mode_needs`` of :data:`MODE_NEEDS`; ``doc``."""

    name: str
    loss: Callable[[TokenArgs], tuple[torch.Tensor, torch.Tensor]]
    accepts: frozenset
    weight_bound: Callable[[float, float | None, float], float]
    smooth: Callable | None = None
    needs_weight: bool = False
    mode_needs: tuple = ()
    doc: str = ""

    @property
    def takes_is_weight(self) -> bool:
        """A separate IS weight multiplies it (``dppo``); else its ratio pi/mu is its weight."""
        return "is_weight" in self.accepts


#: The registered surrogates by name; :data:`SMOOTH_SURROGATES` the names of the smooth ones.
SURROGATES: dict[str, Surrogate] = {}
SMOOTH_SURROGATES: list[str] = []


def register_surrogate(s: Surrogate, *, overwrite: bool = False) -> Surrogate:
    """Add a surrogate (checked first: a surrogate without its declaration is refused)."""
    if not isinstance(s, Surrogate):
        raise SpecError("surrogate", f"expected a pdmask.masks.Surrogate, got {type(s).__name__}")
    for part in ("loss", "weight_bound"):
        if not callable(getattr(s, part)):
            raise SpecError(part, f"surrogate {s.name!r} needs a callable {part}")
    if not isinstance(s.accepts, frozenset) or not s.accepts <= set(ACCEPTS):
        raise SpecError("accepts", f"surrogate {s.name!r}: a frozenset of {', '.join(ACCEPTS)}; got {s.accepts!r}")
    if s.smooth is not None and (not callable(s.smooth) or "delta" not in s.accepts):
        raise SpecError("smooth", f"surrogate {s.name!r}: a smooth weight is a callable and reads delta "
                                  "(declare 'delta' in accepts)")
    if s.needs_weight and s.smooth is None:
        raise SpecError("needs_weight", f"surrogate {s.name!r} reads a smooth weight it does not declare (smooth)")
    for need in s.mode_needs:
        check_choice("mode_needs", need, MODE_NEEDS)
    err = _probe(s)
    if err:
        raise SpecError("surrogate", f"{s.name!r} on the registration probe: {err}")
    if s.name in SURROGATES and not overwrite:
        raise SpecError("surrogate", f"{s.name!r} is already registered (pass overwrite=True to replace it)")
    SURROGATES[s.name] = s
    SMOOTH_SURROGATES[:] = [n for n, d in SURROGATES.items() if d.smooth is not None]
    return s


def _probe(s: Surrogate) -> str | None:
    """What is wrong with a surrogate's loss on a fixed float64 probe (7 tokens, log r from -30
    to 25, log pi_k down to -700, is_cap 5, delta 0.05), or None: a per-token loss and keep mask of
    the input's shape, finite, and within ``|A| * weight_bound`` (the advantage check's bound)."""
    f64 = torch.float64
    logp = torch.tensor([-1e-3, -0.7, -5.0, -700.0, -3.0, -40.0, -0.1], dtype=f64, requires_grad=True)
    lr = torch.tensor([0.2, -0.3, 3.0, -30.0, 25.0, -30.0, 0.0], dtype=f64)
    adv = torch.tensor([1.3, -1.3, 1.3, -1.3, 1.3, -1.3, 1.3], dtype=f64)
    keep = torch.ones(7, dtype=torch.bool)
    delta = torch.full_like(adv, 0.05) if "delta" in s.accepts else None
    w = torch.ones_like(adv) if s.needs_weight else None
    try:
        per, keep_eff = s.loss(TokenArgs(logp, lr, adv, keep, w, 5.0, 0.2, 0.28, None, delta, (logp - lr).detach()))
    except Exception as e:  # a declaration that does not match its loss: say so at registration
        return f"the loss raised {type(e).__name__}: {e}"
    if not (isinstance(per, torch.Tensor) and isinstance(keep_eff, torch.Tensor) and per.shape == logp.shape
            and keep_eff.shape == logp.shape and keep_eff.dtype == torch.bool):
        return "loss(args) must return (per-token loss, bool keep mask), each shaped like args.logp"
    bound = adv.abs() * s.weight_bound(5.0, 0.05 if delta is not None else None, -math.log(torch.finfo(f64).tiny))
    if not bool(torch.isfinite(per).all()) or bool((per.detach().abs() > bound * (1 + 1e-9)).any()):
        return "a token's |loss| exceeds |A| * weight_bound (or is not finite): weight_bound must bound it"
    return None


def get_surrogate(name) -> Surrogate:
    """The registered surrogate of that name (a :class:`Surrogate` is returned as is)."""
    if isinstance(name, Surrogate):
        return name
    check_choice("surrogate", name, SURROGATES)
    return SURROGATES[name]


def bounded_ratio(logp: torch.Tensor, log_ratio: torch.Tensor) -> torch.Tensor:
    """``r = pi_k / mu_k`` with value ``exp(clamp(log r, ±RATIO_LOG_BOUND))`` and gradient
    ``r grad log pi_k`` inside the bound (0 beyond): UniRL's
    ``exp(clamp(new_logp - old_logp, -20, 20))`` from the detached ``log_ratio``."""
    return (logp - logp.detach() + log_ratio.detach()).clamp(-RATIO_LOG_BOUND, RATIO_LOG_BOUND).exp()


def _masked(per: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.where(keep, per, torch.zeros_like(per)), keep


def _dppo(a: TokenArgs):
    w = is_weight(a.log_ratio, a.is_cap) if a.weight is None else a.weight
    return _masked(-w * a.adv * a.logp, a.keep)


def _ppo_clip(a: TokenArgs):
    cap = a.is_cap if a.dual_clip is None else a.dual_clip
    # r with value exp(log_ratio) and gradient r * grad(log pi_k)
    r = (a.logp - a.logp.detach() + a.log_ratio.detach()).clamp(max=MAX_LOG_RATIO).exp()
    per = torch.maximum(-a.adv * r, -a.adv * r.clamp(1 - a.eps_low, 1 + a.eps_high))
    dual = (a.adv < 0) & (r.detach() > cap)  # never true when the cap is inf
    if math.isfinite(cap):
        per = torch.where(dual, -a.adv * cap, per)
    # Clipped tokens keep their (constant) PPO value; their gradient is 0.
    return per, a.keep & ~dual


def _quadratic(a: TokenArgs, penalty: torch.Tensor, r: torch.Tensor):
    return _masked(-a.adv * r + a.adv.abs() * penalty / (2 * a.delta), a.keep)


def _drpo(a: TokenArgs):
    r = bounded_ratio(a.logp, a.log_ratio)
    lmu = (a.logp.detach() - a.log_ratio) if a.rollout_logp is None else floor_neginf(a.rollout_logp.detach())
    return _quadratic(a, lmu.to(a.logp.dtype).exp() * (r - 1).square(), r)


def _spo(a: TokenArgs):
    r = bounded_ratio(a.logp, a.log_ratio)
    return _quadratic(a, (r - 1).square(), r)


def _smooth(a: TokenArgs):
    return _masked(-a.adv * a.weight * bounded_ratio(a.logp, a.log_ratio), a.keep)


def _ratio_dir(dist: Callable) -> Callable:
    """A smooth weight on ``dist(stats)`` with the ratio direction ``log r``."""
    return lambda st, mode, estimator: (dist(st), st["log_ratio"])


_R = math.exp(RATIO_LOG_BOUND)  # the smooth surrogates' largest ratio
for _s in (
    Surrogate("dppo", _dppo, frozenset({"is_weight", "is_cap", "is_floor"}), lambda cap, d, lp: cap * lp,
              doc="-M sg(min(r, C)) A log pi_k (the IS weight: Corrections)"),
    Surrogate("ppo-clip", _ppo_clip, frozenset({"eps", "dual_clip", "is_cap"}),
              lambda cap, d, lp: math.exp(MAX_LOG_RATIO), doc="PPO's clipped ratio, dual clip C' (is_cap or dual_clip)"),
    Surrogate("drpo", _drpo, frozenset({"delta"}), lambda cap, d, lp: _R * (1 + 1 / (2 * d)),
              smooth=_ratio_dir(lambda st: st["binary_tv"]), doc="-A r + |A| mu_k (r - 1)^2 / (2 delta)"),
    Surrogate("spo", _spo, frozenset({"delta"}), lambda cap, d, lp: _R + _R * _R / (2 * d),
              smooth=_ratio_dir(lambda st: (st["ratio"] - 1).abs()), doc="-A r + |A| (r - 1)^2 / (2 delta)"),
    Surrogate("smooth", _smooth, frozenset({"delta"}), lambda cap, d, lp: _R * (1 + lp / d),
              smooth=lambda st, mode, est: (st[mode.region.divergence], mode.direction(st, est)), needs_weight=True,
              mode_needs=("divergence_region", "direction"), doc="-A sg(w) r, w = 1 - sign(A Ddot) D / delta"),
):
    register_surrogate(_s)


# ------------------------------------------------------------------ the per-token loss
def token_loss(logp: torch.Tensor, log_ratio: torch.Tensor, advantages: torch.Tensor, keep: torch.Tensor, *,
               surrogate: str = "dppo", is_cap: float = 5.0, eps_low: float = 0.2, eps_high: float = 0.2,
               weight: torch.Tensor | None = None, dual_clip: float | None = None, delta_low: float | None = None,
               delta_high: float | None = None, rollout_logp: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Per-token surrogate (module docstring) of the differentiable ``logp`` (log pi_k), the
    detached ``log_ratio``, the advantages and the ``keep`` mask, all one shape, and the
    effective keep mask (the dual clip masks more); masked tokens give exactly 0, gradient 0.
    ``weight``: the IS weight of a surrogate that takes one (``dppo``: in place of ``min(r,
    is_cap)``, a correction's), ``smooth``'s ``w`` (:func:`smooth_weight`); ``dual_clip`` None:
    ``is_cap``; ``delta_*``: the scale of ``drpo`` / ``spo``; ``rollout_logp``: ``log mu_k`` for
    ``drpo`` (None: ``logp - log_ratio``). What a surrogate accepts is its declaration's."""
    s = get_surrogate(surrogate)
    if weight is not None and not (s.takes_is_weight or s.needs_weight):
        raise SpecError("weight", f"the {s.name} surrogate takes no separate IS weight (its ratio is the weight)")
    if weight is None and s.needs_weight:
        raise SpecError("weight", f"the {s.name} surrogate needs its weight w (pdmask.masks.smooth_weight)")
    if "delta" in s.accepts and (delta_low is None or delta_high is None):
        raise SpecError("delta_low / delta_high", f"the {s.name} surrogate needs its scale delta")
    return _token_loss(logp, log_ratio, advantages, keep, s, is_cap, eps_low, eps_high, weight, dual_clip,
                       delta_low, delta_high, rollout_logp)


def _token_loss(logp, log_ratio, advantages, keep, surrogate: Surrogate, is_cap, eps_low, eps_high, weight, dual_clip,
                delta_low, delta_high, rollout_logp):
    """:func:`token_loss` on arguments already checked (a :class:`pdmask.PolicyLoss`'s)."""
    adv = advantages.to(logp.dtype)
    # A sampled token the trainer gives probability exactly 0 (a -inf logit): its value is
    # floored so that 0 * inf cannot appear; its gradient is 0 (the logit cannot move).
    logp = floor_neginf(logp)
    log_ratio = floor_neginf(log_ratio)
    w = None if weight is None else weight.detach().to(logp.dtype)
    delta = delta_by_sign(adv, delta_low, delta_high) if "delta" in surrogate.accepts else None
    return surrogate.loss(TokenArgs(logp, log_ratio, adv, keep, w, is_cap, eps_low, eps_high, dual_clip, delta,
                                    rollout_logp))


def advantage_limit(surrogate, is_cap: float, dtype: torch.dtype, *, delta: float | None = None) -> float:
    """The largest ``sum |A|`` over the response tokens for which the loss cannot overflow
    ``dtype`` (:func:`pdmask.policy_loss` refuses larger ones rather than return inf/NaN):
    ``finfo.max / W``, ``W`` the surrogate's :attr:`Surrogate.weight_bound` (a token's loss is
    ``|A|`` times at most ``W``): ``dppo`` ``is_cap`` (or ``exp(MAX_LOG_RATIO)``) times ``|log
    tiny|``; ``ppo-clip`` ``exp(MAX_LOG_RATIO)``; with ``R = exp(RATIO_LOG_BOUND)`` and ``delta``
    the smallest scale, ``drpo`` ``R (1 + 1 / (2 delta))``, ``spo`` ``R + R^2 / (2 delta)``,
    ``smooth`` ``R (1 + |log tiny| / delta)`` (a floored KL is at most ``|log tiny|``)."""
    s = get_surrogate(surrogate)
    fi = torch.finfo(dtype)
    if "delta" in s.accepts and delta is None:
        raise SpecError("delta", f"the {s.name} surrogate's bound needs its smallest scale delta")
    cap = is_cap if math.isfinite(is_cap) else math.exp(MAX_LOG_RATIO)
    return fi.max / s.weight_bound(cap, delta, -math.log(fi.tiny))


def check_advantage_scale(checks: Checks, adv, valid, dtype: torch.dtype, surrogate, is_cap: float,
                          delta: float | None = None, behaviour_cap: float | None = None) -> None:
    """``sum |A|`` within :func:`advantage_limit` of the loss's dtype (``dtype`` promoted to float32),
    divided by ``behaviour_cap`` (an anchored loss's bound on its behaviour weight) when given."""
    s = get_surrogate(surrogate)
    dtype = torch.promote_types(dtype, torch.float32)
    limit = advantage_limit(s, is_cap, dtype, delta=delta)
    if behaviour_cap is not None:
        limit = limit / (behaviour_cap if math.isfinite(behaviour_cap) else math.exp(MAX_LOG_RATIO))
    total = torch.where(valid, adv.detach().double().abs(), torch.zeros((), dtype=torch.float64,
                                                                               device=adv.device)).sum()
    what = f"delta={delta:g}" if "delta" in s.accepts else f"is_cap={is_cap:g}"
    checks.add("advantages", f"sum of |A| over the response tokens exceeds {limit:.3g}, beyond which the "
               f"{str(dtype).removeprefix('torch.')} loss ({s.name} surrogate, {what}) could "
               "overflow to inf/NaN; scale the advantages down (normalise them)", total > limit)


def ratio_weight(log_ratio: torch.Tensor, corrections) -> torch.Tensor:
    """An anchored loss's ratio part of the IS weight, ``r' = pi/pi_old``, under the
    :class:`pdmask.Corrections` ``corrections``: ``min(r', C)``, and ``clip(r', is_floor, C)`` when
    they truncate from below (``cispo``), computed as :func:`pdmask.importance_weights` truncates,
    so that anchor = mu gives today's weight."""
    c = corrections
    if c.is_floor is None or c.is_mask:
        return is_weight(log_ratio, c.is_cap)
    return log_ratio.detach().clamp(max=MAX_LOG_RATIO).exp().clamp(min=c.is_floor, max=c.is_cap)


def check_corrections(surrogate, corrections, *, dual_clip: float | None = None, mode: str = "") -> None:
    """What a surrogate cannot honour of :class:`pdmask.Corrections`, from its declaration: one
    that takes no IS weight (it differentiates its ratio pi/mu, already the token IS weight)
    takes only masks; a given ``is_cap`` that bounds nothing is refused (no IS weight without
    ``is_mask``, unless it is the surrogate's dual clip and ``dual_clip`` is None; ``dppo`` with
    ``is_level=None``). ``mode`` names the mode in the errors."""
    s = get_surrogate(surrogate)
    c = corrections
    if s.takes_is_weight:
        if c.is_level is None and c.is_cap_given:
            raise SpecError("is_cap", "bounds the IS weight, and is_level=None applies none (w = 1), so it would "
                                      "be ignored; set is_level='token' or 'sequence', or remove is_cap")
        return
    who = f"{mode} (the {s.name} surrogate)" if mode else f"the {s.name} surrogate"
    if c.is_level == "sequence" and not c.is_mask:
        raise SpecError("is_level", f"'sequence' weights are refused with {who}: its ratio pi/mu already "
                                    "is the token IS weight; use is_mask=True for a sequence mask")
    if c.is_floor is not None and not c.is_mask:
        raise SpecError("is_floor", f"truncating from below is refused with {who}: its ratio pi/mu is its "
                                    "own weight; use is_mask=True to mask below is_floor")
    if c.is_batch_normalize:
        raise SpecError("is_batch_normalize", f"refused with {who}, which applies no separate IS weight")
    dual = "dual_clip" in s.accepts and "is_cap" in s.accepts
    if c.is_cap_given and not c.is_mask and (not dual or dual_clip is not None):
        what = "dual_clip is the dual-clip constant" if dual else "its ratio is the weight"
        raise SpecError("is_cap", f"bounds nothing with {who} without is_mask ({what}), so it would be "
                                  "ignored; set is_mask=True for an IS mask [is_floor, is_cap], or remove is_cap")
