"""Trust-region masks: a registry of modes, each a proximity test times a direction test.

A token is masked (``M = 0``) iff it is **out of the region** and its update is
**outward**; otherwise ``M = 1``. A mode is data::

    MaskMode(name, region=divergence_region("topk_kl"), direction=predictive("topk_kl"), ...)

- ``region(stats, adv, th)`` -> bool (N,): out of the trust region. Divergence modes use
  ``D > delta_high`` for ``A > 0`` and ``D > delta_low`` for ``A < 0``; ``grpo`` uses
  ``r`` outside ``[1 - eps_low, 1 + eps_high]``. Tokens with ``A = 0`` are never out
  (their update is zero).
- ``direction(stats, estimator)`` -> signed (N,): the update is outward iff
  ``A * direction > 0``. ``ratio_sign()`` is ``log r`` (PPO, DPPO); ``predictive(div)``
  is ``Ddot`` of that divergence (this project); ``None`` never masks.

The smooth surrogates (:data:`SMOOTH_SURROGATES`: DRPO, SPO and the smooth predictive
weight) mask nothing: their trust region is a weight on the gradient,
``w = 1 - sign(A * direction) * D / delta`` (:func:`smooth_weight`), negative exactly on
the tokens the hard mask of the same region and direction would zero. Their region and
direction are still reported (``out_of_region_frac``, ``disagreement_frac``).

Adding a mode is one :func:`register_mode` call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from ._validate import check_choice, check_positive
from .keys import BATCH_DDOT, DIVERGENCES, ESTIMATORS, ddot_key

Stats = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class Thresholds:
    """Trust-region thresholds: ``delta_*`` for divergence regions (A < 0 / A > 0) and the
    scale of the smooth surrogates' weight, ``eps_*`` for the ratio region of ``grpo``
    (``r`` outside ``[1 - eps_low, 1 + eps_high]``; clip-higher: ``eps_high = 0.28``),
    ``dual_clip`` grpo's dual-clip constant C (verl's ``clip_ratio_c``: the loss of an
    A < 0 token is at most ``-A C``).

    ``delta_low`` / ``delta_high`` None mean the mode's ``default_delta`` (0.05 for KL,
    0.15 for TV), filled in by :meth:`resolve`. ``dual_clip`` None means
    ``Corrections.is_cap`` (5 by default: the dual clip and the IS cap were one setting
    before ``dual_clip`` existed, and stay one unless it is given). Checked here, once:
    deltas positive (inf allowed: never out of region), ``eps_*`` positive finite,
    ``eps_low < 1``, ``dual_clip > 1`` (inf: no dual clip); :meth:`resolve` refuses a
    ``dual_clip`` for a mode without the ``ppo-clip`` surrogate.
    """

    delta_low: float | None = None
    delta_high: float | None = None
    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip: float | None = None

    def __post_init__(self) -> None:
        for name in ("delta_low", "delta_high", "eps_low", "eps_high", "dual_clip"):
            v = getattr(self, name)
            if v is None and name.startswith("eps"):
                raise ValueError(f"{name}: must be a positive number, got None")
            check_positive(name, v, allow_inf=not name.startswith("eps"))
        if self.eps_low >= 1:
            # the clip range [1 - eps_low, 1 + eps_high] would reach r <= 0: no lower clip at all
            raise ValueError(f"eps_low: must be < 1 (the ratio clip's lower end is 1 - eps_low > 0), "
                             f"got {self.eps_low!r}")
        if self.dual_clip is not None and not self.dual_clip > 1:
            # verl asserts clip_ratio_c > 1: a cap at or below 1 would clip on-policy tokens
            raise ValueError(f"dual_clip: must be > 1 (the cap on r of the A < 0 tokens), got {self.dual_clip!r}")

    def resolve(self, mode: "MaskMode") -> "Thresholds":
        """These thresholds with a None delta replaced by the mode's default (a ``dual_clip``
        for a mode without the ``ppo-clip`` surrogate is refused: it would do nothing)."""
        if self.dual_clip is not None and mode.surrogate != "ppo-clip":
            raise ValueError(f"dual_clip: applies to the ppo-clip surrogate (grpo) only; mode {mode.name!r} uses "
                             f"the {mode.surrogate} surrogate, which has no dual clip; remove dual_clip")
        if self.delta_low is not None and self.delta_high is not None:
            return self
        dl = mode.default_delta if self.delta_low is None else self.delta_low
        dh = mode.default_delta if self.delta_high is None else self.delta_high
        return Thresholds(dl, dh, self.eps_low, self.eps_high, self.dual_clip)


Region = Callable[[Stats, torch.Tensor, Thresholds], torch.Tensor]
#: Surrogates a mode may name (see :func:`pdmask.surrogates.token_loss`).
SURROGATES = ("dppo", "ppo-clip", "drpo", "spo", "smooth")
#: Surrogates whose trust region is a smooth weight on the gradient, not a 0/1 mask: DRPO,
#: SPO and the smooth predictive weight (:func:`smooth_weight`). Like ``ppo-clip`` their ratio
#: pi/mu keeps its gradient and is the token IS weight.
SMOOTH_SURROGATES = ("drpo", "spo", "smooth")
NEEDS = ("topk", "full", "batch")
Direction = Callable[[Stats, str], torch.Tensor]

def _by_sign(adv: torch.Tensor, value: torch.Tensor, low, high) -> torch.Tensor:
    return ((adv > 0) & (value > high)) | ((adv < 0) & (value > low))


def divergence_region(key: str) -> Region:
    """Out of region iff ``stats[key] > delta`` (delta by the sign of A)."""

    def region(stats: Stats, adv: torch.Tensor, th: Thresholds) -> torch.Tensor:
        return _by_sign(adv, stats[key], th.delta_low, th.delta_high)

    region.divergence = key
    return region


def ratio_region() -> Region:
    """Out of region iff ``r > 1 + eps_high`` or ``r < 1 - eps_low`` (and A != 0)."""

    def region(stats: Stats, adv: torch.Tensor, th: Thresholds) -> torch.Tensor:
        r = stats["ratio"]
        return (adv != 0) & ((r > 1 + th.eps_high) | (r < 1 - th.eps_low))

    return region


def ratio_deviation_region() -> Region:
    """Out of region iff ``|r - 1| > delta`` (delta by the sign of A): where SPO's weight
    ``1 - sign(A (r - 1)) |r - 1| / delta`` turns negative on the outward side."""

    def region(stats: Stats, adv: torch.Tensor, th: Thresholds) -> torch.Tensor:
        return _by_sign(adv, (stats["ratio"] - 1).abs(), th.delta_low, th.delta_high)

    return region


def any_token_region() -> Region:
    """Every token with ``A != 0`` is "out" (the ``scope="all"`` batch modes: direction only)."""
    return lambda stats, adv, th: adv != 0


def ratio_sign() -> Direction:
    """The ratio direction test: outward iff ``A (r - 1) > 0``, the sign of ``log r`` (PPO, DPPO).

    A factory of a :data:`Direction` for :class:`MaskMode` (the tensor ``log r`` itself is
    :func:`pdmask.directions.log_ratio`)."""
    return lambda stats, estimator: stats["log_ratio"]


def predictive(divergence: str) -> Direction:
    """The predictive direction test: outward iff ``A * Ddot > 0`` for the named divergence
    (top-K ones use the estimator). A factory of a :data:`Direction` for :class:`MaskMode`."""
    check_choice("divergence", divergence, DIVERGENCES)
    return lambda stats, estimator: stats[ddot_key(divergence, estimator)]


def batch_direction() -> Direction:
    """Outward iff ``A * batch_ddot > 0``: the externally computed batch direction
    ``<grad log pi_t, P grad Phi>`` (:mod:`pdmask.batchmask`), passed as ``batch_ddot=``."""
    return lambda stats, estimator: stats[BATCH_DDOT]


@dataclass(frozen=True)
class MaskMode:
    """A named trust-region mask.

    Attributes:
        name: registry key.
        region: proximity test (see module docstring).
        direction: direction test, or None for no masking at all.
        divergence: the divergence the mode is about; it is reported in the metrics and
            its predictive direction is compared with the ratio direction for the
            disagreement diagnostic (``topk_kl`` for ``grpo`` / ``none``, falling back
            to ``binary_kl`` without top-K input).
        surrogate: ``"dppo"`` (``-M sg(min(r, C)) A log pi_k``), ``"ppo-clip"``, or one of
            :data:`SMOOTH_SURROGATES` (no mask; :mod:`pdmask.surrogates`).
        needs: inputs the mode requires: ``"topk"``, ``"full"``, ``"batch"`` (``batch_ddot``).
        default_delta: delta used when the caller passes none (the smooth surrogates' scale).
        doc: one line for listings.
    """

    name: str
    region: Region
    direction: Direction | None
    divergence: str
    surrogate: str = "dppo"
    needs: frozenset = field(default_factory=frozenset)
    default_delta: float = 0.05
    doc: str = ""


MODES: dict[str, MaskMode] = {}


def register_mode(mode: MaskMode, *, overwrite: bool = False) -> MaskMode:
    """Add a mode to the registry (``overwrite=True`` to replace one)."""
    check_mode(mode)
    if mode.name in MODES and not overwrite:
        raise ValueError(f"mode: {mode.name!r} is already registered (pass overwrite=True to replace it)")
    MODES[mode.name] = mode
    return mode


def check_mode(mode: MaskMode) -> None:
    """A mode's fields are usable (callable region and direction, known surrogate and needs)."""
    if not callable(mode.region):
        raise ValueError(f"region: mode {mode.name!r} needs a callable region(stats, adv, thresholds), "
                         f"got {mode.region!r}")
    if mode.direction is not None and not callable(mode.direction):
        raise ValueError(f"direction: mode {mode.name!r} needs a callable direction(stats, estimator) or None, "
                         f"got {mode.direction!r}")
    check_choice("divergence", mode.divergence, DIVERGENCES)
    check_choice("surrogate", mode.surrogate, SURROGATES)
    if mode.surrogate == "smooth" and (getattr(mode.region, "divergence", None) is None or mode.direction is None):
        raise ValueError(f"surrogate: 'smooth' (mode {mode.name!r}) weighs by the region's divergence and the "
                         "direction test: it needs a divergence_region(...) and a direction")
    for need in mode.needs:
        check_choice("needs", need, NEEDS)


def get_mode(name: str) -> MaskMode:
    """The registered mode of that name; a :class:`MaskMode` is checked and returned as is."""
    if isinstance(name, MaskMode):
        check_mode(name)
        return name
    if name not in MODES:
        raise ValueError(f"mode: unknown mode {name!r}; valid modes are: {', '.join(MODES)}")
    return MODES[name]


_TOPK, _FULL, _BATCH = frozenset({"topk"}), frozenset({"full"}), frozenset({"topk", "batch"})
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
    # batch-aware predictive mask: the direction is computed from the model (pdmask.batchmask)
    MaskMode("pdm-batch-topk-kl", divergence_region("topk_kl"), batch_direction(), "topk_kl", needs=_BATCH,
             doc="batch-aware mask: top-K KL > delta and A*batch_ddot > 0 (needs batch_ddot)"),
    MaskMode("pdm-batch-topk-tv", divergence_region("topk_tv"), batch_direction(), "topk_tv", needs=_BATCH,
             default_delta=0.15, doc="batch-aware mask: top-K TV > delta and A*batch_ddot > 0 (needs batch_ddot)"),
    MaskMode("pdm-batch-all-topk-kl", any_token_region(), batch_direction(), "topk_kl", needs=_BATCH,
             doc="batch-aware mask, scope all: any token with A*batch_ddot > 0 (Phi over top-K KL > delta)"),
    MaskMode("pdm-batch-all-topk-tv", any_token_region(), batch_direction(), "topk_tv", needs=_BATCH,
             default_delta=0.15,
             doc="batch-aware mask, scope all: any token with A*batch_ddot > 0 (Phi over top-K TV > delta)"),
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


def check_inputs_for(mode: MaskMode, has_topk: bool, has_full: bool, has_batch: bool = False) -> None:
    if "batch" in mode.needs and not has_batch:
        raise ValueError(f"batch_ddot: mode {mode.name!r} needs the batch direction (B, T) from "
                         "pdmask.batchmask.batch_mask(...).ddot")
    if "topk" in mode.needs and not has_topk:
        raise ValueError(f"rollout.topk_ids: mode {mode.name!r} needs the rollout top-K ids and log-probs")
    if "full" in mode.needs and not has_full:
        raise ValueError(f"rollout.logits: mode {mode.name!r} needs the rollout policy's full logits")


def diagnostic_divergence(mode: MaskMode, stats: Stats) -> str:
    """The divergence a mode reports; ``topk_kl`` falls back to ``binary_kl`` without top-K."""
    return mode.divergence if mode.divergence in stats else "binary_kl"


@dataclass
class MaskResult:
    """Flat (N,) tensors of one mask decision (all detached)."""

    keep: torch.Tensor  # bool: M = 1
    out_of_region: torch.Tensor  # bool
    outward: torch.Tensor  # bool: the mode's direction says outward (False if no direction)
    ratio_outward: torch.Tensor  # bool
    predictive_outward: torch.Tensor  # bool, for the mode's (diagnostic) divergence
    divergence: torch.Tensor  # the diagnostic divergence values
    weight: torch.Tensor | None = None  # the smooth surrogates' gradient weight (smooth_weight), else None


def smooth_weight(stats: Stats, advantages: torch.Tensor, mode, *, estimator: str = "exact",
                  thresholds: Thresholds | None = None) -> torch.Tensor:
    """The gradient weight ``w`` of a smooth surrogate (detached, shaped like ``advantages``)::

        w = 1 - sign(A * direction) * D / delta        delta = delta_high (A > 0), delta_low (A < 0)

    ``drpo``: ``D = |pi_k - mu_k|`` (``binary_tv``), direction ``r - 1``; ``spo``:
    ``D = |r - 1|``; ``smooth``: ``D`` the mode's region divergence, direction its test
    (``Ddot`` for ``pdm-smooth-*``). ``w < 0`` (corrective) exactly where the hard mask of
    that region and direction masks; ``A = 0`` gives ``w = 1``. The surrogates'
    gradient is ``-A w r grad log pi_k`` (:func:`pdmask.surrogates.token_loss`).

    Naive torch (``pdm-smooth-topk-kl``)::

        w = 1 - torch.sign(A * st["ddot_topk_kl_exact"]) * st["topk_kl"] / torch.where(A > 0, dh, dl)
    """
    mode = get_mode(mode)
    if mode.surrogate not in SMOOTH_SURROGATES:
        raise ValueError(f"mode: {mode.name!r} uses the {mode.surrogate} surrogate, which has no smooth weight; "
                         f"the smooth ones are: {', '.join(SMOOTH_SURROGATES)}")
    th = (Thresholds() if thresholds is None else thresholds).resolve(mode)
    adv = advantages.to(stats["log_ratio"].dtype)
    if mode.surrogate == "spo":
        dist, direction = (stats["ratio"] - 1).abs(), stats["log_ratio"]
    elif mode.surrogate == "drpo":
        dist, direction = stats["binary_tv"], stats["log_ratio"]
    else:
        dist, direction = stats[mode.region.divergence], mode.direction(stats, estimator)
    delta = torch.where(adv > 0, torch.full_like(adv, th.delta_high), torch.full_like(adv, th.delta_low))
    return (1 - torch.sign(adv * direction) * dist.to(adv.dtype) / delta).detach()


def mask_from_stats(stats: Stats, advantages: torch.Tensor, mode, *, estimator: str = "exact",
                    thresholds: Thresholds | None = None) -> MaskResult:
    """Apply a mode to precomputed statistics (flat or shaped alike; ``advantages`` same shape).

    ``thresholds`` None: ``Thresholds()`` (the mode's default deltas). A smooth surrogate's
    mode keeps every token (``keep`` all True) and carries its :func:`smooth_weight`."""
    mode = get_mode(mode)
    check_choice("estimator", estimator, ESTIMATORS)
    thresholds = (Thresholds() if thresholds is None else thresholds).resolve(mode)
    adv = advantages.to(stats["log_ratio"].dtype)
    div = diagnostic_divergence(mode, stats)
    if getattr(mode.region, "divergence", None) is not None and mode.region.divergence not in stats:
        # a divergence region whose divergence was not computed (``none`` without top-K):
        # the diagnostic divergence stands in
        out = divergence_region(div)(stats, adv, thresholds)
    else:
        out = mode.region(stats, adv, thresholds)
    ratio_out = adv * stats["log_ratio"] > 0
    pred_out = adv * stats[ddot_key(div, estimator)] > 0
    outward = (adv * mode.direction(stats, estimator) > 0) if mode.direction is not None else torch.zeros_like(out)
    keep = ~(out & outward)
    weight = None
    if mode.surrogate in SMOOTH_SURROGATES:  # the trust region is the weight: nothing is masked
        keep = torch.ones_like(keep)
        weight = smooth_weight(stats, adv, mode, estimator=estimator, thresholds=thresholds)
    return MaskResult(keep, out, outward, ratio_out, pred_out, stats[div].detach(), weight)
