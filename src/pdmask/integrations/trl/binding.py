"""Where the TRL trainer's trust region binds: per-update diagnostics, both anchors.

TRL reuses a generation batch for ``steps_per_generation x num_iterations`` micro-steps;
the weights change once every ``gradient_accumulation_steps`` of them. The index the
diagnostics are kept by is the **update index** ``u`` of a micro-step: 1 + the optimizer
steps taken since its generation batch was generated and scored (:func:`update_index`). At
``u = 1`` the weights are those that scored the batch (pi = pi_old), so ``mb1_*`` is the
anchor's distance alone; later indices add the drift of ``u - 1`` updates. (The built-in
trainer's ``mb{j}`` counts mini-batches within an epoch; here the count runs across
``num_iterations``, so ``mb1`` is always "before any update".)

Per training micro-step (:func:`local_values`, gathered over processes, then :func:`metrics`):

- ``mb{u}_out_of_region_frac``, ``mb{u}_masked_frac`` (token shares over all processes) and
  ``mb{u}_divergence_q90`` (the mode's divergence against the anchor; per-process q90, averaged);
- ``masked_share_pos_adv`` / ``masked_share_neg_adv``: the masked share among ``A > 0`` /
  ``A < 0`` tokens (``masked_frac_pos_adv`` is over all tokens);
- at ``u = 1`` only, the start of the batch: ``out_before_update_frac`` (the out-of-region
  share before any update: 0 up to float rounding with ``anchor="old"``),
  ``start_divergence_mean`` / ``_q50`` / ``_q90`` / ``_suggested_delta`` (``D(mu, pi_old)`` with
  ``anchor="old"``, ``D(mu, pi)`` with the rollout anchor: the same policy at ``u = 1``; the
  suggested delta is its q95, :func:`pdmask.anchor.start_quantiles`) and
  ``mu_region_out_frac_at_start`` (the share a region centred on mu holds out there).

:func:`region_warning`: the once-per-run line (:func:`pdmask.anchor.region_warning`) from a
``u = 1`` record, when more than :data:`pdmask.anchor.WARN_OUT_BEFORE_UPDATE` of the tokens are
out of region before any update.

Naive torch of the masked share among ``A > 0``: ``(~keep & valid & (A > 0)).sum() / (valid & (A > 0)).sum()``.
"""

from __future__ import annotations

import torch

from ...anchor import Anchor, anchor_distance, start_quantiles
from ...anchor import region_warning as _region_warning
from ...masks import beyond_delta


def update_index(step: int, ga: int, steps_per_generation: int, num_iterations: int) -> int:
    """1 + the optimizer steps since micro-step ``step``'s generation batch was generated (TRL
    generates at ``step % (steps_per_generation x num_iterations) == 0`` and steps the optimizer
    after every ``ga`` micro-steps)."""
    every = steps_per_generation * num_iterations
    generated = step - step % every
    return step // ga - generated // ga + 1


#: The remedy the warning names beside delta, by anchor: with ``anchor="old"`` the region is
#: already centred on TRL's pi_old, so a start out of region is TRL's old-log-prob forward
#: disagreeing with the update's at the same weights.
HINTS = {"rollout": 'anchor="old" (centre the region on TRL\'s pi_old)',
         "old": "check why TRL's old log-probs differ from the update's forward at the same weights"}


def _q(d: torch.Tensor, valid: torch.Tensor, q: float) -> torch.Tensor:
    vals = d[valid]
    return torch.quantile(vals.double(), q) if vals.numel() else d.new_zeros((), dtype=torch.float64)


def local_values(res, valid: torch.Tensor, adv: torch.Tensor, spec, rollout, anchor: Anchor | None, first: bool,
                 vocab_size: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """This process's ``(sums, means)`` of one micro-batch: token counts (summed over processes)
    and quantiles (averaged). ``res``: the loss's :class:`pdmask.PolicyLossOutput`; ``first``: at
    update index 1 (the start-of-batch values are added)."""
    st, th = res.stats, spec.thresholds
    name = spec.mask_mode.divergence if spec.mask_mode.divergence in st else "binary_kl"  # as the mask reports
    d = torch.where(valid, st[name].detach().double(), torch.zeros((), dtype=torch.float64, device=valid.device))
    a = adv[:, None].expand_as(valid) if adv.dim() == 1 else adv
    cut, pos, neg = ~res.mask & valid, (a > 0) & valid, (a < 0) & valid
    sums = {"tokens": valid.sum(), "out": res.metrics["num_out_of_region"], "masked": cut.sum(), "pos": pos.sum(),
            "neg": neg.sum(), "masked_pos": (cut & pos).sum(), "masked_neg": (cut & neg).sum()}
    means = {"divergence_q90": _q(d, valid, 0.9)}
    if first:
        if anchor is None:  # at u = 1 pi is the policy that scored the batch: D(mu, pi) is the start
            d0, mu_out = d, res.metrics["num_out_of_region"]
        else:
            d0 = anchor_distance(spec.mask_mode.divergence, anchor.rollout_for(rollout), rollout, valid, vocab_size)
            mu_out = (beyond_delta(d0, a.double(), th.delta_low, th.delta_high) & valid).sum()
        sums.update(start_divergence=d0.sum(), mu_out=mu_out)
        q = start_quantiles(d0, valid)
        means.update(start_q50=q["q50"], start_q90=q["q90"], start_suggested=q["suggested_delta"])
        if anchor is not None:  # the region's own divergence (against pi_old) for the warning; not logged
            means.update({f"region_{k}": v for k, v in start_quantiles(d, valid).items()})
    return sums, means


def metrics(u: int, sums: dict[str, float], means: dict[str, float]) -> dict[str, float]:
    """The logged values (module docstring) from the sums over processes and the averaged means."""
    n = max(sums["tokens"], 1.0)
    m = {f"mb{u}_out_of_region_frac": sums["out"] / n, f"mb{u}_masked_frac": sums["masked"] / n,
         f"mb{u}_divergence_q90": means["divergence_q90"],
         "masked_share_pos_adv": sums["masked_pos"] / max(sums["pos"], 1.0),
         "masked_share_neg_adv": sums["masked_neg"] / max(sums["neg"], 1.0)}
    if "start_divergence" in sums:
        m.update(out_before_update_frac=sums["out"] / n, start_divergence_mean=sums["start_divergence"] / n,
                 start_divergence_q50=means["start_q50"], start_divergence_q90=means["start_q90"],
                 start_divergence_suggested_delta=means["start_suggested"],
                 mu_region_out_frac_at_start=sums["mu_out"] / n)
    return m


def region_warning(m: dict[str, float], means: dict[str, float], spec) -> str | None:
    """The once-per-run warning from one micro-step's :func:`metrics` ``m`` and averaged ``means``
    (None before ``u = 1``'s values, or at or below the share); ``spec``: the trainer's
    :class:`pdmask.PolicyLoss`. Its quantiles are of the region's own divergence there: the start
    distance with the rollout anchor, the divergence against TRL's pi_old with ``anchor="old"``."""
    if "out_before_update_frac" not in m:
        return None
    q = (means["region_q50"], means["region_q90"], means["region_suggested_delta"]) if spec.anchored else \
        (m["start_divergence_q50"], m["start_divergence_q90"], m["start_divergence_suggested_delta"])
    return _region_warning(m["out_before_update_frac"], *q, spec.thresholds,
                           HINTS["old" if spec.anchored else "rollout"])
