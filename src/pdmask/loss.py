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

from . import ops
from ._validate import (
    LOSS_AGGS, Batch, Checks, check_choice, check_chunk_size, check_count, check_device, check_positive, prepare,
)
from .keys import ESTIMATORS
from .masks import (
    SURROGATES, MaskMode, MaskResult, Thresholds, check_inputs_for, get_mode, mask_from_stats, resolve_thresholds,
)
from .keys import BATCH_DDOT
from .stats import MAX_LOG_RATIO, stats_from_batch, unflatten


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
def is_weight(log_ratio: torch.Tensor, is_cap: float) -> torch.Tensor:
    """The detached IS weight ``min(r, C)`` of the DPPO surrogate, ``C = is_cap`` (``inf``:
    no cap but :data:`~pdmask.stats.MAX_LOG_RATIO`). Naive: ``log_ratio.exp().clamp(max=C)``."""
    max_log_w = min(math.log(is_cap), MAX_LOG_RATIO) if math.isfinite(is_cap) else MAX_LOG_RATIO
    return log_ratio.detach().clamp(max=max_log_w).exp()


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token surrogate and the effective keep mask (the dual clip masks more).

    Returns ``(loss_t, keep_eff)``; masked tokens contribute exactly 0 with gradient 0.
    """
    adv = advantages.to(logp.dtype)
    # A sampled token the trainer gives probability exactly 0 (a -inf logit): its value is
    # floored so that 0 * inf cannot appear; its gradient is 0 (the logit cannot move).
    floor = math.log(torch.finfo(logp.dtype).tiny)
    logp = torch.where(torch.isneginf(logp), torch.full_like(logp, floor), logp)
    log_ratio = torch.where(torch.isneginf(log_ratio), torch.full_like(log_ratio, floor), log_ratio)
    if surrogate == "dppo":
        per = -is_weight(log_ratio, is_cap) * adv * logp
        return torch.where(keep, per, torch.zeros_like(per)), keep
    if surrogate == "ppo-clip":
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
    check_device("batch_ddot", batch_ddot, batch.logits)
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
                batch_ddot=None, counts: dict | None = None) -> MaskedBatch:
    # every scalar argument is checked before any work on the logits
    mode_obj: MaskMode = get_mode(mode)
    check_choice("estimator", estimator, ESTIMATORS)
    check_positive("temperature", temperature)
    check_chunk_size("chunk_size", chunk_size)
    ops.check_impl(impl)
    th = resolve_thresholds(mode_obj, delta_low, delta_high, eps_low, eps_high)
    check_inputs_for(mode_obj, rollout_topk_ids is not None, rollout_logits is not None, batch_ddot is not None)
    # every data check of the inputs goes into one Checks: one host sync before the logits are read
    checks = Checks() if validate else None
    batch = prepare(logits, sampled_ids, rollout_logprob, rollout_topk_ids, rollout_topk_logprobs,
                    response_mask, rollout_logits, validate, checks=checks)
    adv = broadcast_advantages(advantages, batch.lead_shape, logits).reshape(-1)
    ddot = None if batch_ddot is None else _batch_direction(batch_ddot, batch, checks)
    if checks is not None:
        checks.add("advantages", "contains NaN or inf on response tokens", (~torch.isfinite(adv) & batch.valid).any())
        for name, v in (counts or {}).items():
            check_count(name, v, checks)
        checks.run()
    adv = torch.where(batch.valid, adv, torch.zeros_like(adv))
    stats = stats_from_batch(batch, temperature=temperature, chunk_rows=chunk_size, impl=impl,
                             validate=validate)
    if ddot is not None:
        ddot = ddot.to(stats["log_ratio"].dtype)
        stats[BATCH_DDOT] = torch.where(batch.valid, ddot, torch.zeros_like(ddot))
    res = mask_from_stats(stats, adv, mode_obj, estimator=estimator, thresholds=th)
    return MaskedBatch(mode_obj, th, batch, adv, stats, res)


def trust_region_mask(
    logits, sampled_ids, rollout_logprob, rollout_topk_ids, rollout_topk_logprobs, advantages,
    response_mask=None, *, mode: str = "pdm-topk-kl", estimator: str = "exact",
    delta_low: float | None = None, delta_high: float | None = None,
    eps_low: float = 0.2, eps_high: float = 0.2, temperature: float = 1.0,
    rollout_logits=None, chunk_size: int | None = None, validate: bool = True,
    impl: str = "auto", batch_ddot=None,
) -> torch.Tensor:
    """The keep mask ``M`` (B, T) bool of a mode: False iff out of region and outward.

    Same arguments as :func:`policy_loss`. Padding positions are True (they carry no
    loss anyway). Naive equivalent for ``pdm-topk-kl``::

        D = token_stats(...)["topk_kl"]; Dd = token_stats(...)["ddot_topk_kl_exact"]
        M = ~((D > where(A > 0, delta_high, delta_low)) & (A * Dd > 0))
    """
    mb = _mask_batch(
        logits, sampled_ids, rollout_logprob, rollout_topk_ids, rollout_topk_logprobs, advantages,
        response_mask, mode=mode, estimator=estimator, delta_low=delta_low, delta_high=delta_high,
        eps_low=eps_low, eps_high=eps_high, temperature=temperature, rollout_logits=rollout_logits,
        chunk_size=chunk_size, validate=validate, impl=impl, batch_ddot=batch_ddot)
    return (mb.mask.keep | ~mb.batch.valid).reshape(mb.batch.lead_shape)


def policy_loss(
    logits, sampled_ids, rollout_logprob, rollout_topk_ids, rollout_topk_logprobs, advantages,
    response_mask, *, mode: str = "pdm-topk-kl", estimator: str = "exact",
    delta_low: float | None = None, delta_high: float | None = None,
    eps_low: float = 0.2, eps_high: float = 0.2, is_cap: float = 5.0,
    loss_agg: str = "token-mean", temperature: float = 1.0, rollout_logits=None,
    chunk_size: int | None = None, num_tokens=None, num_seqs=None, loss_scale_factor=None,
    validate: bool = True, impl: str = "auto", batch_ddot=None,
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
            dual-clip constant.
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

    Returns:
        :class:`PolicyLossOutput` with ``loss`` and ``metrics`` (detached tensors).
    """
    check_positive("is_cap", is_cap, allow_inf=True)
    check_choice("loss_agg", loss_agg, LOSS_AGGS)
    counts = {"num_tokens": num_tokens, "num_seqs": num_seqs, "loss_scale_factor": loss_scale_factor}
    for name, v in counts.items():
        check_count(name, v)  # numbers now; a tensor's value with the other data checks
    mb = _mask_batch(
        logits, sampled_ids, rollout_logprob, rollout_topk_ids, rollout_topk_logprobs, advantages,
        response_mask, mode=mode, estimator=estimator, delta_low=delta_low, delta_high=delta_high,
        eps_low=eps_low, eps_high=eps_high, temperature=temperature, rollout_logits=rollout_logits,
        chunk_size=chunk_size, validate=validate, impl=impl, batch_ddot=batch_ddot, counts=counts)
    batch, adv, stats, res, th = mb.batch, mb.advantages, mb.stats, mb.mask, mb.thresholds
    per, keep_eff = token_loss(stats["logp"], stats["log_ratio"], adv, res.keep, surrogate=mb.mode.surrogate,
                               is_cap=is_cap, eps_low=th.eps_low, eps_high=th.eps_high)
    lead = batch.lead_shape
    per2 = per.reshape(lead) if len(lead) == 2 else per.reshape(1, -1)
    valid2 = batch.valid.reshape(per2.shape)
    loss = aggregate(per2, valid2, loss_agg, num_tokens=num_tokens, num_seqs=num_seqs,
                     loss_scale_factor=loss_scale_factor, validate=False)
    metrics = mask_metrics(res, keep_eff, stats, adv, batch.valid)
    metrics["loss"] = loss.detach()
    return PolicyLossOutput(loss, metrics, per.reshape(lead), (keep_eff | ~batch.valid).reshape(lead),
                            unflatten(stats, lead))
