"""The anchor: the policy a trust region is centred on, when it is not the rollout engine's mu.

With ``PolicyLoss(anchor="old")`` the loss takes an :class:`Anchor`, the log-probs of a
proximal policy ``pi_old`` (the trainer's weights at the start of the step), and splits
PPO's two roles (docs/core.md, "Choosing the anchor")::

    region, direction, surrogate ratio:  pi_theta against pi_old      (r' = pi_k / pi_old_k)
    off-policy correction:                pi_old against mu, detached  (rho = pi_old_k / mu_k)
    dppo:  -M sg(w(rho) min(r', C)) A log pi_k         others: w(rho) * surrogate(r')

``w`` is the configured :class:`pdmask.Corrections` applied to ``log rho`` (default
``min(rho, C)``). The anchor's top-K log-probs are ``pi_old``'s at the **engine's** top-K
ids (``rollout.topk_ids``), so both anchors measure on the same support ``topK ∪ {k}`` and
``D(mu, pi_old)`` is read on it too. Naive torch of :meth:`Anchor.from_logits`::

    lq = log_softmax(old_logits / T, -1)
    Anchor(lq.gather(-1, k[..., None])[..., 0], lq.gather(-1, rollout.topk_ids))
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import divergences as dv
from ._validate import LOGPROB_TOL, Checks, SpecError
from .divergences import masked_mean
from .keys import TOPK_DIVERGENCES
from .masks import beyond_delta
from .rollout import Rollout

#: Where a trust region is centred: the rollout engine's mu, or the trainer's pi_old.
ANCHORS = ("rollout", "old")
#: The anchored rollout's fields that hold the anchor's values (their errors name ``anchor.``).
ANCHOR_FIELDS = ("sampled_logprob", "topk_logprobs", "logits")
#: Share of response tokens out of region before any update above which a run warns (once):
#: a region that already excludes this much of the batch at its own centre measures the
#: anchor's noise, not the step (docs/core.md, "Choosing the anchor"). Every front end reads it here.
WARN_OUT_BEFORE_UPDATE = 0.05
#: The suggested delta leaves this share of tokens out of region before any update.
SUGGESTED_OUT_SHARE = 0.05


@dataclass(frozen=True)
class Anchor:
    """``pi_old`` at the rollout's positions: ``sampled_logprob`` (B, T) ``log pi_old_k`` of the
    sampled token; ``topk_logprobs`` (B, T, K) ``log pi_old`` at ``rollout.topk_ids`` (the top-K
    modes); ``logits`` (B, T, V) ``pi_old``'s raw logits (the ``*-full-*`` modes). All detached
    when used; log-probs after the sampling temperature, as mu's."""

    sampled_logprob: torch.Tensor
    topk_logprobs: torch.Tensor | None = None
    logits: torch.Tensor | None = None

    def __post_init__(self) -> None:
        for name in ANCHOR_FIELDS:
            v = getattr(self, name)
            if v is None and name != "sampled_logprob":
                continue
            if not isinstance(v, torch.Tensor) or not v.is_floating_point():
                got = f"a {v.dtype} tensor" if isinstance(v, torch.Tensor) else type(v).__name__
                raise SpecError(f"anchor.{name}", f"must be a floating-point torch.Tensor, got {got}")

    @classmethod
    def from_logits(cls, logits: torch.Tensor, rollout: Rollout, *, temperature: float = 1.0) -> "Anchor":
        """The anchor from ``pi_old``'s logits (B, T, V) at the rollout's positions (no
        gradient): its log-probs at the sampled ids and at ``rollout.topk_ids``; the logits
        themselves when the rollout carries mu's (``*-full-*``)."""
        if not isinstance(rollout, Rollout):
            raise SpecError("rollout", f"must be a pdmask.Rollout, got {type(rollout).__name__}")
        if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.dim() < 2 \
                or tuple(logits.shape[:-1]) != tuple(rollout.sampled_ids.shape):
            got = tuple(getattr(logits, "shape", ()))
            raise SpecError("anchor logits", f"expected a floating-point tensor of shape "
                                             f"{tuple(rollout.sampled_ids.shape) + ('V',)}, got {got}")
        with torch.no_grad():
            x = logits.detach()  # reduced in float32 (float64 kept), as the trainer's own logits
            lq = torch.log_softmax((x if x.dtype == torch.float64 else x.float()) / temperature, -1)
            lp = lq.gather(-1, rollout.sampled_ids.long().clamp(0, lq.shape[-1] - 1)[..., None])[..., 0]
            tk = None if rollout.topk_ids is None else \
                lq.gather(-1, rollout.topk_ids.long().clamp(0, lq.shape[-1] - 1))
        full = logits.detach() if rollout.logits is not None else None
        return cls(lp, tk, full)

    def rollout_for(self, rollout: Rollout) -> Rollout:
        """The rollout with ``pi_old`` in mu's place: the statistics of this rollout measure
        ``pi_theta`` against the anchor. Shapes are checked here; values where the loss reads them."""
        if not isinstance(rollout, Rollout):
            raise SpecError("rollout", f"must be a pdmask.Rollout, got {type(rollout).__name__}")
        if rollout.kept_mask is not None:
            raise SpecError("anchor", "truncated sampling (rollout.kept_mask) with an anchor is not built: pi_old "
                                      "would need renormalising over the engine's kept set; use anchor='rollout'")
        for name, partner in (("sampled_logprob", rollout.sampled_ids), ("topk_logprobs", rollout.topk_ids)):
            mu = getattr(rollout, name)  # mu's own values enter the correction and the distance
            if mu is not None and (not mu.is_floating_point() or tuple(mu.shape) != tuple(partner.shape)):
                raise SpecError(f"rollout.{name}", f"expected a floating-point tensor of shape "
                                                   f"{tuple(partner.shape)}, got {mu.dtype} {tuple(mu.shape)}")
        pairs = (("sampled_logprob", rollout.sampled_ids, ()), ("topk_logprobs", rollout.topk_ids, ()),
                 ("logits", rollout.logits, None))
        for name, partner, _ in pairs:
            mine = getattr(self, name)
            if name == "topk_logprobs" and (mine is None) != (partner is None):
                why = ("the rollout has top-K ids: give pi_old's log-probs at them" if mine is None else
                       "the rollout has no top-K ids to read them at")
                raise SpecError("anchor.topk_logprobs", why)
            if name == "logits" and (mine is None) != (partner is None):
                why = ("the rollout carries mu's full logits: give pi_old's" if mine is None else
                       "the rollout carries no full logits of mu to compare them with")
                raise SpecError("anchor.logits", why)
            if mine is not None and tuple(mine.shape) != tuple(partner.shape):
                raise SpecError(f"anchor.{name}", f"expected shape {tuple(partner.shape)} (as rollout."
                                                  f"{'sampled_ids' if name == 'sampled_logprob' else name.replace('logprobs', 'ids')}"
                                                  f"), got {tuple(mine.shape)}")
            if mine is not None and mine.device != partner.device:
                raise SpecError(f"anchor.{name}", f"is on device {mine.device}, the rollout on {partner.device}")
        return rollout.replace(sampled_logprob=self.sampled_logprob.detach(),
                               topk_logprobs=None if self.topk_logprobs is None else self.topk_logprobs.detach(),
                               logits=None if self.logits is None else self.logits.detach())


def renamed_for_anchor(err: SpecError) -> SpecError:
    """A value error of the anchored rollout, named for the anchor where the value was its own."""
    for name in ANCHOR_FIELDS:
        if err.field == f"rollout.{name}":
            return err.renamed(f"anchor.{name}")
    return err


def anchor_distance(divergence: str, anchored: Rollout, rollout: Rollout, valid: torch.Tensor,
                    vocab_size: int) -> torch.Tensor:
    """``D(mu, pi_old)`` per token (detached, float64, 0 on padding) for a binary or top-K
    divergence, on the support ``topK ∪ {k}`` with one tail bucket (the full divergences fall
    back to the binary KL: the loss keeps no full reduction of pi_old). Naive torch (top-K KL,
    full mu and pi_old known): bucket both tails outside ``topK ∪ {k}``, then ``kl_div``."""
    lq = torch.where(valid, anchored.sampled_logprob.detach().double(), torch.zeros((), dtype=torch.float64))
    lmu = torch.where(valid, rollout.sampled_logprob.detach().double(), torch.zeros((), dtype=torch.float64))
    if divergence in TOPK_DIVERGENCES and rollout.topk_ids is not None:
        K = rollout.topk_ids.shape[-1]
        flat = valid.reshape(-1)
        ids = rollout.sampled_ids.reshape(-1).long()
        tk_ids = rollout.topk_ids.reshape(-1, K).long()
        pad = torch.full((), -1e4, dtype=torch.float64)  # padding rows: one harmless support
        tq = torch.where(flat[:, None], anchored.topk_logprobs.reshape(-1, K).detach().double(), pad).clamp(max=0)
        tm = torch.where(flat[:, None], rollout.topk_logprobs.reshape(-1, K).detach().double(), pad).clamp(max=0)
        sup = dv.build_support(ids, lq.reshape(-1).clamp(max=0), lmu.reshape(-1).clamp(max=0), tk_ids, tq, tm,
                               torch.zeros_like(lq.reshape(-1)), vocab_size)
        d = TOPK_DIVERGENCES[divergence].value(sup).reshape(valid.shape)
    elif divergence == "binary_tv":
        d = dv.binary_tv(lq, lmu)
    else:
        d = dv.binary_kl(lq.clamp(max=0), lmu.clamp(max=0))
    return torch.where(valid, d, torch.zeros_like(d))


def check_behaviour(rollout: Rollout) -> None:
    """mu's sampled log-prob, finite and <= 0 on response tokens: an anchored loss reads it in
    ``pi_old / mu`` (the anchored statistics never see it)."""
    lp = rollout.sampled_logprob
    valid = torch.ones_like(lp, dtype=torch.bool) if rollout.response_mask is None else rollout.response_mask.bool()
    checks = Checks()
    checks.add("rollout.sampled_logprob", "must be finite and <= 0 on response tokens (log mu_k enters the "
               "correction pi_old / mu)", (~(torch.isfinite(lp) & (lp <= LOGPROB_TOL)) & valid).any())
    checks.run()


@dataclass(frozen=True)
class Behaviour:
    """The behaviour side of an anchored loss: ``log_ratio`` (B, T) detached ``log pi_old_k -
    log mu_k`` (0 on padding), the correction's input; ``distance`` (B, T) ``D(mu, pi_old)`` of
    the mode's divergence (None when not measured: the stats path), a diagnostic."""

    log_ratio: torch.Tensor
    distance: torch.Tensor | None = None


def behaviour_of(divergence: str, anchored: Rollout, rollout: Rollout, st, logits) -> Behaviour:
    """The :class:`Behaviour` of a batch: ``log pi_old_k - log mu_k`` and ``D(mu, pi_old)`` of the
    mode's ``divergence`` (``st``: the statistics against the anchor; ``logits``: their source)."""
    valid = st.valid
    dt = st.log_ratio.dtype
    lr = anchored.sampled_logprob.detach().to(dt) - rollout.sampled_logprob.detach().to(dt)
    lr = torch.where(valid, lr, torch.zeros_like(lr))
    V = logits.weight.shape[0] if hasattr(logits, "weight") else logits.shape[-1]
    dist = anchor_distance(divergence, anchored, rollout, valid, V)
    return Behaviour(lr, dist.to(dt))


def anchor_metrics(behaviour: Behaviour, w_beh: torch.Tensor, adv: torch.Tensor, valid: torch.Tensor,
                   delta_low: float, delta_high: float) -> dict[str, torch.Tensor]:
    """Detached diagnostics of an anchored loss (no host sync): the behaviour weight's mean
    and the share of tokens it truncates or zeroes, ``|log(pi_old/mu)|``'s mean, and, where
    measured, ``D(mu, pi_old)``'s mean and q90 and the share of tokens beyond delta by it (the
    mu-centred region's out-of-region share at the anchor)."""
    n = valid.sum().clamp(min=1)
    m = {"behaviour_weight_mean": masked_mean(w_beh, valid),
         "behaviour_abs_log_ratio_mean": masked_mean(behaviour.log_ratio.abs(), valid)}
    d = behaviour.distance
    if d is not None:
        nan = torch.full_like(d, float("nan"))
        vals = torch.where(valid, d, nan).reshape(-1)
        q90 = torch.nanquantile(vals.float(), 0.9) if vals.numel() else d.new_zeros(())
        m.update(anchor_divergence_mean=masked_mean(d, valid),
                 anchor_divergence_q90=torch.where(valid.any(), q90.to(d.dtype), torch.zeros_like(q90, dtype=d.dtype)),
                 anchor_out_of_region_frac=(beyond_delta(d, adv, delta_low, delta_high) & valid).sum() / n)
    return {k: v.detach() for k, v in m.items()}


def start_quantiles(d: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
    """``q50``, ``q90`` and ``suggested_delta`` (the ``1 - SUGGESTED_OUT_SHARE`` quantile, the
    delta that would leave that share out) of a divergence ``d`` over the ``valid`` tokens, float64
    scalars on ``d``'s device (0 without a valid token; no host sync). Naive torch:
    ``torch.quantile(d[valid].double(), torch.tensor([0.5, 0.9, 1 - SUGGESTED_OUT_SHARE]))``."""
    vals = torch.where(valid, d.detach().double(), torch.full((), float("nan"), dtype=torch.float64, device=d.device))
    qs = torch.tensor([0.5, 0.9, 1 - SUGGESTED_OUT_SHARE], dtype=torch.float64, device=d.device)
    q = torch.nanquantile(vals.reshape(-1), qs) if vals.numel() else torch.zeros_like(qs)
    q = torch.where(valid.any(), q, torch.zeros_like(q))  # all-NaN (no valid token) -> 0
    return {"q50": q[0], "q90": q[1], "suggested_delta": q[2]}


def region_warning(out_share: float, q50: float, q90: float, suggested: float, thresholds,
                   hint: str) -> str | None:
    """The once-per-run warning of every front end (None at or below
    :data:`WARN_OUT_BEFORE_UPDATE`): ``out_share`` of the tokens are out of region before any
    update; delta (``thresholds.delta_low`` / ``delta_high``), the divergence's q50 / q90 there,
    the suggested delta (:func:`start_quantiles`) and ``hint``, the front end's other remedy
    (e.g. ``"anchor=old"``)."""
    if out_share is None or not out_share > WARN_OUT_BEFORE_UPDATE:
        return None
    return (f"{out_share:.1%} of tokens are out of region before any update (more than {WARN_OUT_BEFORE_UPDATE:.0%}): "
            f"delta = {thresholds.delta_low:g}/{thresholds.delta_high:g}, the divergence there has q50 "
            f"{q50:.3g} and q90 {q90:.3g}; the region measures the anchor's noise: try delta ~ {suggested:.3g} "
            f"(its q{100 * (1 - SUGGESTED_OUT_SHARE):.0f}) or {hint}")
