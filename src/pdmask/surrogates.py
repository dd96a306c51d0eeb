"""Per-token surrogates: the loss of one token from its statistics, and the advantages' bound.

A mode names its surrogate (:attr:`pdmask.masks.MaskMode.surrogate`). With ``r = pi_k / mu_k``,
``sg`` the stop-gradient, ``M`` the keep mask and ``delta`` by the sign of A
(``delta_high`` for A > 0, ``delta_low`` for A < 0)::

    dppo      -M sg(min(r, C)) A log pi_k                          C = is_cap   (DPPO, METHOD.md section 2)
    ppo-clip  max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)),      and -A C' where A < 0 and r > C'
              (the dual clip, C' = dual_clip, None: is_cap)       (PPO / GRPO)
    drpo      -A r + |A| mu_k (r - 1)^2 / (2 delta)                 (DRPO, UniRL's unirl/algorithms/drpo.py)
    spo       -A r + |A| (r - 1)^2 / (2 delta)                      (SPO, arXiv 2401.16025)
    smooth    -A sg(w) r,   w = 1 - sign(A Ddot) D / delta           (the smooth predictive weight)

In the last three ``r`` keeps its gradient ``r grad log pi_k``, so each token's gradient is
``-A w r grad log pi_k`` with the weight (METHOD.md section 2b)::

    drpo    w = 1 - sign(A (r - 1)) |pi_k - mu_k| / delta     (mu_k (r - 1) = pi_k - mu_k)
    spo     w = 1 - sign(A (r - 1)) |r - 1| / delta
    smooth  w = 1 - sign(A Ddot) D / delta                    (:func:`pdmask.masks.smooth_weight`)

``w`` is 1 on-policy, shrinks on outward updates, and turns negative (corrective) beyond
``delta``; inward updates get ``w > 1``. Their log-ratio is clamped to
``±RATIO_LOG_BOUND = 20`` (UniRL's clamp, verl's SAFETY_BOUND): a token beyond gets no
gradient. The smooth surrogate's *value* is ``-A w r`` (its gradient is the point); over
binary TV with the ratio direction its gradient is DRPO's, its value is not.
"""

from __future__ import annotations

import math

import torch

from ._validate import Checks
from .corrections import RULE_LOG_BOUND, is_weight
from .divergences import floor_neginf
from .masks import SMOOTH_SURROGATES, SURROGATES
from .stats import MAX_LOG_RATIO

#: |log r| bound of the smooth surrogates' ratio (UniRL clamps its DRPO/SPO ratio here, verl
#: its rollout corrections): the value of :data:`pdmask.corrections.RULE_LOG_BOUND`.
RATIO_LOG_BOUND = RULE_LOG_BOUND


def _by_sign(adv: torch.Tensor, low: float, high: float) -> torch.Tensor:
    return torch.where(adv > 0, torch.full_like(adv, high), torch.full_like(adv, low))


def bounded_ratio(logp: torch.Tensor, log_ratio: torch.Tensor) -> torch.Tensor:
    """``r = pi_k / mu_k`` with value ``exp(clamp(log r, ±RATIO_LOG_BOUND))`` and gradient
    ``r grad log pi_k`` inside the bound (0 beyond): UniRL's
    ``exp(clamp(new_logp - old_logp, -20, 20))`` from the detached ``log_ratio``."""
    return (logp - logp.detach() + log_ratio.detach()).clamp(-RATIO_LOG_BOUND, RATIO_LOG_BOUND).exp()


def token_loss(
    logp: torch.Tensor,  # (N,) differentiable log pi_k
    log_ratio: torch.Tensor,  # (N,) detached log pi_k - log mu_k
    advantages: torch.Tensor,  # (N,)
    keep: torch.Tensor,  # (N,) bool
    *,
    surrogate: str = "dppo",
    is_cap: float = 5.0,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    weight: torch.Tensor | None = None,
    dual_clip: float | None = None,
    delta_low: float | None = None,
    delta_high: float | None = None,
    rollout_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token surrogate (module docstring) and the effective keep mask (the dual clip masks more).

    ``weight`` (N,): with ``dppo``, replaces the IS weight ``min(r, is_cap)`` (an off-policy
    correction's weight, :mod:`pdmask.corrections`); with ``smooth``, the smooth weight
    ``w`` (required, :func:`pdmask.masks.smooth_weight`); refused by the others, whose ratio
    is the weight. ``dual_clip``: ``ppo-clip``'s dual-clip constant (None: ``is_cap``, the
    one setting they were before). ``delta_low`` / ``delta_high``: the scale of ``drpo`` /
    ``spo`` (required there). ``rollout_logp`` (N,): ``log mu_k`` for ``drpo`` (None: from
    ``logp - log_ratio``). Returns ``(loss_t, keep_eff)``; masked tokens contribute exactly 0
    with gradient 0.
    """
    adv = advantages.to(logp.dtype)
    # A sampled token the trainer gives probability exactly 0 (a -inf logit): its value is
    # floored so that 0 * inf cannot appear; its gradient is 0 (the logit cannot move).
    logp = floor_neginf(logp)
    log_ratio = floor_neginf(log_ratio)
    if surrogate not in SURROGATES:
        raise ValueError(f"surrogate: unknown value {surrogate!r}; valid values are: {', '.join(SURROGATES)}")
    if weight is not None and surrogate not in ("dppo", "smooth"):
        raise ValueError(f"weight: the {surrogate} surrogate takes no separate IS weight (its ratio is the weight)")
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
        if weight is None:
            raise ValueError("weight: the smooth surrogate needs its weight w (pdmask.masks.smooth_weight)")
        per = -adv * weight.detach().to(logp.dtype) * r
    else:
        if delta_low is None or delta_high is None:
            raise ValueError(f"delta_low / delta_high: the {surrogate} surrogate needs its scale delta")
        delta = _by_sign(adv, delta_low, delta_high)
        if surrogate == "drpo":
            lmu = (logp.detach() - log_ratio) if rollout_logp is None else floor_neginf(rollout_logp.detach())
            penalty = lmu.to(logp.dtype).exp() * (r - 1).square()
        else:  # spo
            penalty = (r - 1).square()
        per = -adv * r + adv.abs() * penalty / (2 * delta)
    return torch.where(keep, per, torch.zeros_like(per)), keep


def advantage_limit(surrogate: str, is_cap: float, dtype: torch.dtype, *, delta: float | None = None) -> float:
    """The largest ``sum |A|`` over the response tokens for which the loss cannot overflow
    ``dtype`` (the loss's dtype: float32 for half-precision logits).

    A token's loss is ``|A|`` times at most ``W``: in the DPPO surrogate the IS weight's cap
    ``is_cap`` (or ``exp(MAX_LOG_RATIO)`` without a cap) times ``|log pi_k| <= |log tiny|``
    (the floor of a probability the dtype represents); ``exp(MAX_LOG_RATIO)`` for the PPO
    ratio of ``ppo-clip``; with ``R = exp(RATIO_LOG_BOUND)`` and ``delta`` the smallest
    scale, ``R (1 + 1 / (2 delta))`` for ``drpo`` (``mu_k (r - 1)^2 <= r``), ``R + R^2 /
    (2 delta)`` for ``spo``, ``R (1 + |log tiny| / delta)`` for ``smooth`` (``D`` is at most
    ``|log tiny|``: a KL of floored logs; a TV is at most 1). The aggregate is at most their
    sum. :func:`pdmask.policy_loss` refuses larger advantages rather than return an inf/NaN
    loss."""
    fi = torch.finfo(dtype)
    lp = -math.log(fi.tiny)
    if surrogate in SMOOTH_SURROGATES:
        if delta is None:
            raise ValueError(f"delta: the {surrogate} surrogate's bound needs its smallest scale delta")
        big = math.exp(RATIO_LOG_BOUND)
        w = {"drpo": big * (1 + 1 / (2 * delta)), "spo": big + big * big / (2 * delta),
             "smooth": big * (1 + lp / delta)}[surrogate]
        return fi.max / w
    cap = is_cap if math.isfinite(is_cap) else math.exp(MAX_LOG_RATIO)
    w, lp = (math.exp(MAX_LOG_RATIO), 1.0) if surrogate == "ppo-clip" else (cap, lp)
    return fi.max / (w * lp)


def check_advantage_scale(checks: Checks, adv, valid, dtype: torch.dtype, surrogate: str, is_cap: float,
                          delta: float | None = None) -> None:
    """``sum |A|`` within :func:`advantage_limit` of the loss's dtype (``dtype`` promoted to float32)."""
    dtype = torch.promote_types(dtype, torch.float32)
    limit = advantage_limit(surrogate, is_cap, dtype, delta=delta)
    total = torch.where(valid, adv.detach().double().abs(), torch.zeros((), dtype=torch.float64,
                                                                               device=adv.device)).sum()
    what = f"is_cap={is_cap:g}" if surrogate in ("dppo", "ppo-clip") else f"delta={delta:g}"
    checks.add("advantages", f"sum of |A| over the response tokens exceeds {limit:.3g}, beyond which the "
               f"{str(dtype).removeprefix('torch.')} loss ({surrogate} surrogate, {what}) could "
               "overflow to inf/NaN; scale the advantages down (normalise them)", total > limit)
