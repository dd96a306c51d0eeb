"""Where a pdmask verl loss's trust region binds, and the once-per-run region warning.

- :func:`binding_metrics`: per micro-batch (detached, no host sync) the masked share among
  ``A > 0`` / ``A < 0`` tokens; with pi_old (top-K modes in decoupled mode) ``D(mu, pi_old)``'s
  mean and q90 and the share a mu-centred region holds out there; with the pdmask engine's
  update index ``u`` (:func:`.losses.update_index`) the shares by ``u`` and, at ``u = 1``, the
  start-of-step values (``start_divergence_q50`` / ``_suggested_delta``:
  :func:`pdmask.anchor.start_quantiles` of ``D(mu, pi_old)``).
- :func:`region_check`: the built-in trainer's warning (:func:`pdmask.anchor.region_warning`)
  when more than :data:`pdmask.anchor.WARN_OUT_BEFORE_UPDATE` of a micro-batch's tokens are out
  of region at ``u = 1``, checked once per process (docs/verl.md).

Imports no verl (the losses are unit-tested without it).
"""

from __future__ import annotations

import warnings

import torch

from ...anchor import WARN_OUT_BEFORE_UPDATE, Behaviour, anchor_metrics, region_warning, start_quantiles
from ...loss import PolicyLoss


def binding_metrics(out, spec: PolicyLoss, advantages: torch.Tensor, response_mask: torch.Tensor,
                    distance: torch.Tensor | None, u: int | None) -> dict[str, torch.Tensor]:
    """Where the region binds, per micro-batch (detached): the masked share among ``A > 0`` /
    ``A < 0`` tokens; with pi_old (``distance``: ``D(mu, pi_old)`` of the mode's divergence)
    its mean and q90 and the share a mu-centred region holds out at pi_old; with the update
    index ``u`` (decoupled mode) ``mb{u}_out_of_region_frac`` / ``mb{u}_masked_frac`` and, at
    ``u = 1``, the start-of-step values. Naive torch of the first:
    ``(~keep & m & (A > 0)).sum() / (m & (A > 0)).sum()``."""
    valid = response_mask.bool()
    cut = ~out.mask & valid
    m = {}
    for name, sel in (("pos", (advantages > 0) & valid), ("neg", (advantages < 0) & valid)):
        m[f"masked_share_{name}_adv"] = (cut & sel).sum() / sel.sum().clamp(min=1)
    th = spec.thresholds
    if distance is not None:  # the core's distance metrics (the stats path measures none itself)
        d = anchor_metrics(Behaviour(torch.zeros_like(distance), distance), torch.ones_like(distance), advantages,
                           valid, th.delta_low, th.delta_high)
        m.update({k: d[k] for k in ("anchor_divergence_mean", "anchor_divergence_q90", "anchor_out_of_region_frac")})
    if u is not None:
        m[f"mb{u}_out_of_region_frac"] = out.metrics["out_of_region_frac"]
        m[f"mb{u}_masked_frac"] = out.metrics["masked_frac"]
        if u == 1:
            m["out_before_update_frac"] = out.metrics["out_of_region_frac"]
            if distance is not None:
                q = start_quantiles(distance, valid)  # float64, on the device: no host sync
                m.update(start_divergence_mean=m["anchor_divergence_mean"],
                         start_divergence_q50=q["q50"], start_divergence_q90=m["anchor_divergence_q90"],
                         start_divergence_suggested_delta=q["suggested_delta"],
                         mu_region_out_frac_at_start=m["anchor_out_of_region_frac"])
    return {k: v.detach() for k, v in m.items()}


#: The remedy the warning names beside delta: where it is checked (decoupled mode) the region is
#: already centred on verl's pi_old, so a start out of region is verl's old-log-prob pass
#: disagreeing with the update's forward at the same weights.
REGION_HINT = ("make verl's old-log-prob pass agree with the update's forward (the region is centred on its "
               "old_log_prob already; compare actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu with "
               "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu)")
#: Whether this process has made its one region check (:func:`region_check`).
_REGION_CHECKED = {"done": False}


def region_check(out, spec: PolicyLoss, response_mask: torch.Tensor, u: int | None) -> str | None:
    """The once-per-run warning (:func:`pdmask.anchor.region_warning`), checked on this process's
    first micro-batch at update index ``u = 1`` only: one host sync there (the out-of-region
    share), one more when it warns (the quantiles of the region's own divergence, against verl's
    pi_old), none after. Returns the line it warned (None: quiet, or already checked)."""
    if u != 1 or _REGION_CHECKED["done"]:
        return None
    _REGION_CHECKED["done"] = True
    share = float(out.metrics["out_of_region_frac"])
    if not share > WARN_OUT_BEFORE_UPDATE:
        return None
    div = spec.mask_mode.divergence if spec.mask_mode.divergence in out.stats else "binary_kl"  # as the mask reports
    q = start_quantiles(out.stats[div], response_mask.bool())
    q50, q90, sug = torch.stack([q["q50"], q["q90"], q["suggested_delta"]]).tolist()
    msg = region_warning(share, q50, q90, sug, spec.thresholds, REGION_HINT)
    warnings.warn(f"pdmask (verl): {msg}", UserWarning, stacklevel=2)
    return msg
