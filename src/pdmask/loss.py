"""Policy loss: one spec (:class:`PolicyLoss`), one consumer of the statistics
(:func:`loss_from_stats`: the mode's mask, the corrections, the surrogate, the aggregation,
the metrics; METHOD.md section 2), and verl's aggregation (:class:`Aggregation`, :func:`aggregate`).
The anchored loss's behaviour side lives in :mod:`pdmask.anchor`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import torch

from . import ops
from ._validate import Checks, SpecError, check_bool, check_choice, check_count, check_device
from .anchor import ANCHORS, Anchor, Behaviour, anchor_metrics, behaviour_of, check_behaviour, renamed_for_anchor
from .corrections import Corrections, apply_corrections
from .divergences import floor_neginf, masked_mean
from .keys import ESTIMATORS, SUPPORTS
from .masks import MODES, MaskMode, MaskResult, Thresholds, check_inputs_for, decide, get_mode, with_preset
from .rollout import Rollout
from .stats import TokenStats, token_stats
from .surrogates import SURROGATES, _token_loss, check_advantage_scale, check_corrections, is_weight, ratio_weight

# ------------------------------------------------------------------ aggregation
#: The aggregation modes (verl 0.9.1's ``agg_loss``) and the denominators of
#: :class:`Aggregation` each one reads, its count first (the count is required when
#: ``dp_size > 1``); a denominator the mode does not read is refused, not ignored.
LOSS_AGG_READS = {
    "token-mean": ("num_tokens",),
    "token-sum": (),
    "seq-mean-token-mean": ("num_seqs",),
    "seq-mean-token-sum": ("num_seqs",),
    "seq-mean-token-sum-norm": ("num_seqs", "loss_scale_factor"),
}
LOSS_AGGS = tuple(LOSS_AGG_READS)
#: The denominators of :class:`Aggregation` (each None, a positive number or a 0-d tensor).
COUNTS = ("num_tokens", "num_seqs", "loss_scale_factor")


@dataclass(frozen=True)
class Aggregation:
    """How per-token losses reduce to a scalar: verl 0.9.1's ``agg_loss`` (:func:`aggregate`).

    ``loss_agg`` one of :data:`LOSS_AGGS`; ``num_tokens`` / ``num_seqs``: global counts in place
    of the local denominators (verl's ``batch_num_tokens`` / ``global_batch_size``),
    ``loss_scale_factor`` the ``-norm`` mode's T; each None, a positive number or a one-element
    tensor (its value checked with the call's data checks); one the mode does not read is
    refused. ``dp_size`` multiplies the loss, so the ranks' average gradient is that of the
    global aggregate (then the mode's global count is required)."""

    loss_agg: str = "token-mean"
    num_tokens: object = None
    num_seqs: object = None
    loss_scale_factor: object = None
    dp_size: int = 1

    def __post_init__(self) -> None:
        check_choice("loss_agg", self.loss_agg, LOSS_AGGS)
        reads = LOSS_AGG_READS[self.loss_agg]
        for name in COUNTS:
            check_count(name, getattr(self, name))
            if getattr(self, name) is not None and name not in reads:
                readers = [a for a, r in LOSS_AGG_READS.items() if name in r]
                raise SpecError(name, f"{self.loss_agg} does not read it (read by: {', '.join(readers)}); "
                                      "leave it None")
        dp = self.dp_size
        if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
            raise SpecError("dp_size", f"must be a positive int (the data-parallel world size), got {dp!r}")
        if dp > 1 and reads and getattr(self, reads[0]) is None:
            raise SpecError(reads[0], f"required when dp_size > 1 (got dp_size={dp}): {self.loss_agg} then "
                                      "divides by the global count, which no rank can see locally")

    def check_values(self, checks: Checks) -> None:
        """The values of tensor denominators, into ``checks`` (no sync here)."""
        for name in COUNTS:
            check_count(name, getattr(self, name), checks)


def aggregate(token_values: torch.Tensor, response_mask: torch.Tensor, aggregation: Aggregation | None = None, *,
              validate: bool = True) -> torch.Tensor:
    """Reduce (B, T) per-token values to a scalar with verl's aggregation modes. With ``m``
    the mask, ``S_b = sum_t x_bt m_bt``, ``n_b = sum_t m_bt``, ``D`` the ``dp_size``:
    ``token-mean`` ``D sum_b S_b / sum_b n_b`` (DAPO); ``token-sum`` ``D sum_b S_b``;
    ``seq-mean-token-mean`` ``D mean_b S_b / n_b`` over sequences with ``n_b > 0`` (GRPO; verl's
    ``n_b + 1e-8`` is the same float32 on its bool mask); ``seq-mean-token-sum`` ``D mean_b S_b``;
    ``-norm`` that over ``loss_scale_factor`` (default T; Dr. GRPO). Padding is excluded with
    ``where``; an empty batch gives 0. Naive torch (token-mean): ``(x * m).sum() / m.sum() * D``."""
    agg = Aggregation() if aggregation is None else aggregation
    if not isinstance(agg, Aggregation):
        raise SpecError("aggregation", f"must be a pdmask.Aggregation, got {type(agg).__name__}")
    if validate:
        checks = Checks()
        agg.check_values(checks)
        checks.run()
    if token_values.dim() == 1:
        token_values, response_mask = token_values[None], response_mask[None]
    m = response_mask.bool()
    x = torch.where(m, token_values, torch.zeros_like(token_values))
    # verl's order of operations (sum / count * dp_size, then / loss_scale_factor), so the
    # two agree to the last bit where the sums do
    if agg.loss_agg == "token-sum":
        return x.sum() * agg.dp_size
    if agg.loss_agg == "token-mean":
        return x.sum() / _den(m.sum() if agg.num_tokens is None else agg.num_tokens, x, agg.num_tokens is None) \
            * agg.dp_size
    n_b = m.sum(-1)
    den = _den((n_b > 0).sum() if agg.num_seqs is None else agg.num_seqs, x, agg.num_seqs is None)
    if agg.loss_agg == "seq-mean-token-mean":
        return (x.sum(-1) / n_b.clamp(min=1).to(x.dtype)).sum() / den * agg.dp_size
    out = x.sum() / den * agg.dp_size
    if agg.loss_agg == "seq-mean-token-sum-norm":
        out = out / (token_values.shape[-1] if agg.loss_scale_factor is None else agg.loss_scale_factor)
    return out


def _den(den, like: torch.Tensor, local: bool):
    """A local count (at least 1) or a user-given, checked denominator used as it is."""
    if isinstance(den, torch.Tensor):
        d = den.to(like.dtype) if local else den.detach().reshape(()).to(like.dtype)
        return d.clamp(min=1) if local else d
    return max(float(den), 1.0) if local else float(den)


# ------------------------------------------------------------------ metrics
def mask_metrics(res: MaskResult, keep_eff: torch.Tensor, stats: Mapping, adv: torch.Tensor,
                 valid: torch.Tensor) -> dict[str, torch.Tensor]:
    """Detached diagnostics (no host sync), fractions over response tokens unless named;
    ``disagreement_frac``: share of out-of-region tokens where the ratio and the predictive
    direction (of the mode's divergence) disagree on "outward" (the paper's key diagnostic)."""
    v = valid
    n = v.sum().clamp(min=1).to(adv.dtype)
    out, masked = res.out_of_region & v, ~keep_eff & v
    dis = out & (res.ratio_outward != res.predictive_outward)
    n_out = out.sum()
    d = res.divergence
    m = {
        "kept_frac": (keep_eff & v).sum() / n, "masked_frac": masked.sum() / n,
        "masked_frac_mode": (~res.keep & v).sum() / n, "masked_frac_pos_adv": (masked & (adv > 0)).sum() / n,
        "masked_frac_neg_adv": (masked & (adv < 0)).sum() / n, "out_of_region_frac": n_out / n,
        "disagreement_frac": dis.sum() / n_out.clamp(min=1), "num_out_of_region": n_out,
        "num_disagreement": dis.sum(), "num_tokens": v.sum(), "divergence_mean": masked_mean(d, v),
        "divergence_max": torch.where(v, d, torch.zeros_like(d)).max() if d.numel() else d.new_zeros(()),
        "ratio_mean": masked_mean(stats["ratio"], v), "entropy_mean": masked_mean(stats["entropy"], v),
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
    if res.weight is not None:  # the smooth surrogates' weight; corrective: w < 0 (pushed back towards mu)
        w = res.weight
        w_min = torch.where(v, w, torch.full_like(w, torch.finfo(w.dtype).max)).min() if w.numel() else w.new_zeros(())
        m.update(smooth_weight_mean=masked_mean(w, v), smooth_weight_min=torch.where(v.any(), w_min,
                 torch.zeros_like(w_min)), corrective_frac=((w < 0) & v).sum().to(w.dtype) / v.sum().clamp(min=1))
    return {k: t.detach() for k, t in m.items()}


# ------------------------------------------------------------------ the spec
@dataclass
class PolicyLossOutput:
    """``loss`` (scalar, differentiable); ``metrics`` (dict of detached scalars);
    ``token_loss`` per-token surrogate before aggregation; ``mask`` bool keep mask actually
    applied; ``stats`` the :class:`pdmask.TokenStats` (all shaped like the rollout's ids)."""

    loss: torch.Tensor
    metrics: dict
    token_loss: torch.Tensor
    mask: torch.Tensor
    stats: TokenStats


def _spec(name: str, value, cls):
    """``value`` as an instance of ``cls`` (None: the default one); anything else is refused."""
    if value is None:
        return cls()
    if not isinstance(value, cls):
        raise SpecError(name, f"must be a pdmask.{cls.__name__} (or None), got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class PolicyLoss:
    """The policy loss configured once, checked when made (a call only checks its tensors);
    call it on each batch (:func:`policy_loss`). ``mode``: a name in :data:`pdmask.MODES` or a
    :class:`pdmask.MaskMode`; ``estimator``: of the top-K ``Ddot`` (``exact``, ``aggregated``,
    ``uniform``, ``truncated``); ``support``: ``topk+sampled`` or ``topk`` (docs/core.md); the
    specs :class:`pdmask.Thresholds` (None: the mode's deltas), :class:`pdmask.Corrections`
    (None: the token IS weight ``min(r, 5)``), :class:`pdmask.Sampling` (the engine's temperature
    and truncation), :class:`pdmask.Aggregation`, :class:`pdmask.Compute`; ``validate``: check
    the tensors' values (one host sync; off on a trusted hot path); ``anchor``: where the region
    is centred (:data:`pdmask.anchor.ANCHORS`): ``"rollout"`` mu, ``"old"`` the call's
    :class:`pdmask.Anchor` pi_old, with the corrections between pi_old and mu
    (:mod:`pdmask.anchor`)."""

    mode: object = "pdm-topk-kl"
    estimator: str = "exact"
    support: str = "topk+sampled"
    thresholds: Thresholds | None = None
    corrections: Corrections | None = None
    sampling: ops.Sampling | None = None
    aggregation: Aggregation | None = None
    compute: ops.Compute | None = None
    validate: bool = True
    anchor: str = "rollout"
    mask_mode: MaskMode = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        mode = get_mode(self.mode)
        check_choice("estimator", self.estimator, ESTIMATORS)
        check_choice("support", self.support, SUPPORTS)
        if self.support not in mode.supports:
            raise SpecError("support", f"mode {mode.name!r} works on the support {', '.join(mode.supports)} only, "
                                       f"not {self.support!r}")
        for name, cls in (("thresholds", Thresholds), ("corrections", Corrections), ("sampling", ops.Sampling),
                          ("aggregation", Aggregation), ("compute", ops.Compute)):
            object.__setattr__(self, name, _spec(name, getattr(self, name), cls))
        check_bool("validate", self.validate)
        check_choice("anchor", self.anchor, ANCHORS)
        object.__setattr__(self, "mask_mode", mode)
        object.__setattr__(self, "thresholds", self.thresholds.resolve(mode))
        object.__setattr__(self, "corrections", with_preset(self.corrections, mode, self.thresholds))
        if self.anchor == "rollout":
            check_corrections(mode.surrogate, self.corrections, dual_clip=self.thresholds.dual_clip, mode=mode.name)
        elif self.corrections.is_level is None and self.corrections.is_cap_given:
            raise SpecError("is_cap", "bounds the IS weight pi_old/mu, and is_level=None applies none, so it would "
                                      "be ignored; set is_level='token' or 'sequence', or remove is_cap")
        if self.anchor == "old" and not (self.sampling.top_k is None and self.sampling.top_p is None
                                         and self.sampling.min_p is None):
            raise SpecError("anchor", "truncated sampling with anchor='old' is not built (pi_old would need "
                                      "renormalising over the kept set); use anchor='rollout'")
        ops.check_truncation(self.compute.impl, self.sampling, None, None)

    @property
    def anchored(self) -> bool:
        """The region is centred on a proximal policy pi_old (``anchor="old"``), not on mu."""
        return self.anchor == "old"

    def __call__(self, logits, rollout: Rollout, advantages, *, aggregation: Aggregation | None = None,
                 extras: Mapping[str, torch.Tensor] | None = None, anchor: Anchor | None = None) -> PolicyLossOutput:
        """The loss of one batch (:func:`policy_loss`); ``aggregation`` replaces the
        configured one for this call (per-batch global counts); ``anchor``: pi_old's
        log-probs, required with ``anchor="old"`` (:class:`pdmask.Anchor`)."""
        agg = self.aggregation if aggregation is None else _spec("aggregation", aggregation, Aggregation)
        st, adv, beh = self._stats(logits, rollout, advantages, extras, agg, anchor)
        return _loss(self, st, adv, agg, behaviour=beh)

    def mask(self, logits, rollout: Rollout, advantages, *, extras=None, anchor: Anchor | None = None) -> torch.Tensor:
        """The mode's keep mask (:func:`trust_region_mask`)."""
        st, adv, _ = self._stats(logits, rollout, advantages, extras, None, anchor)
        res = decide(st, adv, self.mask_mode, self.estimator, self.thresholds)
        return res.keep | ~st.valid

    def from_stats(self, stats: TokenStats, advantages, response_mask, *, aggregation: Aggregation | None = None,
                   is_weights=None, loss_weights=None, behaviour_logprob=None) -> PolicyLossOutput:
        """:func:`loss_from_stats` with this spec."""
        return loss_from_stats(stats, advantages, response_mask, self, aggregation=aggregation,
                               is_weights=is_weights, loss_weights=loss_weights, behaviour_logprob=behaviour_logprob)

    def _stats(self, logits, rollout, advantages, extras, agg, anchor=None) -> tuple[TokenStats, torch.Tensor, object]:
        """The producer's statistics (against the anchor when there is one), the call's own
        checks in its first host sync, and the behaviour part (None without an anchor)."""
        if not isinstance(rollout, Rollout):
            raise SpecError("rollout", f"must be a pdmask.Rollout, got {type(rollout).__name__}")
        if self.anchored != (anchor is not None):
            raise SpecError("anchor", "anchor='old' needs pi_old's log-probs: pass anchor=pdmask.Anchor(...) "
                                      "(Anchor.from_logits)" if self.anchored else
                                      "an Anchor was passed, but the loss is centred on the rollout (anchor="
                                      "'rollout'); build the PolicyLoss with anchor='old'")
        if anchor is not None and not isinstance(anchor, Anchor):
            raise SpecError("anchor", f"must be a pdmask.Anchor, got {type(anchor).__name__}")
        behaviour = rollout
        if anchor is not None:
            rollout = anchor.rollout_for(rollout)
        extras, mode = {} if extras is None else dict(extras), self.mask_mode
        if isinstance(logits, ops.Hidden) and "full" in mode.needs:
            works = ", ".join(name for name, m in MODES.items() if "full" not in m.needs)
            raise SpecError("mode", f"{mode.name!r} needs the rollout policy's full logits, and "
                                    "policy_loss_from_hidden takes no rollout_logits; use policy_loss(..., rollout="
                                    f"Rollout(..., logits=...)) for it, or one of the modes that work here: {works}")
        check_inputs_for(mode, rollout.topk_ids is not None, rollout.logits is not None, extras)
        got = {}

        def mine(batch, checks):  # once the rollout is checked against the logits
            lead, x = batch.lead_shape, logits.hidden if isinstance(logits, ops.Hidden) else logits
            valid = batch.valid.reshape(lead)
            got["adv"] = _advantages(self, advantages, lead, valid, checks, x.dtype if agg is not None else None)
            for name, t in extras.items():
                if not isinstance(t, torch.Tensor) or not t.is_floating_point() or tuple(t.shape) != lead:
                    raise SpecError(f"extras[{name!r}]", f"expected a floating-point tensor of shape {lead}, got "
                                    f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
                check_device(f"extras[{name!r}]", t, valid)
                if checks is not None:
                    checks.add(f"extras[{name!r}]", "contains NaN or inf on response tokens",
                               (~torch.isfinite(t) & valid).any())
            if checks is not None and agg is not None:
                agg.check_values(checks)

        if anchor is not None and self.validate:  # mu's log-prob enters the correction (its own sync)
            check_behaviour(behaviour)
        try:
            st = token_stats(logits, rollout, sampling=self.sampling, compute=self.compute, support=self.support,
                             validate=self.validate, checks=mine)
        except SpecError as err:
            raise (err if anchor is None else renamed_for_anchor(err)) from None
        beh = None if anchor is None else behaviour_of(self.mask_mode.divergence, rollout, behaviour, st, logits)
        if extras:  # detached, 0 on padding (where any junk may sit)
            dt = st.log_ratio.dtype
            st = replace(st, extras={k: torch.where(st.valid, t.detach().to(dt), torch.zeros((), dtype=dt,
                                     device=t.device)) for k, t in extras.items()})
        return st, torch.where(st.valid, got["adv"], torch.zeros_like(got["adv"])), beh


def _advantages(spec: PolicyLoss, advantages, lead: tuple, valid: torch.Tensor, checks: Checks | None,
                loss_dtype: torch.dtype | None) -> torch.Tensor:
    """``advantages`` (``lead`` or (B,)) broadcast to ``lead``; with ``checks``: finite on the
    response tokens and, when a loss of ``loss_dtype`` follows, within its bound
    (:func:`pdmask.masks.advantage_limit`)."""
    if not isinstance(advantages, torch.Tensor) or not advantages.is_floating_point():
        raise SpecError("advantages", "must be a floating-point torch.Tensor")
    check_device("advantages", advantages, valid)
    if tuple(advantages.shape) == lead:
        adv = advantages
    elif advantages.dim() == 1 and len(lead) == 2 and advantages.shape[0] == lead[0]:
        adv = advantages[:, None].expand(lead)
    else:
        raise SpecError("advantages", f"expected shape {lead} or ({lead[0]},), got {tuple(advantages.shape)}")
    if checks is not None:
        checks.add("advantages", "contains NaN or inf on response tokens", (~torch.isfinite(adv) & valid).any())
        if loss_dtype is not None:  # a loss follows (the mask alone reads only the sign of A)
            th = spec.thresholds
            # anchored: every surrogate also carries the behaviour weight, at most is_cap
            check_advantage_scale(checks, adv, valid, loss_dtype, spec.mask_mode.surrogate, spec.corrections.is_cap,
                                  delta=min(th.delta_low, th.delta_high), behaviour_cap=spec.corrections.is_cap
                                  if spec.anchored else None)
    return adv


# ------------------------------------------------------------------ the one consumer
def loss_from_stats(stats: TokenStats, advantages, response_mask, spec: PolicyLoss, *,
                    aggregation: Aggregation | None = None, is_weights=None, loss_weights=None,
                    behaviour_logprob=None) -> PolicyLossOutput:
    """The loss from :class:`pdmask.TokenStats` (shaped like the (B, T) ``response_mask``;
    ``logp`` carries the gradient): the mode's mask, the corrections, the surrogate,
    :func:`aggregate`, the metrics. :func:`policy_loss` ends here; a plugin handed log-probs
    starts here (verl). ``spec``'s producer settings (``sampling``, ``compute``, ``support``) must
    be the defaults; ``aggregation`` replaces its own. ``is_weights``: (B, T) an IS weight against
    the same mu (verl's ``rollout_is_weights``) in place of ``min(r, is_cap)``, 0 masking the
    token (``dppo`` with the default weight only); ``loss_weights``: a factor on each token's loss.
    With ``spec.anchor="old"`` the statistics are measured against pi_old (their
    ``sampled_logprob`` is ``log pi_old_k``) and ``behaviour_logprob`` (B, T) is mu's ``log mu_k``:
    the corrections read ``pi_old / mu``; ``is_weights`` (any surrogate) then replaces that weight.

    Naive torch (``dppo`` surrogate, default corrections; ``w_is``, ``w_loss`` default 1)::

        M = mask_from_stats(stats, A, mode, thresholds=th).keep & (w_is > 0)
        w = w_is if is_weights is not None else stats.ratio.clamp(max=is_cap)
        loss = aggregate(where(M, -w * A * stats.logp, 0) * w_loss, mask, aggregation)
    """
    if not isinstance(spec, PolicyLoss):
        raise SpecError("spec", f"must be a pdmask.PolicyLoss, got {type(spec).__name__}")
    for name, default in (("sampling", ops.Sampling()), ("compute", ops.Compute()), ("support", SUPPORTS[0])):
        if getattr(spec, name) != default:
            raise SpecError(name, f"from_stats takes statistics already computed, so a non-default {name} has "
                                  "nothing to apply to; compute the statistics with it instead")
    agg = spec.aggregation if aggregation is None else _spec("aggregation", aggregation, Aggregation)
    if not isinstance(response_mask, torch.Tensor) or response_mask.dim() != 2 or response_mask.is_complex():
        got = (f"a {response_mask.dtype} tensor of shape {tuple(response_mask.shape)}"
               if isinstance(response_mask, torch.Tensor) else type(response_mask).__name__)
        raise SpecError("response_mask", f"must be a (B, T) bool or 0/1 tensor, got {got}")
    lead = tuple(response_mask.shape)
    if not isinstance(stats, TokenStats):
        raise SpecError("stats", f"must be a pdmask.TokenStats, got {type(stats).__name__}")
    check_inputs_for(spec.mask_mode, stats.topk is not None, stats.full is not None, stats.extras, where="stats.")
    for k, v in stats.items():
        if tuple(v.shape) != lead:
            raise SpecError("stats", f"{k!r} must be a tensor of the response mask's shape {lead}, got shape "
                                     f"{tuple(v.shape)}")
        check_device(f"stats[{k!r}]", v, response_mask)
    if not stats.logp.is_floating_point():
        raise SpecError("stats", f"'logp' must be floating-point, got {stats.logp.dtype}")
    weights = _weights(spec, lead, response_mask, stats.logp.dtype, is_weights=is_weights, loss_weights=loss_weights)
    valid = response_mask.bool()
    if spec.anchored != (behaviour_logprob is not None):
        raise SpecError("behaviour_logprob", "anchor='old' needs mu's log-probs (the stats are against pi_old)"
                        if spec.anchored else "given, but the loss is centred on the rollout (anchor='rollout')")
    beh = None
    if behaviour_logprob is not None:
        if not isinstance(behaviour_logprob, torch.Tensor) or not behaviour_logprob.is_floating_point() \
                or tuple(behaviour_logprob.shape) != lead:
            raise SpecError("behaviour_logprob", f"must be a floating-point tensor of shape {lead}")
        check_device("behaviour_logprob", behaviour_logprob, response_mask)
        dt = stats.logp.dtype
        blr = stats.sampled_logprob.detach().to(dt) - behaviour_logprob.detach().to(dt)
        beh = Behaviour(torch.where(valid, blr, torch.zeros_like(blr)))
    checks = Checks() if spec.validate else None
    adv = _advantages(spec, advantages, lead, valid, checks, stats.logp.dtype)
    adv = adv.to(stats.logp.dtype)
    if checks is not None:
        if response_mask.dtype != torch.bool:
            checks.add("response_mask", "must hold only 0/1 (or bool) values",
                       ((response_mask != 0) & (response_mask != 1)).any())
        for name, w in weights.items():
            checks.add(name, "must be finite and >= 0 on response tokens", (~(torch.isfinite(w) & (w >= 0)) & valid).any())
        if beh is not None:
            checks.add("behaviour_logprob", "must be finite on response tokens",
                       (~torch.isfinite(beh.log_ratio) & valid).any())
        agg.check_values(checks)
        checks.run()
    stats = replace(stats, valid=valid)
    return _loss(spec, stats, torch.where(valid, adv, torch.zeros_like(adv)), agg, behaviour=beh, **weights)


def _weights(spec: PolicyLoss, lead, response_mask, dtype, **given) -> dict[str, torch.Tensor]:
    """``is_weights`` / ``loss_weights`` of :func:`loss_from_stats`, checked and detached."""
    mode = spec.mask_mode
    if given["is_weights"] is not None:
        if not SURROGATES[mode.surrogate].takes_is_weight and not spec.anchored:
            takers = [n for n, s in SURROGATES.items() if s.takes_is_weight]
            raise SpecError("is_weights", f"mode {mode.name!r} uses the {mode.surrogate} surrogate, whose ratio is "
                                          f"its weight; only the {', '.join(takers)} surrogates take an IS weight")
        if not spec.corrections.default_weight:
            raise SpecError("is_weights", "replaces the token IS weight min(r, is_cap), but the corrections compute "
                                          f"another weight ({spec.corrections}); give one of the two")
    out = {}
    for name, w in given.items():
        if w is None:
            continue
        if not isinstance(w, torch.Tensor) or not w.is_floating_point() or tuple(w.shape) != lead:
            got = f"a {w.dtype} tensor of shape {tuple(w.shape)}" if isinstance(w, torch.Tensor) else type(w).__name__
            raise SpecError(name, f"must be a floating-point tensor of shape {lead}, got {got}")
        check_device(name, w, response_mask)
        out[name] = w.detach().to(dtype)
    return out


def _loss(spec: PolicyLoss, stats: TokenStats, adv: torch.Tensor, agg: Aggregation, is_weights=None,
          loss_weights=None, behaviour: Behaviour | None = None) -> PolicyLossOutput:
    """Everything after the statistics, on checked inputs: the mode's mask, the corrections,
    the surrogate, the aggregation, the metrics (``adv`` 0 on padding). With ``behaviour``
    (anchor ``old``) the statistics are against pi_old and the corrections read pi_old/mu."""
    mode, th, corr_spec, valid = spec.mask_mode, spec.thresholds, spec.corrections, stats.valid
    sur = SURROGATES[mode.surrogate]
    res = decide(stats, adv, mode, spec.estimator, th)
    lead = tuple(valid.shape)
    seq = lead if len(lead) == 2 else (1, -1)  # (B, T); a flat batch is one sequence
    weight, ck, corr_metrics = None, torch.ones_like(valid), {}  # the default token TIS: the surrogate's own
    if behaviour is not None or corr_spec.active:
        corr_lr = stats.log_ratio if behaviour is None else behaviour.log_ratio
        corr = apply_corrections(corr_spec, corr_lr.reshape(seq), adv.reshape(seq), valid.reshape(seq),
                                 weighted=behaviour is not None or sur.takes_is_weight)
        weight = None if corr.weight is None else corr.weight.reshape(lead)
        ck, corr_metrics = corr.keep.reshape(lead), corr.metrics
    keep = res.keep & ck
    w_beh = None  # anchored: the detached behaviour weight w(pi_old / mu) on every surrogate
    if behaviour is not None:
        w_beh = is_weight(behaviour.log_ratio, corr_spec.is_cap) if weight is None else weight
        weight = None
    if is_weights is not None:  # replaces the default weight min(r, C) (checked in loss_from_stats)
        w_given = torch.where(valid, is_weights, torch.zeros_like(is_weights))
        keep = keep & (w_given > 0)  # a weight of 0 (verl's MIS) masks the token
        if behaviour is None:
            weight = w_given
        else:
            w_beh = w_given
    if w_beh is not None:
        w_beh = torch.where(valid, w_beh, torch.zeros_like(w_beh)).to(stats.logp.dtype)
        if sur.takes_is_weight:  # w(rho) clip(r', floor, C): anchor = mu gives today's weight
            weight = w_beh * ratio_weight(floor_neginf(stats.log_ratio), corr_spec)
    if sur.needs_weight:  # its smooth weight (a correction has none here: check_corrections)
        weight = res.weight
    per, keep_eff = _token_loss(stats.logp, stats.log_ratio, adv, keep, sur, corr_spec.is_cap, th.eps_low,
                                th.eps_high, weight, th.dual_clip, th.delta_low, th.delta_high, stats.sampled_logprob)
    if w_beh is not None and not sur.takes_is_weight:
        per = per * w_beh
    # A correction removes the token from the loss in every surrogate (ppo-clip keeps the
    # constant value of a clipped token, but a rejected one contributes nothing).
    per = torch.where(ck, per, torch.zeros_like(per))
    if loss_weights is not None:
        per = per * torch.where(valid, loss_weights, torch.zeros_like(loss_weights))
    keep_eff = keep_eff & ck
    loss = aggregate(per.reshape(seq), valid.reshape(seq), agg, validate=False)
    metrics = mask_metrics(res, keep_eff, stats, adv, valid)
    metrics.update(corr_metrics)
    if is_weights is not None and behaviour is None:
        metrics["is_weight_mean"] = masked_mean(weight, valid).detach()
        metrics["masked_frac_is"] = ((weight <= 0) & valid).sum().to(weight.dtype).div(valid.sum().clamp(min=1)).detach()
    if behaviour is not None:
        metrics.update(anchor_metrics(behaviour, w_beh, adv, valid, th.delta_low, th.delta_high))
    metrics["loss"] = loss.detach()
    return PolicyLossOutput(loss, metrics, per, keep_eff | ~valid, stats)


# ------------------------------------------------------------------ functions
def policy_loss(logits, rollout: Rollout, advantages, *, extras: Mapping[str, torch.Tensor] | None = None,
                anchor: Anchor | None = None, **spec) -> PolicyLossOutput:
    """Trust-region policy-gradient loss: ``PolicyLoss(**spec)(logits, rollout, advantages)``.

    ``logits``: (B, T, V) trainer logits (fp32/bf16/fp16/fp64), or :class:`pdmask.Hidden`;
    ``rollout``: :class:`pdmask.Rollout`; ``advantages``: (B, T) or (B,); ``extras``: per-token
    tensors a mode reads besides the statistics (:attr:`pdmask.MaskMode.extras`); ``anchor``:
    pi_old's log-probs (:class:`pdmask.Anchor`; with ``anchor="old"`` in the spec); ``**spec``: the
    fields of :class:`PolicyLoss`. Returns :class:`PolicyLossOutput` (``mask``: the final keep
    mask, mode and corrections). Naive equivalent (``pdm-topk-kl``, default corrections)::

        st = token_stats(logits, rollout); M = trust_region_mask(logits, rollout, A)
        loss = (-(M * st.ratio.clamp(max=5) * A * st.logp) * mask).sum() / mask.sum()
    """
    return PolicyLoss(**spec)(logits, rollout, advantages, extras=extras, anchor=anchor)


def policy_loss_from_hidden(hidden, lm_head_weight, rollout: Rollout, advantages, *, extras=None, anchor=None,
                            **spec) -> PolicyLossOutput:
    """:func:`policy_loss` of ``logits = hidden @ lm_head_weight.T`` without the (B, T, V)
    logits: ``hidden`` (B, T, H) final hidden states (after the last norm), ``lm_head_weight``
    (V, H) (no bias, no soft-capping); the logits exist one chunk of rows at a time, also in
    the backward, which gives gradients to both. ``rollout.logits`` is refused.
    Naive equivalent: ``policy_loss(hidden @ lm_head_weight.T, rollout, advantages, **spec)``."""
    return PolicyLoss(**spec)(ops.Hidden(hidden, lm_head_weight), rollout, advantages, extras=extras, anchor=anchor)


def trust_region_mask(logits, rollout: Rollout, advantages, *, extras=None, anchor=None, **spec) -> torch.Tensor:
    """The mode's keep mask (B, T) bool, False iff out of region and outward (padding True;
    arguments as :func:`policy_loss`). Naive, ``pdm-topk-kl``: ``st = token_stats(logits, rollout);
    M = ~((st.topk.topk_kl > where(A > 0, dh, dl)) & (A * st["ddot_topk_kl_exact"] > 0))``."""
    return PolicyLoss(**spec).mask(logits, rollout, advantages, extras=extras, anchor=anchor)
