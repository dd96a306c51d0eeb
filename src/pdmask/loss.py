"""Policy loss: statistics, masking, corrections, per-token surrogate and aggregation, composable.

DPPO-style surrogate for the divergence modes (METHOD.md section 2)::

    loss_t = - M_t * sg(min(r_t, C)) * A_t * log pi(k_t)

so ``d loss_t / d z = - M_t w_t A_t (e_k - pi) / T`` with ``w = min(r, C)`` detached.
The ``grpo`` mode uses the PPO clipped surrogate on the same ratio
``r = pi_k / mu_k`` (anchored to the rollout policy, not a recomputed old policy)::

    loss_t = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))
    loss_t = min(loss_t, -A C)   if A < 0   (dual clip, verl's clip_ratio_c = Thresholds.dual_clip)

whose gradient is ``-A r (e_k - pi) / T`` on kept tokens and 0 on clipped ones; DRPO, SPO
and the smooth predictive weight have no mask, a weight on that gradient instead. The
per-token surrogates are :mod:`pdmask.surrogates` (``token_loss`` is re-exported here).
Every exponentiated log-ratio is capped at ``exp(MAX_LOG_RATIO)``
(:data:`pdmask.stats.MAX_LOG_RATIO`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import ops
from ._validate import Checks, check_choice, check_device, prepare, prepare_rows
from .aggregation import Aggregation, aggregate  # noqa: F401  (Aggregation re-exported: pdmask.loss.Aggregation)
from .corrections import Corrections, apply_corrections, is_weight  # noqa: F401  (is_weight: pdmask.loss.is_weight)
from .divergences import masked_mean
from .keys import BATCH_DDOT, ESTIMATORS, SUPPORTS
from .masks import (
    MODES, MaskMode, MaskResult, Thresholds, check_inputs_for, get_mode, mask_from_stats,
)
from .ops import Compute, Sampling
from .rollout import Rollout
from .stats import stats_from_batch, unflatten
from .surrogates import advantage_limit, check_advantage_scale, token_loss  # noqa: F401  (re-exported)


# ------------------------------------------------------------------ metrics
def mask_metrics(res: MaskResult, keep_eff: torch.Tensor, stats, adv: torch.Tensor,
                 valid: torch.Tensor) -> dict[str, torch.Tensor]:
    """Detached diagnostics (no host sync). Fractions are over response tokens unless named.

    ``disagreement_frac`` = share of out-of-region tokens where the ratio and the
    predictive direction (of the mode's divergence) disagree on "outward" — the
    paper's key diagnostic, reported in every mode.
    """
    v = valid
    n = v.sum().clamp(min=1).to(adv.dtype)
    out = res.out_of_region & v
    masked = ~keep_eff & v
    dis = out & (res.ratio_outward != res.predictive_outward)
    n_out = out.sum()
    m = {
        "kept_frac": (keep_eff & v).sum() / n,
        "masked_frac": masked.sum() / n,
        "masked_frac_mode": (~res.keep & v).sum() / n,
        "masked_frac_pos_adv": (masked & (adv > 0)).sum() / n,
        "masked_frac_neg_adv": (masked & (adv < 0)).sum() / n,
        "out_of_region_frac": n_out / n,
        "disagreement_frac": dis.sum() / n_out.clamp(min=1),
        "num_out_of_region": n_out,
        "num_disagreement": dis.sum(),
        "num_tokens": v.sum(),
        "divergence_mean": masked_mean(res.divergence, v),
        "divergence_max": torch.where(v, res.divergence, torch.zeros_like(res.divergence)).max()
        if res.divergence.numel() else res.divergence.new_zeros(()),
        "ratio_mean": masked_mean(stats["ratio"], v),
        "entropy_mean": masked_mean(stats["entropy"], v),
    }
    if "rollout_tail_mass" in stats:
        m["rollout_tail_mass_mean"] = masked_mean(stats["rollout_tail_mass"], v)
        m["tail_clamped_frac"] = (stats["tail_clamped"] & v).sum() / n
    if "kept_mass" in stats:  # truncated sampling
        m["policy_kept_mass_mean"] = masked_mean(stats["kept_mass"], v)
        m["kept_size_mean"] = masked_mean(stats["kept_size"], v)
        m["kept_set_sampled_outside_frac"] = (stats["sampled_outside"] & v).sum() / n
        if "kept_topk_mismatch" in stats:
            m["kept_set_topk_mismatch_frac"] = masked_mean(stats["kept_topk_mismatch"], v)
    return {k: t.detach() for k, t in m.items()}


def smooth_metrics(w: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
    """The smooth surrogates' weight over the response tokens: ``smooth_weight_mean``,
    ``smooth_weight_min``, ``corrective_frac`` (share with ``w < 0``: pushed back towards mu)."""
    n = valid.sum().clamp(min=1).to(w.dtype)
    big = torch.finfo(w.dtype).max
    w_min = torch.where(valid, w, torch.full_like(w, big)).min() if w.numel() else w.new_zeros(())
    return {k: v.detach() for k, v in {
        "smooth_weight_mean": masked_mean(w, valid),
        "smooth_weight_min": torch.where(valid.any(), w_min, torch.zeros_like(w_min)),
        "corrective_frac": ((w < 0) & valid).sum().to(w.dtype) / n,
    }.items()}


# ------------------------------------------------------------------ public
@dataclass
class PolicyLossOutput:
    """``loss`` (scalar, differentiable); ``metrics`` (dict of detached scalars);
    ``token_loss`` (B, T) per-token surrogate before aggregation; ``mask`` (B, T) bool
    keep mask actually applied; ``stats`` the per-token statistics (B, T)."""

    loss: torch.Tensor
    metrics: dict
    token_loss: torch.Tensor
    mask: torch.Tensor
    stats: dict


def broadcast_advantages(advantages: torch.Tensor, lead: tuple, like: torch.Tensor | None = None) -> torch.Tensor:
    if not isinstance(advantages, torch.Tensor) or not advantages.is_floating_point():
        raise ValueError("advantages: must be a floating-point torch.Tensor")
    if like is not None:
        check_device("advantages", advantages, like)
    if tuple(advantages.shape) == lead:
        return advantages
    if advantages.dim() == 1 and len(lead) == 2 and advantages.shape[0] == lead[0]:
        return advantages[:, None].expand(lead)
    raise ValueError(f"advantages: expected shape {lead} or ({lead[0]},), got {tuple(advantages.shape)}")


def _batch_direction(batch_ddot, batch, checks: Checks | None) -> torch.Tensor:
    """``batch_ddot`` (lead shape) flattened and detached (its values checked through
    ``checks``); :func:`_mask_batch` zeroes it on padding (where any junk may sit)."""
    if not isinstance(batch_ddot, torch.Tensor) or not batch_ddot.is_floating_point():
        raise ValueError("batch_ddot: must be a floating-point torch.Tensor")
    if tuple(batch_ddot.shape) != tuple(batch.lead_shape):
        raise ValueError(f"batch_ddot: expected shape {tuple(batch.lead_shape)} (the leading dims of logits), "
                         f"got {tuple(batch_ddot.shape)}")
    check_device("batch_ddot", batch_ddot, batch.valid)
    d = batch_ddot.detach().reshape(-1)
    if checks is not None:
        checks.add("batch_ddot", "contains NaN or inf on response tokens", (~torch.isfinite(d) & batch.valid).any())
    return d


@dataclass
class MaskedBatch:
    """What :func:`trust_region_mask` and :func:`policy_loss` share: the inputs checked and
    flattened, the statistics and the mask decision (all (N,) rows)."""

    mode: MaskMode
    thresholds: Thresholds
    valid: torch.Tensor  # (N,) bool: the response positions
    lead_shape: tuple  # (B, T), or the caller's leading shape
    advantages: torch.Tensor  # (N,) 0 on padding
    stats: dict  # stats_from_batch output, or the caller's (PolicyLoss.from_stats)
    mask: MaskResult


def _spec(name: str, value, cls):
    """``value`` as an instance of ``cls`` (None: the default one); anything else is refused."""
    if value is None:
        return cls()
    if not isinstance(value, cls):
        raise ValueError(f"{name}: must be a pdmask.{cls.__name__} (or None), got {type(value).__name__}")
    return value


def _refuse_full_modes(mode: MaskMode) -> None:
    """The ``*-full-*`` modes need the rollout's full logits, which the hidden path does not take."""
    if "full" in mode.needs:
        works = [name for name, mm in MODES.items() if "full" not in mm.needs]
        raise ValueError(f"mode: {mode.name!r} needs the rollout policy's full logits, and policy_loss_from_hidden "
                         "has none (it takes no rollout_logits); use policy_loss(..., rollout=Rollout(..., "
                         f"logits=...)) for it, or one of the modes that work here: {', '.join(works)}")


@dataclass(frozen=True)
class PolicyLoss:
    """The policy loss configured once; call it on each batch.

    ``PolicyLoss(mode=..., corrections=...)(logits, rollout, advantages)`` is
    :func:`policy_loss` with these settings (the plugins build one per run). Every setting
    is checked when the object is made (the specs in their own ``__post_init__``; here what
    spans them: the mode, the estimator, the corrections against the mode's surrogate,
    truncated sampling against ``compute.impl``), so a call only checks its tensors.

    Attributes:
        mode: a name in :data:`pdmask.MODES`, or a :class:`MaskMode`.
        estimator: top-K tail estimator of ``Ddot``: ``exact`` (default), ``aggregated``
            (the paper), ``uniform``, ``truncated``.
        support: the support of the top-K divergences: ``topk+sampled`` (default, the
            rollout's top-K plus the sampled token) or ``topk`` (the top-K alone, as the
            DPPO reference code; docs/core.md). Not with the ``pdm-batch-*`` modes.
        thresholds: :class:`Thresholds` (None: the mode's deltas, eps 0.2).
        corrections: :class:`pdmask.Corrections` (None: the token IS weight ``min(r, 5)``).
        sampling: :class:`pdmask.Sampling`, the engine's temperature and truncation
            (None: temperature 1, no truncation).
        aggregation: :class:`Aggregation` (None: token-mean, local counts).
        compute: :class:`pdmask.ops.Compute`, how the reductions run (None: ``impl="auto"``).
        validate: check the tensors' values (one host sync); off on a trusted hot path.
    """

    mode: object = "pdm-topk-kl"
    estimator: str = "exact"
    support: str = "topk+sampled"
    thresholds: Thresholds | None = None
    corrections: Corrections | None = None
    sampling: Sampling | None = None
    aggregation: Aggregation | None = None
    compute: Compute | None = None
    validate: bool = True
    mask_mode: MaskMode = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        mode = get_mode(self.mode)
        check_choice("estimator", self.estimator, ESTIMATORS)
        check_choice("support", self.support, SUPPORTS)
        if self.support != SUPPORTS[0] and "batch" in mode.needs:
            raise ValueError(f"support: mode {mode.name!r} builds its batch direction on the default support "
                             f"{SUPPORTS[0]!r}; {self.support!r} is not available with the pdm-batch-* modes")
        for name, cls in (("thresholds", Thresholds), ("corrections", Corrections), ("sampling", Sampling),
                          ("aggregation", Aggregation), ("compute", Compute)):
            object.__setattr__(self, name, _spec(name, getattr(self, name), cls))
        if not isinstance(self.validate, bool):
            raise ValueError(f"validate: expected True or False, got {self.validate!r}")
        object.__setattr__(self, "mask_mode", mode)
        object.__setattr__(self, "thresholds", self.thresholds.resolve(mode))
        self.corrections.check_surrogate(mode.surrogate, dual_clip=self.thresholds.dual_clip)
        ops.check_truncation(self.compute.impl, self.sampling, None, None)

    def _check_scale(self, checks: Checks, adv, valid, dtype: torch.dtype) -> None:
        """The advantages' bound of this loss's surrogate (:func:`pdmask.surrogates.advantage_limit`)."""
        th = self.thresholds
        check_advantage_scale(checks, adv, valid, dtype, self.mask_mode.surrogate, self.corrections.is_cap,
                              delta=min(th.delta_low, th.delta_high))

    def _masked(self, logits, rollout, advantages, batch_ddot, aggregation=None, hidden=None,
                lm_head_weight=None, loss: bool = True) -> MaskedBatch:
        mode, compute = self.mask_mode, self.compute
        if not isinstance(rollout, Rollout):
            raise ValueError(f"rollout: must be a pdmask.Rollout, got {type(rollout).__name__}")
        ops.check_truncation(compute.impl if hidden is None else "torch", self.sampling, rollout.kept_mask,
                             rollout.logits, rollout=True)
        check_inputs_for(mode, rollout.topk_ids is not None, rollout.logits is not None, batch_ddot is not None)
        # every data check of the inputs goes into one Checks: one host sync before the logits are read
        checks = Checks() if self.validate else None
        if hidden is None:
            batch = prepare(logits, rollout, self.validate, checks=checks)
        else:
            if rollout.logits is not None:
                raise ValueError("rollout.logits: the *-full-* modes are not available from hidden states")
            ops.check_hidden(hidden, lm_head_weight, weight_name="lm_head_weight", flat=False)
            if checks is not None:  # else a bad weight shows only as non-finite rows of `hidden`
                checks.add("lm_head_weight", "contains NaN or inf", ~torch.isfinite(lm_head_weight).all())
            batch = prepare_rows(tuple(hidden.shape[:-1]), lm_head_weight.shape[0], hidden.device, rollout,
                                 self.validate, checks=checks)
            batch.hidden, batch.lm_head_weight = hidden.reshape(-1, hidden.shape[-1]), lm_head_weight
        adv = broadcast_advantages(advantages, batch.lead_shape, batch.valid).reshape(-1)
        ddot = None if batch_ddot is None else _batch_direction(batch_ddot, batch, checks)
        if checks is not None:
            checks.add("advantages", "contains NaN or inf on response tokens", (~torch.isfinite(adv) & batch.valid).any())
            if loss:  # a loss follows (the mask alone reads only the sign of A)
                x = batch.logits if batch.hidden is None else batch.hidden
                self._check_scale(checks, adv, batch.valid, x.dtype)
            if aggregation is not None:
                aggregation.check_values(checks)
            checks.run()
        adv = torch.where(batch.valid, adv, torch.zeros_like(adv))
        stats = stats_from_batch(batch, sampling=self.sampling, compute=compute, validate=self.validate,
                                 support=self.support)
        if ddot is not None:
            ddot = ddot.to(stats["log_ratio"].dtype)
            stats[BATCH_DDOT] = torch.where(batch.valid, ddot, torch.zeros_like(ddot))
        res = mask_from_stats(stats, adv, mode, estimator=self.estimator, thresholds=self.thresholds)
        return MaskedBatch(mode, self.thresholds, batch.valid, batch.lead_shape, adv, stats, res)

    def __call__(self, logits, rollout: Rollout, advantages, *, batch_ddot=None,
                 aggregation: Aggregation | None = None) -> PolicyLossOutput:
        """The loss of one batch (:func:`policy_loss`); ``aggregation`` replaces the
        configured one for this call (per-batch global counts)."""
        agg = self.aggregation if aggregation is None else _spec("aggregation", aggregation, Aggregation)
        return self._loss(self._masked(logits, rollout, advantages, batch_ddot, agg), agg)

    def from_hidden(self, hidden, lm_head_weight, rollout: Rollout, advantages, *, batch_ddot=None,
                    aggregation: Aggregation | None = None) -> PolicyLossOutput:
        """The loss from hidden states and the LM-head weight (:func:`policy_loss_from_hidden`)."""
        _refuse_full_modes(self.mask_mode)
        if self.compute.impl not in ("auto", "torch"):
            raise ValueError(f"compute: impl={self.compute.impl!r} is not available from hidden states "
                             "(this path is plain torch); leave impl='auto'")
        agg = self.aggregation if aggregation is None else _spec("aggregation", aggregation, Aggregation)
        return self._loss(self._masked(None, rollout, advantages, batch_ddot, agg, hidden=hidden,
                                       lm_head_weight=lm_head_weight), agg)

    def mask(self, logits, rollout: Rollout, advantages, *, batch_ddot=None) -> torch.Tensor:
        """The mode's keep mask (:func:`trust_region_mask`)."""
        mb = self._masked(logits, rollout, advantages, batch_ddot, loss=False)
        return (mb.mask.keep | ~mb.valid).reshape(mb.lead_shape)

    def from_stats(self, stats: dict, advantages, response_mask, *, aggregation: Aggregation | None = None,
                   is_weights=None, loss_weights=None) -> PolicyLossOutput:
        """The loss from per-token statistics computed elsewhere: what a plugin calls whose
        framework hands the loss log-probs, not logits (verl: :mod:`pdmask.integrations.verl`).

        Everything after the statistics (the mode's mask, the corrections, the surrogate,
        :func:`aggregate`, the metrics) is the code of :meth:`__call__`.

        Args:
            stats: dict of (B, T) tensors with :func:`pdmask.token_stats`'s keys: ``logp``
                (``log pi_k``, the one differentiable entry: the gradient flows through it),
                ``log_ratio`` (``log pi_k - log mu_k``), ``ratio``, ``entropy`` and what the
                mode reads (its divergence and ``ddot_*`` keys; for the binary modes
                :func:`pdmask.stats.binary_stats` gives them from log-probs alone). Padding
                may hold anything finite that the mode can read; values are not checked.
            advantages: (B, T) or (B,).
            response_mask: (B, T) bool (or 0/1 numbers).
            aggregation: replaces the configured :class:`Aggregation` for this call.
            is_weights: (B, T) an IS weight computed elsewhere against the same mu as
                ``log_ratio`` (verl's ``rollout_is_weights`` when mu is the ratio's anchor); it
                replaces the surrogate's ``min(r, is_cap)``, and a weight of 0 masks the
                token (metrics ``is_weight_mean``, ``masked_frac_is``). ``dppo`` surrogates with
                the default IS weight only (anything else would apply two weights).
            loss_weights: (B, T) a factor on each token's loss (a weight against another
                policy than the ratio's anchor: verl's decoupled three-policy form).

        Naive torch (``dppo`` surrogate, default corrections; ``w_is``, ``w_loss`` default 1)::

            M = mask_from_stats(stats, A, mode, thresholds=th).keep & (w_is > 0)
            w = w_is if is_weights is not None else stats["ratio"].clamp(max=is_cap)
            loss = aggregate(where(M, -w * A * stats["logp"], 0) * w_loss, mask, aggregation)
        """
        mode = self.mask_mode
        for name, default in (("sampling", Sampling()), ("compute", Compute()), ("support", SUPPORTS[0])):
            if getattr(self, name) != default:
                raise ValueError(f"{name}: from_stats takes statistics already computed, so a non-default "
                                 f"{name} has nothing to apply to; compute the statistics with it instead")
        agg = self.aggregation if aggregation is None else _spec("aggregation", aggregation, Aggregation)
        if not isinstance(response_mask, torch.Tensor) or response_mask.dim() != 2 or response_mask.is_complex():
            got = (f"a {response_mask.dtype} tensor of shape {tuple(response_mask.shape)}"
                   if isinstance(response_mask, torch.Tensor) else type(response_mask).__name__)
            raise ValueError(f"response_mask: must be a (B, T) bool or 0/1 tensor, got {got}")
        lead = tuple(response_mask.shape)
        if not isinstance(stats, dict):
            raise ValueError(f"stats: must be a dict of (B, T) tensors, got {type(stats).__name__}")
        wanted = ["logp", "log_ratio", "ratio", "entropy"]
        if mode.needs:  # without its own divergence, a top-K mode would fall back to the binary one
            wanted += [mode.divergence, getattr(mode.region, "divergence", None)]
        if "batch" in mode.needs:
            wanted.append(BATCH_DDOT)
        missing = list(dict.fromkeys(k for k in wanted if k is not None and k not in stats))
        if missing:
            raise ValueError(f"stats: missing {', '.join(map(repr, missing))} (keys of pdmask.token_stats) that "
                             f"mode {mode.name!r} reads")
        for k, v in stats.items():
            if not isinstance(v, torch.Tensor) or tuple(v.shape) != lead:
                got = f"shape {tuple(v.shape)}" if isinstance(v, torch.Tensor) else type(v).__name__
                raise ValueError(f"stats: {k!r} must be a tensor of the response mask's shape {lead}, got {got}")
            check_device(f"stats[{k!r}]", v, response_mask)
        logp = stats["logp"]
        if not logp.is_floating_point():
            raise ValueError(f"stats: 'logp' must be floating-point, got {logp.dtype}")
        if is_weights is not None:
            if mode.surrogate != "dppo":
                raise ValueError(f"is_weights: mode {mode.name!r} uses the {mode.surrogate} surrogate, whose ratio "
                                 "is its weight; only the dppo surrogates take an IS weight")
            if not self.corrections.default_weight:
                raise ValueError("is_weights: replaces the token IS weight min(r, is_cap), but the corrections "
                                 f"compute another weight ({self.corrections}); give one of the two")
        weights = {}
        for name, w in (("is_weights", is_weights), ("loss_weights", loss_weights)):
            if w is None:
                continue
            if not isinstance(w, torch.Tensor) or not w.is_floating_point() or tuple(w.shape) != lead:
                got = f"a {w.dtype} tensor of shape {tuple(w.shape)}" if isinstance(w, torch.Tensor) \
                    else type(w).__name__
                raise ValueError(f"{name}: must be a floating-point tensor of shape {lead}, got {got}")
            check_device(name, w, response_mask)
            weights[name] = w.detach().reshape(-1).to(logp.dtype)
        valid = response_mask.reshape(-1).bool()
        adv = broadcast_advantages(advantages, lead, response_mask).reshape(-1).to(logp.dtype)
        if self.validate:
            checks = Checks()
            if response_mask.dtype != torch.bool:
                mv = response_mask.reshape(-1)
                checks.add("response_mask", "must hold only 0/1 (or bool) values", ((mv != 0) & (mv != 1)).any())
            checks.add("advantages", "contains NaN or inf on response tokens", (~torch.isfinite(adv) & valid).any())
            self._check_scale(checks, adv, valid, logp.dtype)
            for name, w in weights.items():
                checks.add(name, "must be finite and >= 0 on response tokens",
                           (~(torch.isfinite(w) & (w >= 0)) & valid).any())
            agg.check_values(checks)
            checks.run()
        adv = torch.where(valid, adv, torch.zeros_like(adv))
        flat = {k: v.reshape(-1) for k, v in stats.items()}
        try:
            res = mask_from_stats(flat, adv, mode, estimator=self.estimator, thresholds=self.thresholds)
        except KeyError as e:
            raise ValueError(f"stats: missing {e.args[0]!r}, which mode {mode.name!r} (estimator "
                             f"{self.estimator!r}) reads") from None
        mb = MaskedBatch(mode, self.thresholds, valid, lead, adv, flat, res)
        return self._loss(mb, agg, **weights)

    def _loss(self, mb: MaskedBatch, agg: Aggregation, is_weights=None, loss_weights=None) -> PolicyLossOutput:
        """Everything after the statistics and the token mask: corrections, surrogate, aggregation.
        ``is_weights`` / ``loss_weights``: (N,) detached, from :meth:`from_stats`."""
        spec = self.corrections
        valid, adv, stats, res, th = mb.valid, mb.advantages, mb.stats, mb.mask, mb.thresholds
        lead = mb.lead_shape
        seq_shape = lead if len(lead) == 2 else (1, -1)  # (B, T); a flat batch is one sequence
        valid2 = valid.reshape(seq_shape)
        corr = apply_corrections(spec, stats["log_ratio"].reshape(seq_shape), adv.reshape(seq_shape), valid2,
                                 surrogate=mb.mode.surrogate)
        weight = None if corr.weight is None else corr.weight.reshape(-1)
        ck = corr.keep.reshape(-1)
        keep = res.keep & ck
        if is_weights is not None:  # replaces the default weight min(r, C) (checked in from_stats)
            weight = torch.where(valid, is_weights, torch.zeros_like(is_weights))
            keep = keep & (weight > 0)  # a weight of 0 (verl's MIS) masks the token
        if mb.mode.surrogate == "smooth":  # its weight (a correction has none here: check_surrogate)
            weight = res.weight
        per, keep_eff = token_loss(stats["logp"], stats["log_ratio"], adv, keep,
                                   surrogate=mb.mode.surrogate, is_cap=spec.is_cap, eps_low=th.eps_low,
                                   eps_high=th.eps_high, weight=weight, dual_clip=th.dual_clip,
                                   delta_low=th.delta_low, delta_high=th.delta_high,
                                   rollout_logp=stats.get("sampled_logprob"))
        # A correction removes the token from the loss in every surrogate (ppo-clip keeps the
        # constant value of a clipped token, but a rejected one contributes nothing).
        per = torch.where(ck, per, torch.zeros_like(per))
        if loss_weights is not None:
            per = per * torch.where(valid, loss_weights, torch.zeros_like(loss_weights))
        keep_eff = keep_eff & ck
        per2 = per.reshape(seq_shape)
        loss = aggregate(per2, valid2, agg, validate=False)
        metrics = mask_metrics(res, keep_eff, stats, adv, valid)
        metrics.update(corr.metrics)
        if res.weight is not None:
            metrics.update(smooth_metrics(res.weight, valid))
        if is_weights is not None:
            metrics["is_weight_mean"] = masked_mean(weight, valid).detach()
            metrics["masked_frac_is"] = ((weight <= 0) & valid).sum().to(weight.dtype).div(
                valid.sum().clamp(min=1)).detach()
        metrics["loss"] = loss.detach()
        return PolicyLossOutput(loss, metrics, per.reshape(lead), (keep_eff | ~valid).reshape(lead),
                                unflatten(stats, lead))


def trust_region_mask(
    logits, rollout: Rollout, advantages, *, mode="pdm-topk-kl", estimator: str = "exact",
    support: str = "topk+sampled", thresholds: Thresholds | None = None, sampling: Sampling | None = None, batch_ddot=None,
    compute: Compute | None = None, validate: bool = True,
) -> torch.Tensor:
    """The keep mask ``M`` (B, T) bool of a mode: False iff out of region and outward.

    Same arguments as :func:`policy_loss` (the token mask only: the off-policy
    corrections are a later stage, in :func:`policy_loss`'s ``mask``). Padding positions
    are True (they carry no loss anyway). Naive equivalent for ``pdm-topk-kl``::

        st = token_stats(logits, rollout); D = st["topk_kl"]; Dd = st["ddot_topk_kl_exact"]
        M = ~((D > where(A > 0, delta_high, delta_low)) & (A * Dd > 0))
    """
    cfg = PolicyLoss(mode=mode, estimator=estimator, support=support, thresholds=thresholds, sampling=sampling,
                     compute=compute, validate=validate)
    return cfg.mask(logits, rollout, advantages, batch_ddot=batch_ddot)


def policy_loss(
    logits, rollout: Rollout, advantages, *, mode="pdm-topk-kl", estimator: str = "exact",
    support: str = "topk+sampled", thresholds: Thresholds | None = None, corrections: Corrections | None = None,
    sampling: Sampling | None = None, aggregation: Aggregation | None = None, batch_ddot=None,
    compute: Compute | None = None, validate: bool = True,
) -> PolicyLossOutput:
    """Trust-region policy-gradient loss with a named mask mode.

    Args:
        logits: (B, T, V) trainer logits at the response positions (fp32/bf16/fp16/fp64).
        rollout: :class:`pdmask.Rollout`, the engine's sampled ids, ``log mu_k``, top-K
            (None for the modes that need none), response mask, and optionally its kept
            set (truncated sampling) and full logits (the ``*-full-*`` modes).
        advantages: (B, T) or (B,).
        mode: a name in :data:`pdmask.MODES` (``grpo``, ``none``, ``dppo-*``, ``pdm-*``).
        estimator: top-K tail estimator for ``Ddot``: ``exact`` (default), ``aggregated``
            (the paper), ``uniform``, ``truncated``.
        support: the support of the top-K divergences (:data:`pdmask.SUPPORTS`):
            ``"topk+sampled"`` (default) the rollout's top-K plus the sampled token;
            ``"topk"`` the top-K alone, a sampled token outside it in the tail bucket, which
            reproduces the DPPO reference code (Stable-RL's ``compute_topk_kl``); docs/core.md.
        thresholds: :class:`pdmask.Thresholds`: ``delta_low`` / ``delta_high`` for
            A < 0 / A > 0 (default: the mode's, 0.05 for KL, 0.15 for TV); ``eps_low`` /
            ``eps_high``, the ratio clip of ``grpo`` (clip-higher: eps_high = 0.28).
        corrections: :class:`pdmask.Corrections`, the off-policy corrections, a stage
            after the mode's token mask (:mod:`pdmask.corrections`, docs/corrections.md):
            the IS weight (``is_level``, ``[is_floor, is_cap]`` truncated or, with
            ``is_mask``, masked; ``is_cap`` is also ``grpo``'s dual-clip constant unless
            ``thresholds.dual_clip`` is given),
            verl's rejection rules, DeepSeek-V3.2's off-policy sequence mask.
        sampling: :class:`pdmask.Sampling`, the engine's ``temperature``
            (``pi = softmax(logits / temperature)``) and truncation (``top_k``, ``top_p``,
            ``min_p``; vLLM's names and order). With truncation the rollout's log-probs
            must be the engine's processed (renormalised) ones and ``pi`` is renormalised
            over the kept set rebuilt on these logits (plus the sampled token), or over
            ``rollout.kept_mask``; metrics ``policy_kept_mass_mean``, ``kept_size_mean``,
            ``kept_set_sampled_outside_frac``, ``kept_set_topk_mismatch_frac``.
        aggregation: :class:`pdmask.Aggregation`, ``loss_agg`` and global denominators
            (see :func:`aggregate`).
        batch_ddot: (B, T) externally computed direction ``<grad log pi_t, P grad Phi>``
            of the batch-aware modes ``pdm-batch-*`` (:func:`pdmask.batchmask.batch_mask`,
            its ``.ddot``); stored in the stats as ``ddot_batch`` (in any mode, for logging).
        compute: :class:`pdmask.ops.Compute`: ``impl`` (:func:`pdmask.ops.row_stats`:
            ``"auto"``, ``"torch"``, ``"triton"``, ``"reference"``) and ``chunk_rows``.
        validate: check inputs (one host sync); turn off on a trusted hot path.

    Returns:
        :class:`PolicyLossOutput` with ``loss`` and ``metrics`` (detached tensors); ``mask``
        is the final keep mask (mode and corrections).

    Naive equivalent (``pdm-topk-kl``, default corrections, token-mean)::

        st = token_stats(logits, rollout); M = trust_region_mask(logits, rollout, A)
        loss = (-(M * st["ratio"].clamp(max=5) * A * st["logp"]) * mask).sum() / mask.sum()
    """
    cfg = PolicyLoss(mode=mode, estimator=estimator, support=support, thresholds=thresholds,
                     corrections=corrections, sampling=sampling, aggregation=aggregation, compute=compute,
                     validate=validate)
    return cfg(logits, rollout, advantages, batch_ddot=batch_ddot)


def policy_loss_from_hidden(
    hidden, lm_head_weight, rollout: Rollout, advantages, *, mode="pdm-topk-kl", estimator: str = "exact",
    support: str = "topk+sampled", thresholds: Thresholds | None = None, corrections: Corrections | None = None,
    sampling: Sampling | None = None, aggregation: Aggregation | None = None, batch_ddot=None,
    compute: Compute | None = None, validate: bool = True,
) -> PolicyLossOutput:
    """:func:`policy_loss` of ``logits = hidden @ lm_head_weight.T`` without the logits.

    The statistics come from :func:`pdmask.ops.hidden_row_stats`, which walks the
    vocabulary in ``compute.chunk_cols`` column chunks (rows in ``compute.chunk_rows``
    chunks under truncated sampling), so no (N, V) tensor exists; ``loss.backward()`` gives
    gradients to ``hidden`` and to ``lm_head_weight``. Everything after the statistics
    (mask, corrections, surrogate, aggregation, metrics) is :func:`policy_loss`'s own code.

    Args:
        hidden: (B, T, H) final hidden states at the response positions (after the last
            norm: what the LM head multiplies).
        lm_head_weight: (V, H) the LM-head weight (same dtype and device). No bias, no
            logit soft-capping.
        Everything else: as :func:`policy_loss`. Not available: ``rollout.logits`` (the
        ``*-full-*`` modes) and ``compute.impl`` other than ``"auto"`` (plain torch).

    Naive equivalent: ``policy_loss(hidden @ lm_head_weight.T, rollout, advantages, ...)``.
    """
    cfg = PolicyLoss(mode=mode, estimator=estimator, support=support, thresholds=thresholds,
                     corrections=corrections, sampling=sampling, aggregation=aggregation, compute=compute,
                     validate=validate)
    return cfg.from_hidden(hidden, lm_head_weight, rollout, advantages, batch_ddot=batch_ddot)
