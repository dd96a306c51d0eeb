"""Modes: a proximity test times a direction test, and a per-token surrogate (docs/core.md).

A token is masked iff it is **out of the region** (:func:`beyond_delta`: ``D > delta_high``
for ``A > 0``, ``D > delta_low`` for ``A < 0``; ``grpo``: ``r`` outside ``[1 - eps_low,
1 + eps_high]``) and its update is **outward** (:func:`outward`: ``A * direction > 0``, the
direction ``log r`` for :func:`ratio_sign`, ``Ddot`` for :func:`predictive`). A mode is data,
registered by name; its ``extras`` are per-token tensors the caller supplies
(``policy_loss(..., extras=...)``; :mod:`pdmask_lab.batchmask` registers its modes so); its
surrogate is a name in :data:`pdmask.surrogates.SURROGATES` (the per-token loss forms, registered
objects too); its ``corrections`` preset sets its IS weight from the thresholds (``cispo``).
A smooth surrogate (``drpo``, ``spo``, ``smooth``) masks nothing: the region is the weight
``1 - sign(A * direction) * D / delta`` on the gradient (:func:`smooth_weight`, METHOD.md section 2b).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from ._validate import SpecError, check_choice, check_positive
from .corrections import FIELDS as CORRECTION_FIELDS
from .corrections import Corrections
from .divergences import default_delta
from .keys import DDOT_KEY, DIVERGENCES, ESTIMATORS, SUPPORTS
from .surrogates import (  # noqa: F401  (re-exported: the surrogates' names as masks held them before)
    RATIO_LOG_BOUND, SMOOTH_SURROGATES, SURROGATES, Surrogate, advantage_limit, bounded_ratio, delta_by_sign,
    register_surrogate, token_loss,
)

Stats = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class Thresholds:
    """Trust-region thresholds: ``delta_low`` / ``delta_high`` of the divergence regions
    (A < 0 / A > 0) and the smooth surrogates' scale (None: the mode's ``default_delta``,
    its divergence's: :func:`pdmask.divergences.default_delta`; inf: never out); ``eps_low`` / ``eps_high``, grpo's ratio clip
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
        if self.dual_clip is not None and "dual_clip" not in SURROGATES[mode.surrogate].accepts:
            takers = [s for s, d in SURROGATES.items() if "dual_clip" in d.accepts]
            raise SpecError("dual_clip", f"applies to the {', '.join(takers)} surrogate (grpo) only; mode {mode.name!r} "
                                         f"uses the {mode.surrogate} surrogate, which has no dual clip; remove dual_clip")
        if self.delta_low is not None and self.delta_high is not None:
            return self
        dl = mode.default_delta if self.delta_low is None else self.delta_low
        dh = mode.default_delta if self.delta_high is None else self.delta_high
        return Thresholds(dl, dh, self.eps_low, self.eps_high, self.dual_clip)


def resolve_thresholds(thresholds: Thresholds | None, mode: MaskMode) -> Thresholds:
    """``thresholds`` with the mode's default deltas where they give none (None: all of them)."""
    return (Thresholds() if thresholds is None else thresholds).resolve(mode)


Region = Callable[[Stats, torch.Tensor, Thresholds], torch.Tensor]
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


def divergence_region(key: str) -> Region:
    """Out of region iff ``stats[key] > delta`` (delta by the sign of A)."""

    def region(stats: Stats, adv: torch.Tensor, th: Thresholds) -> torch.Tensor:
        return beyond_delta(stats[key], adv, th.delta_low, th.delta_high)

    region.divergence = key
    region.reads = "delta"
    return region


def ratio_region() -> Region:
    """Out of region iff ``r > 1 + eps_high`` or ``r < 1 - eps_low`` (and A != 0)."""
    def region(st, adv, th):
        return (adv != 0) & ((st["ratio"] > 1 + th.eps_high) | (st["ratio"] < 1 - th.eps_low))

    region.reads = "eps"
    return region


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
    stands in without top-K); ``surrogate`` a name in :data:`SURROGATES`; ``needs`` parts of the
    statistics (:data:`NEEDS`); ``default_delta`` when the caller gives none (None: its region's
    divergence's, :func:`pdmask.divergences.default_delta`); ``extras`` names of the per-token
    tensors the caller passes as ``extras={name: (B, T) tensor}`` (the extension point);
    ``supports`` the supports of the top-K divergences it works on; ``corrections`` a preset:
    ``thresholds -> {Corrections field: value}``, what the mode sets of its corrections
    (``cispo``: the IS weight clip(r, 1 - eps_low, 1 + eps_high)); ``reads_eps`` that preset reads
    eps."""

    name: str
    region: Region
    direction: Direction | None
    divergence: str
    surrogate: str = "dppo"
    needs: frozenset = field(default_factory=frozenset)
    default_delta: float | None = None
    doc: str = ""
    extras: tuple = ()
    supports: tuple = SUPPORTS
    corrections: Callable[[Thresholds], dict] | None = None
    reads_eps: bool = False

    def __post_init__(self) -> None:
        if self.default_delta is None:  # its region's divergence's (an unknown one: check_mode says so)
            div = getattr(self.region, "divergence", None) or self.divergence
            if div in DIVERGENCES:
                object.__setattr__(self, "default_delta", default_delta(div))

    @property
    def reads(self) -> frozenset:
        """The thresholds it reads: ``delta`` (a divergence or deviation region, a scale),
        ``eps`` (the ratio clip, a preset), ``dual_clip``."""
        out = {getattr(self.region, "reads", "delta")}
        out |= SURROGATES[self.surrogate].accepts & {"delta", "eps", "dual_clip"}
        return frozenset(out | ({"eps"} if self.reads_eps else set()))


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
    needs = SURROGATES[mode.surrogate].mode_needs
    if ("divergence_region" in needs and getattr(mode.region, "divergence", None) is None) or \
            ("direction" in needs and mode.direction is None):
        raise SpecError("surrogate", f"{mode.surrogate!r} (mode {mode.name!r}) weighs by the region's divergence "
                                     "and the direction test: it needs a divergence_region(...) and a direction")
    check_positive("default_delta", mode.default_delta)
    if mode.corrections is not None and not callable(mode.corrections):
        raise SpecError("corrections", f"mode {mode.name!r}: a preset is a callable thresholds -> "
                                       f"{{field: value}}, got {mode.corrections!r}")
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


def cispo_corrections(th: Thresholds) -> dict:
    """``cispo``'s IS weight, CISPO's (MiniMax-M1, eq. 5; verl 0.9.1's ``compute_policy_loss_cispo``):
    ``sg(clip(r, 1 - eps_low, 1 + eps_high))`` on ``-A log pi_k``, every token kept."""
    return {"is_level": "token", "is_cap": 1 + th.eps_high, "is_floor": 1 - th.eps_low, "is_mask": False}


for _m in [
    MaskMode("grpo", ratio_region(), ratio_sign(), "topk_kl", surrogate="ppo-clip",
             doc="PPO/GRPO ratio clip [1-eps_low, 1+eps_high] (clip-higher: raise eps_high)"),
    MaskMode("none", divergence_region("topk_kl"), None, "topk_kl",
             doc="IS-weighted policy gradient, no trust region (regions reported only)"),
    MaskMode("cispo", divergence_region("topk_kl"), None, "topk_kl", corrections=cispo_corrections, reads_eps=True,
             doc="CISPO: none with the IS weight clip(r, 1-eps_low, 1+eps_high) (verl's cispo; TRL's: none, is_cap)"),
    MaskMode("dppo-binary-tv", divergence_region("binary_tv"), ratio_sign(), "binary_tv",
             doc="DPPO: |pi_k - mu_k| > delta, ratio direction"),
    MaskMode("dppo-binary-kl", divergence_region("binary_kl"), ratio_sign(), "binary_kl",
             doc="DPPO: Bernoulli KL of the sampled token > delta, ratio direction"),
    *(MaskMode(f"dppo-{d.replace('_', '-')}", divergence_region(d), ratio_sign(), d, needs=_TOPK,
               doc=f"DPPO: top-K {d[5:].upper()} > delta, ratio direction") for d in ("topk_kl", "topk_tv", "topk_js")),
    *(MaskMode(f"pdm-{d.replace('_', '-')}", divergence_region(d), predictive(d), d, needs=_TOPK,
               doc=f"predictive mask: top-K {d[5:].upper()} > delta and A*Ddot > 0") for d in ("topk_kl", "topk_tv", "topk_js")),
    MaskMode("pdm-full-kl", divergence_region("full_kl"), predictive("full_kl"), "full_kl", needs=_FULL,
             doc="predictive mask on the full-vocabulary KL (needs rollout_logits)"),
    MaskMode("pdm-full-tv", divergence_region("full_tv"), predictive("full_tv"), "full_tv", needs=_FULL,
             doc="predictive mask on the full-vocabulary TV (needs rollout_logits)"),
    # smooth trust regions: no mask, a weight 1 - sign(A * direction) * D / delta on the gradient
    MaskMode("drpo", divergence_region("binary_tv"), ratio_sign(), "binary_tv", surrogate="drpo",
             doc="DRPO: -A r + |A| mu_k (r-1)^2 / (2 delta); weight 1 - sign(A(r-1)) |pi_k - mu_k| / delta, no mask"),
    MaskMode("spo", ratio_deviation_region(), ratio_sign(), "topk_kl", surrogate="spo", default_delta=0.2,
             doc="SPO: -A r + |A| (r-1)^2 / (2 delta); weight 1 - sign(A(r-1)) |r - 1| / delta, no mask"),
    *(MaskMode(f"pdm-smooth-{d.replace('_', '-')}", divergence_region(d), predictive(d), d, surrogate="smooth",
               needs=_TOPK, doc=f"smooth predictive weight (experimental): 1 - sign(A*Ddot) {d} / delta, no mask")
      for d in ("topk_kl", "topk_tv")),
]:
    register_mode(_m)


def with_preset(corrections: Corrections, mode: MaskMode, thresholds: Thresholds) -> Corrections:
    """``corrections`` with the fields the mode's preset sets (:attr:`pdmask.MaskMode.corrections`,
    from the resolved thresholds); a field given another value is refused (the preset would
    override it), one given the same value is kept (a resolved record reloads)."""
    if mode.corrections is None:
        return corrections
    preset = mode.corrections(thresholds)
    default = Corrections()
    for name, v in preset.items():
        check_choice("corrections", name, CORRECTION_FIELDS)
        given = getattr(corrections, name)
        if (corrections.is_cap_given if name == "is_cap" else given != getattr(default, name)) and given != v:
            raise SpecError(name, f"mode {mode.name!r} sets it to {v!r} from its thresholds ({mode.doc}); "
                                  f"leave it unset, or choose another mode")
    return dataclasses.replace(corrections, **preset)


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
    if SURROGATES[mode.surrogate].smooth is None:
        raise SpecError("mode", f"{mode.name!r} uses the {mode.surrogate} surrogate, which has no smooth weight; "
                                f"the smooth ones are: {', '.join(SMOOTH_SURROGATES)}")
    check_choice("estimator", estimator, ESTIMATORS)
    return _smooth_weight(stats, advantages, mode, estimator, resolve_thresholds(thresholds, mode))


def _smooth_weight(stats: Stats, advantages, mode: MaskMode, estimator: str, th: Thresholds) -> torch.Tensor:
    adv = advantages.to(stats["log_ratio"].dtype)
    dist, direction = SURROGATES[mode.surrogate].smooth(stats, mode, estimator)
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
    if SURROGATES[mode.surrogate].smooth is not None:  # the trust region is the weight: nothing is masked
        keep = torch.ones_like(keep)
        weight = _smooth_weight(stats, adv, mode, estimator, thresholds)
    return MaskResult(keep, out, out_dir, ratio_out, pred_out, stats[div].detach(), weight)
