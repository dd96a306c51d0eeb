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
from dataclasses import dataclass

import torch

from ._validate import (
    LOSS_AGGS, Batch, Checks, check_choice, check_chunk_size, check_count, check_device, check_positive, prepare,
    prepare_rows,
)
from .keys import ESTIMATORS
from .masks import (
    MODES, SURROGATES, MaskMode, MaskResult, Thresholds, check_inputs_for, get_mode, mask_from_stats, resolve_thresholds,
)
from .keys import BATCH_DDOT
from .corrections import apply_corrections, check_corrections, is_weight
from .stats import MAX_LOG_RATIO, check_truncation, stats_from_batch, unflatten


# ------------------------------------------------------------------ aggregation
def aggregate(
    token_values: torch.Tensor,  # (B, T)
    response_mask: torch.Tensor,  # (B, T)
    loss_agg: str = "token-mean",
    *,
    num_tokens=None,
    num_seqs=None,
    loss_scale_factor=None,
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

    ``num_tokens`` / ``num_seqs`` replace the local denominators (e.g. global counts
    under data parallelism or gradient accumulation); given, they are used as they are
    and must be positive finite numbers (or one-element tensors holding one; their value
    is checked with a host sync unless ``validate=False``), as must ``loss_scale_factor``.
    Padding is excluded with ``where``, so NaN/inf in padded positions cannot leak. Empty
    batches give 0 (with the local counts).
    """
    check_choice("loss_agg", loss_agg, LOSS_AGGS)
    checks = Checks() if validate else None
    for name, v in (("num_tokens", num_tokens), ("num_seqs", num_seqs), ("loss_scale_factor", loss_scale_factor)):
        check_count(name, v, checks)
    if checks is not None:
        checks.run()
    if token_values.dim() == 1:
        token_values, response_mask = token_values[None], response_mask[None]
    m = response_mask.bool()
    x = torch.where(m, token_values, torch.zeros_like(token_values))
    if loss_agg == "token-mean":
        den = _clamp1(m.sum(), x) if num_tokens is None else _given(num_tokens, x)
        return x.sum() / den
    n_b = m.sum(-1)
    seq_ok = n_b > 0
    den = _clamp1(seq_ok.sum(), x) if num_seqs is None else _given(num_seqs, x)
    if loss_agg == "seq-mean-token-mean":
        per_seq = x.sum(-1) / n_b.clamp(min=1).to(x.dtype)
        return per_seq.sum() / den
    out = x.sum() / den
    if loss_agg == "seq-mean-token-sum-norm":
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


def _masked_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    x = torch.where(m, x, torch.zeros_like(x))
    return x.sum() / m.sum().clamp(min=1)


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
    floor = math.log(torch.finfo(logp.dtype).tiny)
    logp = torch.where(torch.isneginf(logp), torch.full_like(logp, floor), logp)
    log_ratio = torch.where(torch.isneginf(log_ratio), torch.full_like(log_ratio, floor), log_ratio)
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
        "divergence_mean": _masked_mean(res.divergence, v),
        "divergence_max": torch.where(v, res.divergence, torch.zeros_like(res.divergence)).max()
        if res.divergence.numel() else res.divergence.new_zeros(()),
        "ratio_mean": _masked_mean(stats["ratio"], v),
        "entropy_mean": _masked_mean(stats["entropy"], v),
    }
    if "rollout_tail_mass" in stats:
        m["rollout_tail_mass_mean"] = _masked_mean(stats["rollout_tail_mass"], v)
        m["tail_clamped_frac"] = (stats["tail_clamped"] & v).sum() / n
    if "kept_mass" in stats:  # truncated sampling
        m["policy_kept_mass_mean"] = _masked_mean(stats["kept_mass"], v)
        m["kept_size_mean"] = _masked_mean(stats["kept_size"], v)
        m["kept_set_sampled_outside_frac"] = (stats["sampled_outside"] & v).sum() / n
        if "kept_topk_mismatch" in stats:
            m["kept_set_topk_mismatch_frac"] = _masked_mean(stats["kept_topk_mismatch"], v)
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


def _mask_batch(logits, sampled_ids, rollout_logprob, rollout_topk_ids, rollout_topk_logprobs,
                advantages, response_mask, *, mode, estimator, delta_low, delta_high, eps_low,
                eps_high, temperature, rollout_logits, chunk_size, validate, impl="auto",
                batch_ddot=None, sampling_top_k=None, sampling_top_p=None, sampling_min_p=None,
                rollout_kept_mask=None, hidden=None, lm_head_weight=None, chunk_cols=None,
                counts: dict | None = None, loss_is_cap: float | None = None) -> MaskedBatch:
    # every scalar argument is checked before any work on the logits
    mode_obj: MaskMode = get_mode(mode)
    check_choice("estimator", estimator, ESTIMATORS)
    check_positive("temperature", temperature)
    check_chunk_size("chunk_size", chunk_size)
    check_chunk_size("chunk_cols", chunk_cols, "vocabulary columns per chunk")
    sampling = check_truncation(impl, sampling_top_k, sampling_top_p, sampling_min_p, rollout_kept_mask,
                                rollout_logits)
    th = resolve_thresholds(mode_obj, delta_low, delta_high, eps_low, eps_high)
    check_inputs_for(mode_obj, rollout_topk_ids is not None, rollout_logits is not None, batch_ddot is not None)
    # every data check of the inputs goes into one Checks: one host sync before the logits are read
    checks = Checks() if validate else None
    if hidden is None:
        batch = prepare(logits, sampled_ids, rollout_logprob, rollout_topk_ids, rollout_topk_logprobs,
                        response_mask, rollout_logits, validate, rollout_kept_mask, checks=checks)
    else:
        _check_hidden(hidden, lm_head_weight)
        if checks is not None:  # else a bad weight shows only as non-finite rows of `hidden`
            checks.add("lm_head_weight", "contains NaN or inf", ~torch.isfinite(lm_head_weight).all())
        batch = prepare_rows(tuple(hidden.shape[:-1]), lm_head_weight.shape[0], hidden.device, sampled_ids,
                             rollout_logprob, rollout_topk_ids, rollout_topk_logprobs, response_mask, None,
                             validate, rollout_kept_mask, checks=checks)
        batch.hidden, batch.lm_head_weight = hidden.reshape(-1, hidden.shape[-1]), lm_head_weight
    adv = broadcast_advantages(advantages, batch.lead_shape, batch.valid).reshape(-1)
    ddot = None if batch_ddot is None else _batch_direction(batch_ddot, batch, checks)
    if checks is not None:
        checks.add("advantages", "contains NaN or inf on response tokens", (~torch.isfinite(adv) & batch.valid).any())
        if loss_is_cap is not None:  # a loss follows (the mask alone reads only the sign of A)
            _check_advantage_scale(checks, adv, batch, mode_obj.surrogate, loss_is_cap)
        for name, v in (counts or {}).items():
            check_count(name, v, checks)
        checks.run()
    adv = torch.where(batch.valid, adv, torch.zeros_like(adv))
    stats = stats_from_batch(batch, temperature=temperature, chunk_rows=chunk_size, impl=impl,
                             validate=validate, sampling=sampling, chunk_cols=chunk_cols)
    if ddot is not None:
        ddot = ddot.to(stats["log_ratio"].dtype)
        stats[BATCH_DDOT] = torch.where(batch.valid, ddot, torch.zeros_like(ddot))
    res = mask_from_stats(stats, adv, mode_obj, estimator=estimator, thresholds=th)
    return MaskedBatch(mode_obj, th, batch, adv, stats, res)


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


def _check_counts(**counts) -> dict:
    """The user-given denominators, checked now when numbers (a tensor's value is checked
    with the other data checks, in the one host sync of :func:`_mask_batch`)."""
    for name, v in counts.items():
        check_count(name, v)
    return counts


def _check_hidden(hidden, weight) -> None:
    if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point() or hidden.dim() < 2:
        raise ValueError("hidden: expected a floating-point (B, T, H) or (N, H) tensor, got "
                         f"{getattr(hidden, 'dtype', type(hidden).__name__)} {tuple(getattr(hidden, 'shape', ()))}")
    H = hidden.shape[-1]
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.dim() != 2 \
            or weight.shape[1] != H or weight.shape[0] < 1:
        raise ValueError(f"lm_head_weight: expected a floating-point (V, {H}) tensor (H of hidden), got "
                         f"{getattr(weight, 'dtype', type(weight).__name__)} {tuple(getattr(weight, 'shape', ()))}")
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise ValueError(f"lm_head_weight: must have the dtype and device of hidden ({hidden.dtype}, "
                         f"{hidden.device}), got {weight.dtype}, {weight.device}")


def trust_region_mask(
    logits, sampled_ids, rollout_logprob, rollout_topk_ids, rollout_topk_logprobs, advantages,
    response_mask=None, *, mode: str = "pdm-topk-kl", estimator: str = "exact",
    delta_low: float | None = None, delta_high: float | None = None,
    eps_low: float = 0.2, eps_high: float = 0.2, temperature: float = 1.0,
    rollout_logits=None, chunk_size: int | None = None, validate: bool = True,
    impl: str = "auto", batch_ddot=None, sampling_top_k: int | None = None, sampling_top_p: float | None = None,
    sampling_min_p: float | None = None, rollout_kept_mask=None,
) -> torch.Tensor:
    """The keep mask ``M`` (B, T) bool of a mode: False iff out of region and outward.

    Same arguments as :func:`policy_loss` (the token mask only: the off-policy
    corrections are a later stage, in :func:`policy_loss`'s ``mask``). Padding positions
    are True (they carry no loss anyway). Naive equivalent for ``pdm-topk-kl``::

        D = token_stats(...)["topk_kl"]; Dd = token_stats(...)["ddot_topk_kl_exact"]
        M = ~((D > where(A > 0, delta_high, delta_low)) & (A * Dd > 0))
    """
    mb = _mask_batch(
        logits, sampled_ids, rollout_logprob, rollout_topk_ids, rollout_topk_logprobs, advantages,
        response_mask, mode=mode, estimator=estimator, delta_low=delta_low, delta_high=delta_high,
        eps_low=eps_low, eps_high=eps_high, temperature=temperature, rollout_logits=rollout_logits,
        chunk_size=chunk_size, validate=validate, impl=impl, batch_ddot=batch_ddot, sampling_top_k=sampling_top_k,
        sampling_top_p=sampling_top_p, sampling_min_p=sampling_min_p, rollout_kept_mask=rollout_kept_mask)
    return (mb.mask.keep | ~mb.batch.valid).reshape(mb.batch.lead_shape)


def _check_loss_args(mode, loss_agg, *, num_tokens, num_seqs, loss_scale_factor, **corrections):
    """The loss entries' shared checks, before any tensor is read: the aggregation, the
    normalisers and the corrections (against the mode's surrogate)."""
    check_choice("loss_agg", loss_agg, LOSS_AGGS)
    counts = _check_counts(num_tokens=num_tokens, num_seqs=num_seqs, loss_scale_factor=loss_scale_factor)
    return counts, check_corrections(**corrections, surrogate=get_mode(mode).surrogate)


def policy_loss(
    logits, sampled_ids, rollout_logprob, rollout_topk_ids, rollout_topk_logprobs, advantages,
    response_mask, *, mode: str = "pdm-topk-kl", estimator: str = "exact",
    delta_low: float | None = None, delta_high: float | None = None,
    eps_low: float = 0.2, eps_high: float = 0.2, is_cap: float = 5.0,
    loss_agg: str = "token-mean", temperature: float = 1.0, rollout_logits=None,
    chunk_size: int | None = None, num_tokens=None, num_seqs=None, loss_scale_factor=None,
    validate: bool = True, impl: str = "auto", batch_ddot=None,
    is_level: str | None = "token", is_floor: float | None = None, is_mask: bool = False,
    is_batch_normalize: bool = False, rejection=None, rejection_threshold=None,
    off_policy_mask_threshold: float | None = None,
    sampling_top_k: int | None = None, sampling_top_p: float | None = None, sampling_min_p: float | None = None,
    rollout_kept_mask=None,
) -> PolicyLossOutput:
    """Trust-region policy-gradient loss with a named mask mode.

    Args:
        logits: (B, T, V) trainer logits at the response positions (fp32/bf16/fp16/fp64).
        sampled_ids: (B, T) token ids the rollout engine sampled.
        rollout_logprob: (B, T) engine log-prob of the sampled token (at ``temperature``).
        rollout_topk_ids, rollout_topk_logprobs: (B, T, K) engine top-K of the sampling
            distribution, or None for modes that do not need them.
        advantages: (B, T) or (B,).
        response_mask: (B, T) bool/0-1, True on response tokens.
        mode: a name in :data:`pdmask.MODES` (``grpo``, ``none``, ``dppo-*``, ``pdm-*``).
        estimator: top-K tail estimator for ``Ddot``: ``exact`` (default), ``aggregated``
            (the paper), ``uniform``, ``truncated``.
        delta_low, delta_high: divergence thresholds for A < 0 / A > 0 (default: the
            mode's, 0.05 for KL, 0.15 for TV).
        eps_low, eps_high: ratio clip for ``grpo`` (clip-higher: eps_high = 0.28).
        is_cap: IS-weight cap C in ``min(r, C)`` (``inf`` disables); in ``grpo`` the
            dual-clip constant. The upper bound of every IS weight (verl
            ``rollout_is_threshold``, TRL ``vllm_importance_sampling_clip_max``).
        loss_agg: ``token-mean``, ``seq-mean-token-mean``, ``seq-mean-token-sum``,
            ``seq-mean-token-sum-norm`` (see :func:`aggregate`).
        temperature: the sampling temperature; ``pi = softmax(logits / temperature)``.
        rollout_logits: (B, T, V) rollout policy's full logits for the ``*-full-*`` modes.
        chunk_size: rows per chunk of the vocabulary reductions.
        num_tokens, num_seqs, loss_scale_factor: global denominators for :func:`aggregate`.
        validate: check inputs (one host sync); turn off on a trusted hot path.
        impl: row-reduction implementation (:func:`pdmask.ops.row_stats`): ``"auto"``
            (default: Triton for CUDA logits when installed, else the chunked torch
            path), ``"torch"``, ``"triton"``, ``"reference"`` (the plain oracle).
        batch_ddot: (B, T) externally computed direction ``<grad log pi_t, P grad Phi>``
            of the batch-aware modes ``pdm-batch-*`` (:func:`pdmask.batchmask.batch_mask`,
            its ``.ddot``); stored in the stats as ``ddot_batch`` (in any mode, for logging).
        is_level, is_floor, is_mask, is_batch_normalize, rejection, rejection_threshold,
            off_policy_mask_threshold: the off-policy corrections, a stage after the
            mode's token mask (:mod:`pdmask.corrections`, docs/corrections.md):
            ``is_level`` ``"token"`` (default) / ``"sequence"`` / None (verl
            ``rollout_is``); ``[is_floor, is_cap]`` truncate the weight (TIS) or, with
            ``is_mask``, mask outside (MIS, IcePop); ``rejection`` rules with verl's
            ``rollout_rs`` names and ``rejection_threshold`` syntax; DeepSeek-V3.2's
            off-policy sequence mask at ``off_policy_mask_threshold`` (TRL's name).
        sampling_top_k, sampling_top_p, sampling_min_p: the engine's truncated sampling
            (vLLM's names and order; 0 / -1, 1 and 0 mean off). ``rollout_logprob`` and
            the top-K must then be the engine's processed (renormalised) log-probs, and
            ``pi`` is renormalised over the kept set rebuilt on these logits (plus the
            sampled token); metrics ``policy_kept_mass_mean`` (``pi(S)``, the bias an
            uncorrected ratio would carry), ``kept_size_mean``,
            ``kept_set_sampled_outside_frac`` and ``kept_set_topk_mismatch_frac`` (the
            trainer's set against what the engine reports). docs/corrections.md.
        rollout_kept_mask: (B, T, V) bool, the engine's own kept set, instead of the
            parameters.

    Returns:
        :class:`PolicyLossOutput` with ``loss`` and ``metrics`` (detached tensors); ``mask``
        is the final keep mask (mode and corrections).
    """
    counts, spec = _check_loss_args(
        mode, loss_agg, num_tokens=num_tokens, num_seqs=num_seqs, loss_scale_factor=loss_scale_factor,
        is_level=is_level, is_cap=is_cap, is_floor=is_floor, is_mask=is_mask, is_batch_normalize=is_batch_normalize,
        rejection=rejection, rejection_threshold=rejection_threshold,
        off_policy_mask_threshold=off_policy_mask_threshold)
    mb = _mask_batch(
        logits, sampled_ids, rollout_logprob, rollout_topk_ids, rollout_topk_logprobs, advantages,
        response_mask, mode=mode, estimator=estimator, delta_low=delta_low, delta_high=delta_high,
        eps_low=eps_low, eps_high=eps_high, temperature=temperature, rollout_logits=rollout_logits,
        chunk_size=chunk_size, validate=validate, impl=impl, batch_ddot=batch_ddot, sampling_top_k=sampling_top_k,
        sampling_top_p=sampling_top_p, sampling_min_p=sampling_min_p, rollout_kept_mask=rollout_kept_mask,
        counts=counts, loss_is_cap=spec.is_cap)
    return _loss(mb, spec, loss_agg=loss_agg, num_tokens=num_tokens, num_seqs=num_seqs,
                 loss_scale_factor=loss_scale_factor)


def policy_loss_from_hidden(
    hidden, lm_head_weight, sampled_ids, rollout_logprob, rollout_topk_ids, rollout_topk_logprobs, advantages,
    response_mask, *, mode: str = "pdm-topk-kl", estimator: str = "exact",
    delta_low: float | None = None, delta_high: float | None = None,
    eps_low: float = 0.2, eps_high: float = 0.2, is_cap: float = 5.0,
    loss_agg: str = "token-mean", temperature: float = 1.0,
    chunk_cols: int | None = None, chunk_rows: int | None = None, num_tokens=None, num_seqs=None,
    loss_scale_factor=None, validate: bool = True, batch_ddot=None,
    is_level: str | None = "token", is_floor: float | None = None, is_mask: bool = False,
    is_batch_normalize: bool = False, rejection=None, rejection_threshold=None,
    off_policy_mask_threshold: float | None = None,
    sampling_top_k: int | None = None, sampling_top_p: float | None = None, sampling_min_p: float | None = None,
    rollout_kept_mask=None,
) -> PolicyLossOutput:
    """:func:`policy_loss` of ``logits = hidden @ lm_head_weight.T`` without the logits.

    The statistics come from :func:`pdmask.ops.hidden_row_stats`, which walks the
    vocabulary in ``chunk_cols`` column chunks (rows in ``chunk_rows`` chunks under
    truncated sampling), so no (N, V) tensor exists; ``loss.backward()`` gives gradients
    to ``hidden`` and to ``lm_head_weight``. Everything after the statistics (mask,
    corrections, surrogate, aggregation, metrics) is :func:`policy_loss`'s own code.

    Args:
        hidden: (B, T, H) final hidden states at the response positions (after the last
            norm: what the LM head multiplies).
        lm_head_weight: (V, H) the LM-head weight (same dtype and device). No bias, no
            logit soft-capping.
        chunk_cols, chunk_rows: vocabulary columns / rows per chunk (None: 4 M logits).
        Everything else: as :func:`policy_loss`. Not available: ``rollout_logits`` (the
        ``*-full-*`` modes are refused, naming the modes that work) and ``impl`` (this path
        is plain torch). A non-finite ``lm_head_weight`` is refused naming it.

    Naive equivalent: ``policy_loss(hidden @ lm_head_weight.T, sampled_ids, ...)``.
    """
    _refuse_full_modes(mode)
    counts, spec = _check_loss_args(
        mode, loss_agg, num_tokens=num_tokens, num_seqs=num_seqs, loss_scale_factor=loss_scale_factor,
        is_level=is_level, is_cap=is_cap, is_floor=is_floor, is_mask=is_mask, is_batch_normalize=is_batch_normalize,
        rejection=rejection, rejection_threshold=rejection_threshold,
        off_policy_mask_threshold=off_policy_mask_threshold)
    mb = _mask_batch(
        None, sampled_ids, rollout_logprob, rollout_topk_ids, rollout_topk_logprobs, advantages,
        response_mask, mode=mode, estimator=estimator, delta_low=delta_low, delta_high=delta_high,
        eps_low=eps_low, eps_high=eps_high, temperature=temperature, rollout_logits=None,
        chunk_size=chunk_rows, validate=validate, impl="torch", batch_ddot=batch_ddot, sampling_top_k=sampling_top_k,
        sampling_top_p=sampling_top_p, sampling_min_p=sampling_min_p, rollout_kept_mask=rollout_kept_mask,
        hidden=hidden, lm_head_weight=lm_head_weight, chunk_cols=chunk_cols, counts=counts,
        loss_is_cap=spec.is_cap)
    return _loss(mb, spec, loss_agg=loss_agg, num_tokens=num_tokens, num_seqs=num_seqs,
                 loss_scale_factor=loss_scale_factor)


def _refuse_full_modes(mode) -> None:
    """The ``*-full-*`` modes need the rollout's full logits, which the hidden path does not take."""
    m = get_mode(mode)
    if "full" in m.needs:
        works = [name for name, mm in MODES.items() if "full" not in mm.needs]
        raise ValueError(f"mode: {m.name!r} needs the rollout policy's full logits, and policy_loss_from_hidden "
                         "has none (it takes no rollout_logits); use policy_loss(..., rollout_logits=...) for it, "
                         f"or one of the modes that work here: {', '.join(works)}")


def _loss(mb: MaskedBatch, spec, *, loss_agg, num_tokens, num_seqs, loss_scale_factor) -> PolicyLossOutput:
    """Everything after the statistics and the token mask: corrections, surrogate, aggregation."""
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
    loss = aggregate(per2, valid2, loss_agg, num_tokens=num_tokens, num_seqs=num_seqs,
                     loss_scale_factor=loss_scale_factor, validate=False)
    metrics = mask_metrics(res, keep_eff, stats, adv, batch.valid)
    metrics.update(corr.metrics)
    metrics["loss"] = loss.detach()
    return PolicyLossOutput(loss, metrics, per.reshape(lead), (keep_eff | ~batch.valid).reshape(lead),
                            unflatten(stats, lead))
