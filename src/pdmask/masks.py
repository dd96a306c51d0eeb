"""Modes: a proximity test times a direction test, and a per-token surrogate (docs/core.md).

A token is masked iff it is **out of the region** (:func:`beyond_delta`: ``D > delta_high``
for ``A > 0``, ``D > delta_low`` for ``A < 0``; ``grpo``: ``r`` outside ``[1 - eps_low,
1 + eps_high]``) and its update is **outward** (:func:`outward`: ``A * direction > 0``, the
direction ``log r`` for :func:`ratio_sign`, ``Ddot`` for :func:`predictive`). A mode is data,
registered by name; its ``extras`` are per-token tensors the caller supplies
(``policy_loss(..., extras=...)``; :mod:`pdmask.lab.batchmask` registers its modes so).
Surrogates (:func:`token_loss`; ``r = pi_k / mu_k``, ``delta`` by the sign of A)::

    dppo      -M sg(min(r, C)) A log pi_k                  C = is_cap   (DPPO, METHOD.md section 2)
    ppo-clip  max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), -A C' where A < 0, r > C' (dual clip)
    drpo      -A r + |A| mu_k (r - 1)^2 / (2 delta)         (DRPO, UniRL's unirl/algorithms/drpo.py)
    spo       -A r + |A| (r - 1)^2 / (2 delta)              (SPO, arXiv 2401.16025)
    smooth    -A sg(w) r,   w = 1 - sign(A Ddot) D / delta   (the smooth predictive weight)

The last three mask nothing: their gradient is ``-A w r grad log pi_k`` (:func:`smooth_weight`,
METHOD.md section 2b), ``r`` clamped to ``exp(±RATIO_LOG_BOUND)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from ._validate import Checks, SpecError, check_choice, check_positive
from .corrections import RULE_LOG_BOUND, is_weight
from .divergences import floor_neginf
from .keys import DDOT_KEY, DIVERGENCES, ESTIMATORS, SUPPORTS
from .stats import MAX_LOG_RATIO

Stats = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class Thresholds:
    """Trust-region thresholds: ``delta_low`` / ``delta_high`` of the divergence regions
    (A < 0 / A > 0) and the smooth surrogates' scale (None: the mode's ``default_delta``,
    0.05 for KL, 0.15 for TV; inf: never out); ``eps_low`` / ``eps_high``, grpo's ratio clip
    (clip-higher: ``eps_high = 0.28``; ``eps_low < 1``); ``dual_clip``, grpo's dual-clip
    constant C > 1 (verl's ``clip_ratio_c``; None: ``Corrections.is_cap``, the one setting the
    two were before; :meth:`resolve` refuses it for the other surrogates)."""

    delta_low: float | None = None
    delta_high: float | None = None
    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip: float | None = None

    def __post_init__(self) -> None:
        for name in ("delta_low", "delta_high", "eps_low", "eps_high", "dual_clip"):
            v = getattr(self, name)
            if v is None and name.startswith("eps"):
                raise SpecError(name, "must be a positive number, got None")
            check_positive(name, v, allow_inf=not name.startswith("eps"))
        if self.eps_low >= 1:
            # the clip range [1 - eps_low, 1 + eps_high] would reach r <= 0: no lower clip at all
            raise SpecError("eps_low", f"must be < 1 (the ratio clip's lower end is 1 - eps_low > 0), "
                                       f"got {self.eps_low!r}")
        if self.dual_clip is not None and not self.dual_clip > 1:
            # verl asserts clip_ratio_c > 1: a cap at or below 1 would clip on-policy tokens
            raise SpecError("dual_clip", f"must be > 1 (the cap on r of the A < 0 tokens), got {self.dual_clip!r}")

    def resolve(self, mode: "MaskMode") -> "Thresholds":
        """These thresholds with a None delta replaced by the mode's default (a ``dual_clip``
        for a mode without the ``ppo-clip`` surrogate is refused: it would do nothing)."""
        if self.dual_clip is not None and mode.surrogate != "ppo-clip":
            raise SpecError("dual_clip", f"applies to the ppo-clip surrogate (grpo) only; mode {mode.name!r} uses "
                                         f"the {mode.surrogate} surrogate, which has no dual clip; remove dual_clip")
        if self.delta_low is not None and self.delta_high is not None:
            return self
        dl = mode.default_delta if self.delta_low is None else self.delta_low
        dh = mode.default_delta if self.delta_high is None else self.delta_high
        return Thresholds(dl, dh, self.eps_low, self.eps_high, self.dual_clip)


def resolve_thresholds(thresholds: Thresholds | None, mode: MaskMode) -> Thresholds:
    """``thresholds`` with the mode's default deltas where they give none (None: all of them)."""
    return (Thresholds() if thresholds is None else thresholds).resolve(mode)


Region = Callable[[Stats, torch.Tensor, Thresholds], torch.Tensor]
#: Surrogates a mode may name (see :func:`token_loss`).
SURROGATES = ("dppo", "ppo-clip", "drpo", "spo", "smooth")
#: Surrogates whose trust region is a smooth weight on the gradient, not a 0/1 mask: DRPO,
#: SPO and the smooth predictive weight (:func:`smooth_weight`). Like ``ppo-clip`` their ratio
#: pi/mu keeps its gradient and is the token IS weight.
SMOOTH_SURROGATES = ("drpo", "spo", "smooth")
#: Parts of the statistics a mode may need: the rollout's top-K, its full logits.
NEEDS = ("topk", "full")
Direction = Callable[[Stats, str], torch.Tensor]


def beyond_delta(value: torch.Tensor, advantages: torch.Tensor, delta_low: float, delta_high: float) -> torch.Tensor:
    """The region rule: ``value > delta_high`` where ``A > 0``, ``value > delta_low`` where
    ``A < 0``; a token with ``A = 0`` is never out (its update is zero)."""
    return ((advantages > 0) & (value > delta_high)) | ((advantages < 0) & (value > delta_low))


def outward(direction: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """The outward rule: the token's update moves along ``direction`` (a ``Ddot``, or ``log r``)
    iff ``A * direction > 0``."""
    return advantages * direction > 0


def delta_by_sign(advantages: torch.Tensor, delta_low: float, delta_high: float) -> torch.Tensor:
    """``delta_high`` where ``A > 0``, else ``delta_low``: the scale of a smooth surrogate."""
    return torch.where(advantages > 0, torch.full_like(advantages, delta_high), torch.full_like(advantages, delta_low))


def divergence_region(key: str) -> Region:
    """Out of region iff ``stats[key] > delta`` (delta by the sign of A)."""

    def region(stats: Stats, adv: torch.Tensor, th: Thresholds) -> torch.Tensor:
        return beyond_delta(stats[key], adv, th.delta_low, th.delta_high)

    region.divergence = key
    return region


def ratio_region() -> Region:
    """Out of region iff ``r > 1 + eps_high`` or ``r < 1 - eps_low`` (and A != 0)."""
    return lambda st, adv, th: (adv != 0) & ((st["ratio"] > 1 + th.eps_high) | (st["ratio"] < 1 - th.eps_low))


def ratio_deviation_region() -> Region:
    """Out of region iff ``|r - 1| > delta`` (by the sign of A): where SPO's weight turns negative."""
    return lambda st, adv, th: beyond_delta((st["ratio"] - 1).abs(), adv, th.delta_low, th.delta_high)


def ratio_sign() -> Direction:
    """The ratio direction test: outward iff ``A (r - 1) > 0``, the sign of ``log r`` (PPO, DPPO)."""
    return lambda stats, estimator: stats["log_ratio"]


def predictive(divergence: str) -> Direction:
    """The predictive direction test: outward iff ``A * Ddot > 0`` of the named divergence
    (top-K ones with the estimator)."""
    check_choice("divergence", divergence, DIVERGENCES)
    return lambda stats, estimator: stats[DDOT_KEY[divergence, estimator]]


@dataclass(frozen=True)
class MaskMode:
    """A named trust-region mask (module docstring). ``divergence``: the one it reports, whose
    predictive direction the disagreement diagnostic compares with the ratio's (``binary_kl``
    stands in without top-K); ``surrogate`` one of :data:`SURROGATES`; ``needs`` parts of the
    statistics (:data:`NEEDS`); ``default_delta`` when the caller gives none; ``extras``
    names of the per-token tensors the caller passes as ``extras={name: (B, T) tensor}``
    (the extension point); ``supports`` the supports of the top-K divergences it works on."""

    name: str
    region: Region
    direction: Direction | None
    divergence: str
    surrogate: str = "dppo"
    needs: frozenset = field(default_factory=frozenset)
    default_delta: float = 0.05
    doc: str = ""
    extras: tuple = ()
    supports: tuple = SUPPORTS


MODES: dict[str, MaskMode] = {}


def register_mode(mode: MaskMode, *, overwrite: bool = False) -> MaskMode:
    """Add a mode to the registry (``overwrite=True`` to replace one)."""
    check_mode(mode)
    if mode.name in MODES and not overwrite:
        raise SpecError("mode", f"{mode.name!r} is already registered (pass overwrite=True to replace it)")
    MODES[mode.name] = mode
    return mode


def check_mode(mode: MaskMode) -> None:
    """A mode's fields are usable (callable region and direction, known surrogate and needs)."""
    if not callable(mode.region):
        raise SpecError("region", f"mode {mode.name!r} needs a callable region(stats, adv, thresholds), "
                                  f"got {mode.region!r}")
    if mode.direction is not None and not callable(mode.direction):
        raise SpecError("direction", f"mode {mode.name!r} needs a callable direction(stats, estimator) or None, "
                                     f"got {mode.direction!r}")
    check_choice("divergence", mode.divergence, DIVERGENCES)
    check_choice("surrogate", mode.surrogate, SURROGATES)
    if mode.surrogate == "smooth" and (getattr(mode.region, "divergence", None) is None or mode.direction is None):
        raise SpecError("surrogate", f"'smooth' (mode {mode.name!r}) weighs by the region's divergence and the "
                                     "direction test: it needs a divergence_region(...) and a direction")
    for need in mode.needs:
        check_choice("needs", need, NEEDS)
    for s in mode.supports:
        check_choice("supports", s, SUPPORTS)
    if not all(isinstance(e, str) for e in mode.extras):
        raise SpecError("extras", f"mode {mode.name!r}: expected a tuple of names, got {mode.extras!r}")


def get_mode(name: str) -> MaskMode:
    """The registered mode of that name; a :class:`MaskMode` is checked and returned as is."""
    if isinstance(name, MaskMode):
        check_mode(name)
        return name
    check_choice("mode", name, MODES)
    return MODES[name]


_TOPK, _FULL = frozenset({"topk"}), frozenset({"full"})
for _m in [
    MaskMode("grpo", ratio_region(), ratio_sign(), "topk_kl", surrogate="ppo-clip",
             doc="PPO/GRPO ratio clip [1-eps_low, 1+eps_high] (clip-higher: raise eps_high)"),
    MaskMode("none", divergence_region("topk_kl"), None, "topk_kl",
             doc="IS-weighted policy gradient, no trust region (regions reported only)"),
    MaskMode("dppo-binary-tv", divergence_region("binary_tv"), ratio_sign(), "binary_tv",
             default_delta=0.15, doc="DPPO: |pi_k - mu_k| > delta, ratio direction"),
    MaskMode("dppo-binary-kl", divergence_region("binary_kl"), ratio_sign(), "binary_kl",
             doc="DPPO: Bernoulli KL of the sampled token > delta, ratio direction"),
    MaskMode("dppo-topk-kl", divergence_region("topk_kl"), ratio_sign(), "topk_kl", needs=_TOPK,
             doc="DPPO: top-K KL > delta, ratio direction"),
    MaskMode("dppo-topk-tv", divergence_region("topk_tv"), ratio_sign(), "topk_tv", needs=_TOPK,
             default_delta=0.15, doc="DPPO: top-K TV > delta, ratio direction"),
    MaskMode("pdm-topk-kl", divergence_region("topk_kl"), predictive("topk_kl"), "topk_kl", needs=_TOPK,
             doc="predictive mask: top-K KL > delta and A*Ddot > 0"),
    MaskMode("pdm-topk-tv", divergence_region("topk_tv"), predictive("topk_tv"), "topk_tv", needs=_TOPK,
             default_delta=0.15, doc="predictive mask: top-K TV > delta and A*Ddot > 0"),
    MaskMode("pdm-full-kl", divergence_region("full_kl"), predictive("full_kl"), "full_kl", needs=_FULL,
             doc="predictive mask on the full-vocabulary KL (needs rollout_logits)"),
    MaskMode("pdm-full-tv", divergence_region("full_tv"), predictive("full_tv"), "full_tv", needs=_FULL,
             default_delta=0.15, doc="predictive mask on the full-vocabulary TV (needs rollout_logits)"),
    # smooth trust regions: no mask, a weight 1 - sign(A * direction) * D / delta on the gradient
    MaskMode("drpo", divergence_region("binary_tv"), ratio_sign(), "binary_tv", surrogate="drpo",
             default_delta=0.15,
             doc="DRPO: -A r + |A| mu_k (r-1)^2 / (2 delta); weight 1 - sign(A(r-1)) |pi_k - mu_k| / delta, no mask"),
    MaskMode("spo", ratio_deviation_region(), ratio_sign(), "topk_kl", surrogate="spo", default_delta=0.2,
             doc="SPO: -A r + |A| (r-1)^2 / (2 delta); weight 1 - sign(A(r-1)) |r - 1| / delta, no mask"),
    MaskMode("pdm-smooth-topk-kl", divergence_region("topk_kl"), predictive("topk_kl"), "topk_kl",
             surrogate="smooth", needs=_TOPK,
             doc="smooth predictive weight (experimental): 1 - sign(A*Ddot) topk_kl / delta, no mask"),
    MaskMode("pdm-smooth-topk-tv", divergence_region("topk_tv"), predictive("topk_tv"), "topk_tv",
             surrogate="smooth", needs=_TOPK, default_delta=0.15,
             doc="smooth predictive weight (experimental): 1 - sign(A*Ddot) topk_tv / delta, no mask"),
]:
    register_mode(_m)


def check_inputs_for(mode: MaskMode, has_topk: bool, has_full: bool, extras=(), *, where: str = "rollout.") -> None:
    """The mode's inputs are there: its :attr:`MaskMode.extras` among ``extras``, the parts it
    needs (``where`` names their holder: ``"rollout."`` or ``"stats."``)."""
    for name in mode.extras:
        if name not in extras:
            raise SpecError("extras", f"mode {mode.name!r} reads the per-token tensor {name!r}; pass "
                                      f"extras={{{name!r}: (B, T) tensor}} ({mode.doc})")
    if "topk" in mode.needs and not has_topk:
        raise SpecError(f"{where}topk_ids" if where == "rollout." else "stats.topk",
                        f"mode {mode.name!r} needs the rollout top-K ids and log-probs")
    if "full" in mode.needs and not has_full:
        raise SpecError(f"{where}logits" if where == "rollout." else "stats.full",
                        f"mode {mode.name!r} needs the rollout policy's full logits")


@dataclass
class MaskResult:
    """Per-token tensors of one mask decision, shaped like the advantages (all detached)."""

    keep: torch.Tensor  # bool: M = 1
    out_of_region: torch.Tensor  # bool
    outward: torch.Tensor  # bool: the mode's direction says outward (False if no direction)
    ratio_outward: torch.Tensor  # bool
    predictive_outward: torch.Tensor  # bool, for the mode's (diagnostic) divergence
    divergence: torch.Tensor  # the diagnostic divergence values
    weight: torch.Tensor | None = None  # the smooth surrogates' gradient weight (smooth_weight), else None


def smooth_weight(stats: Stats, advantages: torch.Tensor, mode, *, estimator: str = "exact",
                  thresholds: Thresholds | None = None) -> torch.Tensor:
    """The gradient weight ``w = 1 - sign(A * direction) * D / delta`` of a smooth surrogate
    (detached; ``delta`` by the sign of A): ``drpo`` ``D = |pi_k - mu_k|``, ``spo`` ``D = |r - 1|``
    (direction ``r - 1``), ``smooth`` the region's divergence and the mode's direction test.
    ``w < 0`` exactly where the hard mask masks; ``A = 0`` gives ``w = 1``. Naive torch
    (``pdm-smooth-topk-kl``)::

        w = 1 - torch.sign(A * st["ddot_topk_kl_exact"]) * st["topk_kl"] / torch.where(A > 0, dh, dl)
    """
    mode = get_mode(mode)
    if mode.surrogate not in SMOOTH_SURROGATES:
        raise SpecError("mode", f"{mode.name!r} uses the {mode.surrogate} surrogate, which has no smooth weight; "
                                f"the smooth ones are: {', '.join(SMOOTH_SURROGATES)}")
    check_choice("estimator", estimator, ESTIMATORS)
    return _smooth_weight(stats, advantages, mode, estimator, resolve_thresholds(thresholds, mode))


def _smooth_weight(stats: Stats, advantages, mode: MaskMode, estimator: str, th: Thresholds) -> torch.Tensor:
    adv = advantages.to(stats["log_ratio"].dtype)
    if mode.surrogate == "spo":
        dist, direction = (stats["ratio"] - 1).abs(), stats["log_ratio"]
    elif mode.surrogate == "drpo":
        dist, direction = stats["binary_tv"], stats["log_ratio"]
    else:
        dist, direction = stats[mode.region.divergence], mode.direction(stats, estimator)
    delta = delta_by_sign(adv, th.delta_low, th.delta_high)
    return (1 - torch.sign(adv * direction) * dist.to(adv.dtype) / delta).detach()


def mask_from_stats(stats: Stats, advantages: torch.Tensor, mode, *, estimator: str = "exact",
                    thresholds: Thresholds | None = None) -> MaskResult:
    """Apply a mode to statistics (``advantages`` shaped like them; ``thresholds`` None: the
    mode's defaults). A smooth surrogate keeps every token and carries its :func:`smooth_weight`."""
    mode = get_mode(mode)
    check_choice("estimator", estimator, ESTIMATORS)
    return decide(stats, advantages, mode, estimator, resolve_thresholds(thresholds, mode))


def decide(stats: Stats, advantages: torch.Tensor, mode: MaskMode, estimator: str, thresholds: Thresholds) -> MaskResult:
    """:func:`mask_from_stats` on settings already checked (a :class:`pdmask.PolicyLoss`'s)."""
    adv = advantages.to(stats["log_ratio"].dtype)
    div = mode.divergence if mode.divergence in stats else "binary_kl"  # the reported one; no top-K: binary
    if getattr(mode.region, "divergence", None) is not None and mode.region.divergence not in stats:
        # a divergence region whose divergence was not computed (``none`` without top-K):
        # the diagnostic divergence stands in
        out = divergence_region(div)(stats, adv, thresholds)
    else:
        out = mode.region(stats, adv, thresholds)
    ratio_out = outward(stats["log_ratio"], adv)
    pred_out = outward(stats[DDOT_KEY[div, estimator]], adv)
    out_dir = outward(mode.direction(stats, estimator), adv) if mode.direction is not None else torch.zeros_like(out)
    keep = ~(out & out_dir)
    weight = None
    if mode.surrogate in SMOOTH_SURROGATES:  # the trust region is the weight: nothing is masked
        keep = torch.ones_like(keep)
        weight = _smooth_weight(stats, adv, mode, estimator, thresholds)
    return MaskResult(keep, out, out_dir, ratio_out, pred_out, stats[div].detach(), weight)


# ------------------------------------------------------------------ surrogates
#: |log r| bound of the smooth surrogates' ratio (UniRL clamps its DRPO/SPO ratio here, verl
#: its rollout corrections): the value of :data:`pdmask.corrections.RULE_LOG_BOUND`.
RATIO_LOG_BOUND = RULE_LOG_BOUND


def bounded_ratio(logp: torch.Tensor, log_ratio: torch.Tensor) -> torch.Tensor:
    """``r = pi_k / mu_k`` with value ``exp(clamp(log r, ±RATIO_LOG_BOUND))`` and gradient
    ``r grad log pi_k`` inside the bound (0 beyond): UniRL's
    ``exp(clamp(new_logp - old_logp, -20, 20))`` from the detached ``log_ratio``."""
    return (logp - logp.detach() + log_ratio.detach()).clamp(-RATIO_LOG_BOUND, RATIO_LOG_BOUND).exp()


def token_loss(logp: torch.Tensor, log_ratio: torch.Tensor, advantages: torch.Tensor, keep: torch.Tensor, *,
               surrogate: str = "dppo", is_cap: float = 5.0, eps_low: float = 0.2, eps_high: float = 0.2,
               weight: torch.Tensor | None = None, dual_clip: float | None = None, delta_low: float | None = None,
               delta_high: float | None = None, rollout_logp: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Per-token surrogate (module docstring) of the differentiable ``logp`` (log pi_k), the
    detached ``log_ratio``, the advantages and the ``keep`` mask, all one shape, and the
    effective keep mask (the dual clip masks more); masked tokens give exactly 0, gradient 0. ``weight``: ``dppo``'s IS weight
    in place of ``min(r, is_cap)`` (a correction's), ``smooth``'s ``w`` (:func:`smooth_weight`);
    ``dual_clip`` None: ``is_cap``; ``delta_*``: the scale of ``drpo`` / ``spo``;
    ``rollout_logp``: ``log mu_k`` for ``drpo`` (None: ``logp - log_ratio``)."""
    check_choice("surrogate", surrogate, SURROGATES)
    if weight is not None and surrogate not in ("dppo", "smooth"):
        raise SpecError("weight", f"the {surrogate} surrogate takes no separate IS weight (its ratio is the weight)")
    if weight is None and surrogate == "smooth":
        raise SpecError("weight", "the smooth surrogate needs its weight w (pdmask.masks.smooth_weight)")
    if surrogate in ("drpo", "spo") and (delta_low is None or delta_high is None):
        raise SpecError("delta_low / delta_high", f"the {surrogate} surrogate needs its scale delta")
    return _token_loss(logp, log_ratio, advantages, keep, surrogate, is_cap, eps_low, eps_high, weight, dual_clip,
                       delta_low, delta_high, rollout_logp)


def _token_loss(logp, log_ratio, advantages, keep, surrogate, is_cap, eps_low, eps_high, weight, dual_clip,
                delta_low, delta_high, rollout_logp):
    """:func:`token_loss` on arguments already checked (a :class:`pdmask.PolicyLoss`'s)."""
    adv = advantages.to(logp.dtype)
    # A sampled token the trainer gives probability exactly 0 (a -inf logit): its value is
    # floored so that 0 * inf cannot appear; its gradient is 0 (the logit cannot move).
    logp = floor_neginf(logp)
    log_ratio = floor_neginf(log_ratio)
    if surrogate == "dppo":
        w = is_weight(log_ratio, is_cap) if weight is None else weight.detach().to(logp.dtype)
        per = -w * adv * logp
        return torch.where(keep, per, torch.zeros_like(per)), keep
    if surrogate == "ppo-clip":
        cap = is_cap if dual_clip is None else dual_clip
        # r with value exp(log_ratio) and gradient r * grad(log pi_k)
        r = (logp - logp.detach() + log_ratio.detach()).clamp(max=MAX_LOG_RATIO).exp()
        per = torch.maximum(-adv * r, -adv * r.clamp(1 - eps_low, 1 + eps_high))
        dual = (adv < 0) & (r.detach() > cap)  # never true when the cap is inf
        if math.isfinite(cap):
            per = torch.where(dual, -adv * cap, per)
        # Clipped tokens keep their (constant) PPO value; their gradient is 0.
        return per, keep & ~dual
    r = bounded_ratio(logp, log_ratio)
    if surrogate == "smooth":
        per = -adv * weight.detach().to(logp.dtype) * r
    else:
        delta = delta_by_sign(adv, delta_low, delta_high)
        if surrogate == "drpo":
            lmu = (logp.detach() - log_ratio) if rollout_logp is None else floor_neginf(rollout_logp.detach())
            penalty = lmu.to(logp.dtype).exp() * (r - 1).square()
        else:  # spo
            penalty = (r - 1).square()
        per = -adv * r + adv.abs() * penalty / (2 * delta)
    return torch.where(keep, per, torch.zeros_like(per)), keep


def advantage_limit(surrogate: str, is_cap: float, dtype: torch.dtype, *, delta: float | None = None) -> float:
    """The largest ``sum |A|`` over the response tokens for which the loss cannot overflow
    ``dtype`` (:func:`pdmask.policy_loss` refuses larger ones rather than return inf/NaN). A
    token's loss is ``|A|`` times at most ``W``: ``dppo`` ``is_cap`` (or ``exp(MAX_LOG_RATIO)``)
    times ``|log tiny|``; ``ppo-clip`` ``exp(MAX_LOG_RATIO)``; with ``R = exp(RATIO_LOG_BOUND)``
    and ``delta`` the smallest scale, ``drpo`` ``R (1 + 1 / (2 delta))``, ``spo`` ``R + R^2 /
    (2 delta)``, ``smooth`` ``R (1 + |log tiny| / delta)`` (a floored KL is at most ``|log tiny|``)."""
    fi = torch.finfo(dtype)
    lp = -math.log(fi.tiny)
    if surrogate in SMOOTH_SURROGATES:
        if delta is None:
            raise SpecError("delta", f"the {surrogate} surrogate's bound needs its smallest scale delta")
        big = math.exp(RATIO_LOG_BOUND)
        w = {"drpo": big * (1 + 1 / (2 * delta)), "spo": big + big * big / (2 * delta),
             "smooth": big * (1 + lp / delta)}[surrogate]
        return fi.max / w
    cap = is_cap if math.isfinite(is_cap) else math.exp(MAX_LOG_RATIO)
    w, lp = (math.exp(MAX_LOG_RATIO), 1.0) if surrogate == "ppo-clip" else (cap, lp)
    return fi.max / (w * lp)


def check_advantage_scale(checks: Checks, adv, valid, dtype: torch.dtype, surrogate: str, is_cap: float,
                          delta: float | None = None, behaviour_cap: float | None = None) -> None:
    """``sum |A|`` within :func:`advantage_limit` of the loss's dtype (``dtype`` promoted to float32),
    divided by ``behaviour_cap`` (an anchored loss's bound on its behaviour weight) when given."""
    dtype = torch.promote_types(dtype, torch.float32)
    limit = advantage_limit(surrogate, is_cap, dtype, delta=delta)
    if behaviour_cap is not None:
        limit = limit / (behaviour_cap if math.isfinite(behaviour_cap) else math.exp(MAX_LOG_RATIO))
    total = torch.where(valid, adv.detach().double().abs(), torch.zeros((), dtype=torch.float64,
                                                                               device=adv.device)).sum()
    what = f"is_cap={is_cap:g}" if surrogate in ("dppo", "ppo-clip") else f"delta={delta:g}"
    checks.add("advantages", f"sum of |A| over the response tokens exceeds {limit:.3g}, beyond which the "
               f"{str(dtype).removeprefix('torch.')} loss ({surrogate} surrogate, {what}) could "
               "overflow to inf/NaN; scale the advantages down (normalise them)", total > limit)
