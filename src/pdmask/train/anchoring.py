"""Where the trainer's trust region is centred, and where it binds.

- :func:`old_anchor` — ``anchor: old``: one no-grad forward of the pre-update weights over the
  step's rollouts, mini-batch by mini-batch exactly as the first epoch's updates will slice
  them (so mini-batch 1 starts at ``pi = pi_old`` to the bit), kept per row as a
  :class:`StepAnchor`; every mini-batch reads its :class:`pdmask.Anchor` from it.
- :class:`BindingLog` — the step's diagnostics of where a region binds: out-of-region and
  masked shares and the divergence's q90 (against the anchor) by mini-batch index (mini-batch 1 is the anchor's distance alone, later ones
  add the step's drift), masked shares among ``A > 0`` and ``A < 0`` tokens, the anchor's
  distance at the start of the step (``D(mu, pi_old)``, or ``D(mu, pi)`` at mini-batch 1 with
  the rollout anchor) and the share of tokens out of region before any update.
- :func:`region_warning` — above :data:`pdmask.anchor.WARN_OUT_BEFORE_UPDATE` (shared by every
  front end) out of region before any update, the run warns once with delta, the
  divergence's q50 / q90 there and a suggested delta.

Naive torch of the anchor forward (one mini-batch)::

    with torch.no_grad(): old = response_logits(model, sub.sequences, sub.attention_mask, sub.prompt_len)
    anchor = pdmask.Anchor.from_logits(old, sub.rollout, temperature=T)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..anchor import Anchor, anchor_distance, start_quantiles
from ..anchor import region_warning as _region_warning
from ..engine.base import RolloutBatch
from ..engine.hf import response_logits
from ..masks import beyond_delta

@dataclass
class StepAnchor:
    """pi_old of one step, per rollout row: ``logprob`` (n, T) at the sampled ids, ``topk``
    (n, T, K) at the engine's top-K ids or None; ``distance`` (n, T) ``D(mu, pi_old)``,
    ``valid`` (n, T) the response tokens; ``mu_out_frac`` the share of them a region centred on mu
    would exclude at pi_old (``D(mu, pi_old)`` beyond delta, by the sign of A)."""

    logprob: torch.Tensor
    topk: torch.Tensor | None
    distance: torch.Tensor
    valid: torch.Tensor
    mu_out_frac: torch.Tensor
    vocab_size: int

    def rows(self, idx: list[int], sub: RolloutBatch) -> Anchor:
        """The :class:`pdmask.Anchor` of a mini-batch (rows ``idx``, its trimmed response width)."""
        T = sub.rollout.sampled_ids.shape[1]
        ix = torch.as_tensor(idx, device=self.logprob.device)
        return Anchor(self.logprob[ix, :T], None if self.topk is None else self.topk[ix, :T])


def old_anchor(model, batch: RolloutBatch, advantages: torch.Tensor, perm: list[int], mb: int, select, plens, rlens,
               cfg) -> StepAnchor:
    """``pi_old`` for every row of the step (see module docstring): the first epoch's
    mini-batches of ``perm`` (``mb`` rows each, cut by ``select``), no gradient."""
    r = batch.rollout
    n, T = r.sampled_ids.shape
    lp = torch.zeros(n, T, dtype=torch.float32)
    tk = None if r.topk_ids is None else torch.full(r.topk_ids.shape, -1e4, dtype=torch.float32)
    with torch.no_grad():
        for j in range(len(perm) // mb):
            idx = perm[j * mb:(j + 1) * mb]
            sub = select(batch, idx, plens, rlens)  # the very slice the update will read
            logits = response_logits(model, sub.sequences, sub.attention_mask, sub.prompt_len)  # (mb, t, V)
            a = Anchor.from_logits(logits, sub.rollout.replace(logits=None), temperature=cfg.loss.sampling.temperature)
            t = a.sampled_logprob.shape[1]
            ix = torch.as_tensor(idx)
            lp[ix, :t] = a.sampled_logprob.float()
            if tk is not None:
                tk[ix, :t] = a.topk_logprobs.float()
    valid = r.response_mask.bool()
    lp = torch.where(valid, lp, torch.zeros_like(lp))
    anchored = r.replace(sampled_logprob=lp, topk_logprobs=tk, logits=None)
    V = model.get_output_embeddings().weight.shape[0]
    dist = anchor_distance(cfg.loss.mask_mode.divergence, anchored, r.replace(logits=None), valid, V)
    th = cfg.loss.thresholds
    out = beyond_delta(dist, advantages.double()[:, None].expand_as(dist), th.delta_low, th.delta_high) & valid
    return StepAnchor(lp, tk, dist, valid, out.sum() / valid.sum().clamp(min=1), V)


def anchor_mismatch(anchor: Anchor, rollout, vocab_size: int) -> dict[str, torch.Tensor]:
    """The engine-vs-trainer mismatch of the step's first mini-batch with ``anchor: old``, the
    same numbers the rollout anchor reads off its first mini-batch's statistics (there pi =
    pi_old): ``mismatch_topk_kl`` the mean top-K KL(mu || pi_old), ``mismatch_abs_log_ratio`` the
    mean ``|log pi_old_k - log mu_k|`` (the anchored statistics measure pi against pi_old, 0 here)."""
    valid = rollout.response_mask.bool()
    anchored = anchor.rollout_for(rollout.replace(logits=None))
    den = valid.sum().clamp(min=1)
    lr = (anchored.sampled_logprob.double() - rollout.sampled_logprob.double()).abs()
    out = {"mismatch_abs_log_ratio": torch.where(valid, lr, 0.0).sum() / den}
    if rollout.topk_ids is not None:
        kl = anchor_distance("topk_kl", anchored, rollout.replace(logits=None), valid, vocab_size)
        out["mismatch_topk_kl"] = kl.sum() / den
    return {k: v.float() for k, v in out.items()}


@dataclass
class BindingLog:
    """The step's where-it-binds metrics (module docstring), gathered per update, read once."""

    minibatches: int
    sums: dict = field(default_factory=dict)
    counts: dict = field(default_factory=dict)
    start: dict = field(default_factory=dict)

    def _add(self, key: str, value: torch.Tensor) -> None:
        self.sums[key] = self.sums.get(key, 0) + value.detach().double()
        self.counts[key] = self.counts.get(key, 0) + 1

    def update(self, j: int, out, sub: RolloutBatch, adv: torch.Tensor, cfg, anchor: StepAnchor | None,
               first: bool) -> None:
        """Mini-batch ``j`` (0-based within its epoch) of the step; ``first``: the step's first update."""
        m = out.metrics
        self._add(f"mb{j + 1}_out_of_region_frac", m["out_of_region_frac"])
        self._add(f"mb{j + 1}_masked_frac", m["masked_frac"])
        valid = sub.rollout.response_mask.bool()
        d = out.stats[cfg.loss.mask_mode.divergence].detach().double()  # against the anchor
        self._add(f"mb{j + 1}_divergence_q90", torch.nanquantile(torch.where(valid, d, float("nan")).reshape(-1), 0.9))
        a = adv[:, None].expand_as(valid)
        masked = ~out.mask & valid
        for name, sel in (("pos", a > 0), ("neg", a < 0)):
            den = (sel & valid).sum().clamp(min=1)
            self._add(f"masked_share_{name}_adv", (masked & sel).sum() / den)
        if not first:
            return
        self.start["out_before_update_frac"] = m["out_of_region_frac"].double()
        if anchor is None:  # the rollout anchor: mini-batch 1 measures D(mu, pi) before any update
            dv = out.stats[cfg.loss.mask_mode.divergence].detach()
            self.start["mu_region_out_frac_at_start"] = m["out_of_region_frac"].double()
        else:  # the old anchor: D(mu, pi_old) over the whole step
            dv, valid = anchor.distance, anchor.valid
            self.start["mu_region_out_frac_at_start"] = anchor.mu_out_frac.double()
        self.start["start_divergence_mean"] = torch.where(valid, dv.double(), 0.0).sum() / valid.sum().clamp(min=1)
        self.start.update({f"start_divergence_{k}": v for k, v in start_quantiles(dv, valid).items()})

    def metrics(self) -> dict[str, torch.Tensor]:
        """Means over the step's updates (and epochs), plus the start-of-step values."""
        return {**{k: self.sums[k] / self.counts[k] for k in self.sums}, **self.start}


def region_warning(rec: dict, cfg) -> str | None:
    """The once-per-run warning (:func:`pdmask.anchor.region_warning`) from a step's record when
    more than :data:`pdmask.anchor.WARN_OUT_BEFORE_UPDATE` of the tokens are out of region before any update
    (None otherwise, or without the numbers)."""
    if "start_divergence_q90" not in rec:
        return None
    return _region_warning(rec.get("out_before_update_frac"), rec["start_divergence_q50"], rec["start_divergence_q90"],
                           rec["start_divergence_suggested_delta"], cfg.loss.thresholds, "anchor=old")
