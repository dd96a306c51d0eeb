"""Policy loss: per-token surrogate, masking and aggregation, composable.

DPPO-style surrogate for the divergence modes (METHOD.md section 2)::

    loss_t = - M_t * sg(min(r_t, C)) * A_t * log pi(k_t)

so ``d loss_t / d z = - M_t w_t A_t (e_k - pi) / T`` with ``w = min(r, C)`` detached.
The ``grpo`` mode uses the PPO clipped surrogate on the same ratio
``r = pi_k / mu_k`` (anchored to the rollout policy, not a recomputed old policy)::

    loss_t = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))
    loss_t = min(loss_t, -A C)   if A < 0   (dual clip, verl's clip_ratio_c = is_cap)

whose gradient is ``-A r (e_k - pi) / T`` on kept tokens and 0 on clipped ones. Every
exponentiated log-ratio is capped at ``exp(MAX_LOG_RATIO)`` (:data:`pdmask.stats.MAX_LOG_RATIO`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from . import ops
from ._validate import LOSS_AGGS, Batch, Checks, check_choice, check_count, check_device, prepare, prepare_rows
from .corrections import Corrections, apply_corrections, is_weight
from .divergences import floor_neginf, masked_mean
from .keys import BATCH_DDOT, ESTIMATORS
from .masks import MODES, SURROGATES, MaskMode, MaskResult, Thresholds, check_inputs_for, get_mode, mask_from_stats
from .ops import Compute, Sampling
from .rollout import Rollout
from .stats import MAX_LOG_RATIO, stats_from_batch, unflatten


# ------------------------------------------------------------------ aggregation
@dataclass(frozen=True)
class Aggregation:
    """How per-token losses reduce to a scalar (verl 0.9.1's modes; :func:`aggregate`).

    ``loss_agg``: ``token-mean``, ``seq-mean-token-mean``, ``seq-mean-token-sum``,
    ``seq-mean-token-sum-norm``. ``num_tokens`` / ``num_seqs`` replace the local
    denominators (global counts under data parallelism or gradient accumulation),
    ``loss_scale_factor`` the ``-norm`` mode's T; each None, a positive finite number or a
    one-element real tensor holding one (a tensor's value is checked with the call's data
    checks). Checked here, once.
    """

    loss_agg: str = "token-mean"
    num_tokens: object = None
    num_seqs: object = None
    loss_scale_factor: object = None

    def __post_init__(self) -> None:
        check_choice("loss_agg", self.loss_agg, LOSS_AGGS)
        for name in ("num_tokens", "num_seqs", "loss_scale_factor"):
            check_count(name, getattr(self, name))

    def check_values(self, checks: Checks) -> None:
        """The values of tensor denominators, into ``checks`` (no sync here)."""
        for name in ("num_tokens", "num_seqs", "loss_scale_factor"):
            check_count(name, getattr(self, name), checks)


def aggregate(
    token_values: torch.Tensor,  # (B, T)
    response_mask: torch.Tensor,  # (B, T)
    aggregation: Aggregation | None = None,
    *,
    validate: bool = True,
) -> torch.Tensor:
    """Reduce per-token values to a scalar with verl's aggregation modes.

    With ``m`` the mask, ``S_b = sum_t x_bt m_bt`` and ``n_b = sum_t m_bt``:

    - ``token-mean``: ``sum_b S_b / sum_b n_b`` (every token weighs the same; DAPO).
    - ``seq-mean-token-mean``: mean over sequences with ``n_b > 0`` of ``S_b / n_b``
      (original GRPO).
    - ``seq-mean-token-sum``: mean over sequences with ``n_b > 0`` of ``S_b``.
    - ``seq-mean-token-sum-norm``: ``seq-mean-token-sum / loss_scale_factor``, the
      factor defaulting to the padded length T (Dr. GRPO; set it to a constant such as
      the max response length so the scale does not move with the batch).

    ``aggregation`` (:class:`Aggregation`; None: token-mean) names the mode and the
    denominators; given ones are used as they are (a tensor's value is checked with a
    host sync unless ``validate=False``). Padding is excluded with ``where``, so NaN/inf in
    padded positions cannot leak. Empty batches give 0 (with the local counts).
    Naive torch (token-mean): ``(x * m).sum() / m.sum()``.
    """
    agg = Aggregation() if aggregation is None else aggregation
    if not isinstance(agg, Aggregation):
        raise ValueError(f"aggregation: must be a pdmask.Aggregation, got {type(agg).__name__}")
    if validate:
        checks = Checks()
        agg.check_values(checks)
        checks.run()
    num_tokens, num_seqs, loss_scale_factor = agg.num_tokens, agg.num_seqs, agg.loss_scale_factor
    if token_values.dim() == 1:
        token_values, response_mask = token_values[None], response_mask[None]
    m = response_mask.bool()
    x = torch.where(m, token_values, torch.zeros_like(token_values))
    if agg.loss_agg == "token-mean":
        den = _clamp1(m.sum(), x) if num_tokens is None else _given(num_tokens, x)
        return x.sum() / den
    n_b = m.sum(-1)
    seq_ok = n_b > 0
    den = _clamp1(seq_ok.sum(), x) if num_seqs is None else _given(num_seqs, x)
    if agg.loss_agg == "seq-mean-token-mean":
        per_seq = x.sum(-1) / n_b.clamp(min=1).to(x.dtype)
        return per_seq.sum() / den
    out = x.sum() / den
    if agg.loss_agg == "seq-mean-token-sum-norm":
        scale = token_values.shape[-1] if loss_scale_factor is None else loss_scale_factor
        out = out / scale
    return out


def _clamp1(den, like: torch.Tensor):
    if isinstance(den, torch.Tensor):
        return den.to(like.dtype).clamp(min=1)
    return max(float(den), 1.0)


def _given(den, like: torch.Tensor):
    """A user-given (checked, positive) denominator, used as it is."""
    if isinstance(den, torch.Tensor):
        return den.detach().reshape(()).to(like.dtype)
    return float(den)


# ------------------------------------------------------------------ per token
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token surrogate and the effective keep mask (the dual clip masks more).

    ``weight`` (N,) replaces the DPPO IS weight ``min(r, is_cap)`` (an off-policy
    correction's weight, :mod:`pdmask.corrections`); the ``ppo-clip`` surrogate takes none.
    Returns ``(loss_t, keep_eff)``; masked tokens contribute exactly 0 with gradient 0.
    """
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
        if weight is not None:
            raise ValueError("weight: the ppo-clip surrogate takes no separate IS weight (its ratio is the weight)")
        # r with value exp(log_ratio) and gradient r * grad(log pi_k)
        r = (logp - logp.detach() + log_ratio.detach()).clamp(max=MAX_LOG_RATIO).exp()
        per = torch.maximum(-adv * r, -adv * r.clamp(1 - eps_low, 1 + eps_high))
        dual = (adv < 0) & (r.detach() > is_cap)  # never true when is_cap is inf
        if math.isfinite(is_cap):
            per = torch.where(dual, -adv * is_cap, per)
        # Clipped tokens keep their (constant) PPO value; their gradient is 0.
        return per, keep & ~dual
    raise ValueError(f"surrogate: unknown value {surrogate!r}; valid values are: {', '.join(SURROGATES)}")


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
    batch: Batch  # flattened, sanitised inputs
    advantages: torch.Tensor  # (N,) 0 on padding
    stats: dict  # stats_from_batch output
    mask: MaskResult


def _spec(name: str, value, cls):
    """``value`` as an instance of ``cls`` (None: the default one); anything else is refused."""
    if value is None:
        return cls()
    if not isinstance(value, cls):
        raise ValueError(f"{name}: must be a pdmask.{cls.__name__} (or None), got {type(value).__name__}")
    return value


def advantage_limit(surrogate: str, is_cap: float, dtype: torch.dtype) -> float:
    """The largest ``sum |A|`` over the response tokens for which the loss cannot overflow
    ``dtype`` (the loss's dtype: float32 for half-precision logits).

    A token's loss is ``|A|`` times at most ``W`` (the IS weight's cap ``is_cap``, or
    ``exp(MAX_LOG_RATIO)`` without a cap and for the PPO ratio of ``ppo-clip``) times, in
    the DPPO surrogate, ``|log pi_k| <= |log tiny|`` (the floor of a probability the dtype
    represents); the aggregate is at most their sum. :func:`policy_loss` refuses larger
    advantages rather than return an inf/NaN loss."""
    fi = torch.finfo(dtype)
    cap = is_cap if math.isfinite(is_cap) else math.exp(MAX_LOG_RATIO)
    w, lp = (math.exp(MAX_LOG_RATIO), 1.0) if surrogate == "ppo-clip" else (cap, -math.log(fi.tiny))
    return fi.max / (w * lp)


def _check_advantage_scale(checks: Checks, adv, batch: Batch, surrogate: str, is_cap: float) -> None:
    x = batch.logits if batch.hidden is None else batch.hidden
    dtype = torch.promote_types(x.dtype, torch.float32)
    limit = advantage_limit(surrogate, is_cap, dtype)
    total = torch.where(batch.valid, adv.detach().double().abs(), torch.zeros((), dtype=torch.float64,
                                                                               device=adv.device)).sum()
    checks.add("advantages", f"sum of |A| over the response tokens exceeds {limit:.3g}, beyond which the "
               f"{str(dtype).removeprefix('torch.')} loss ({surrogate} surrogate, is_cap={is_cap:g}) could "
               "overflow to inf/NaN; scale the advantages down (normalise them)", total > limit)


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
        for name, cls in (("thresholds", Thresholds), ("corrections", Corrections), ("sampling", Sampling),
                          ("aggregation", Aggregation), ("compute", Compute)):
            object.__setattr__(self, name, _spec(name, getattr(self, name), cls))
        if not isinstance(self.validate, bool):
            raise ValueError(f"validate: expected True or False, got {self.validate!r}")
        object.__setattr__(self, "mask_mode", mode)
        object.__setattr__(self, "thresholds", self.thresholds.resolve(mode))
        self.corrections.check_surrogate(mode.surrogate)
        ops.check_truncation(self.compute.impl, self.sampling, None, None)

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
                _check_advantage_scale(checks, adv, batch, mode.surrogate, self.corrections.is_cap)
            if aggregation is not None:
                aggregation.check_values(checks)
            checks.run()
        adv = torch.where(batch.valid, adv, torch.zeros_like(adv))
        stats = stats_from_batch(batch, sampling=self.sampling, compute=compute, validate=self.validate)
        if ddot is not None:
            ddot = ddot.to(stats["log_ratio"].dtype)
            stats[BATCH_DDOT] = torch.where(batch.valid, ddot, torch.zeros_like(ddot))
        res = mask_from_stats(stats, adv, mode, estimator=self.estimator, thresholds=self.thresholds)
        return MaskedBatch(mode, self.thresholds, batch, adv, stats, res)

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
        return (mb.mask.keep | ~mb.batch.valid).reshape(mb.batch.lead_shape)

    def _loss(self, mb: MaskedBatch, agg: Aggregation) -> PolicyLossOutput:
        """Everything after the statistics and the token mask: corrections, surrogate, aggregation."""
        spec = self.corrections
        batch, adv, stats, res, th = mb.batch, mb.advantages, mb.stats, mb.mask, mb.thresholds
        lead = batch.lead_shape
        seq_shape = lead if len(lead) == 2 else (1, -1)  # (B, T); a flat batch is one sequence
        valid2 = batch.valid.reshape(seq_shape)
        corr = apply_corrections(spec, stats["log_ratio"].reshape(seq_shape), adv.reshape(seq_shape), valid2,
                                 surrogate=mb.mode.surrogate)
        weight = None if corr.weight is None else corr.weight.reshape(-1)
        ck = corr.keep.reshape(-1)
        per, keep_eff = token_loss(stats["logp"], stats["log_ratio"], adv, res.keep & ck,
                                   surrogate=mb.mode.surrogate, is_cap=spec.is_cap, eps_low=th.eps_low,
                                   eps_high=th.eps_high, weight=weight)
        # A correction removes the token from the loss in every surrogate (ppo-clip keeps the
        # constant value of a clipped token, but a rejected one contributes nothing).
        per = torch.where(ck, per, torch.zeros_like(per))
        keep_eff = keep_eff & ck
        per2 = per.reshape(seq_shape)
        loss = aggregate(per2, valid2, agg, validate=False)
        metrics = mask_metrics(res, keep_eff, stats, adv, batch.valid)
        metrics.update(corr.metrics)
        metrics["loss"] = loss.detach()
        return PolicyLossOutput(loss, metrics, per.reshape(lead), (keep_eff | ~batch.valid).reshape(lead),
                                unflatten(stats, lead))


def trust_region_mask(
    logits, rollout: Rollout, advantages, *, mode="pdm-topk-kl", estimator: str = "exact",
    thresholds: Thresholds | None = None, sampling: Sampling | None = None, batch_ddot=None,
    compute: Compute | None = None, validate: bool = True,
) -> torch.Tensor:
    """The keep mask ``M`` (B, T) bool of a mode: False iff out of region and outward.

    Same arguments as :func:`policy_loss` (the token mask only: the off-policy
    corrections are a later stage, in :func:`policy_loss`'s ``mask``). Padding positions
    are True (they carry no loss anyway). Naive equivalent for ``pdm-topk-kl``::

        st = token_stats(logits, rollout); D = st["topk_kl"]; Dd = st["ddot_topk_kl_exact"]
        M = ~((D > where(A > 0, delta_high, delta_low)) & (A * Dd > 0))
    """
    cfg = PolicyLoss(mode=mode, estimator=estimator, thresholds=thresholds, sampling=sampling, compute=compute,
                     validate=validate)
    return cfg.mask(logits, rollout, advantages, batch_ddot=batch_ddot)


def policy_loss(
    logits, rollout: Rollout, advantages, *, mode="pdm-topk-kl", estimator: str = "exact",
    thresholds: Thresholds | None = None, corrections: Corrections | None = None,
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
        thresholds: :class:`pdmask.Thresholds`: ``delta_low`` / ``delta_high`` for
            A < 0 / A > 0 (default: the mode's, 0.05 for KL, 0.15 for TV); ``eps_low`` /
            ``eps_high``, the ratio clip of ``grpo`` (clip-higher: eps_high = 0.28).
        corrections: :class:`pdmask.Corrections`, the off-policy corrections, a stage
            after the mode's token mask (:mod:`pdmask.corrections`, docs/corrections.md):
            the IS weight (``is_level``, ``[is_floor, is_cap]`` truncated or, with
            ``is_mask``, masked; ``is_cap`` is also ``grpo``'s dual-clip constant),
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
    cfg = PolicyLoss(mode=mode, estimator=estimator, thresholds=thresholds, corrections=corrections,
                     sampling=sampling, aggregation=aggregation, compute=compute, validate=validate)
    return cfg(logits, rollout, advantages, batch_ddot=batch_ddot)


def policy_loss_from_hidden(
    hidden, lm_head_weight, rollout: Rollout, advantages, *, mode="pdm-topk-kl", estimator: str = "exact",
    thresholds: Thresholds | None = None, corrections: Corrections | None = None,
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
    cfg = PolicyLoss(mode=mode, estimator=estimator, thresholds=thresholds, corrections=corrections,
                     sampling=sampling, aggregation=aggregation, compute=compute, validate=validate)
    return cfg.from_hidden(hidden, lm_head_weight, rollout, advantages, batch_ddot=batch_ddot)
