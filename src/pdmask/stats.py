"""Per-token statistics: the (N,) / (N, K) quantities every mask and loss reads.

The vocabulary reductions (log-sum-exp, ``log pi_k``, ``sum pi^2``, the entropy, log pi at
the rollout's top-K ids; with the rollout's full logits the full-vocabulary terms) come
from one call of :func:`pdmask.ops.row_stats`, the only code that reads the (N, V)
logits. This module turns them into the divergences (:mod:`pdmask.divergences`) and the
direction derivatives (:mod:`pdmask.directions`) under the stat keys of
:mod:`pdmask.keys`; it touches no (N, V) tensor itself.

Naive torch equivalent of :func:`stats_from_batch` (binary part)::

    logq = torch.log_softmax(logits.float() / T, -1)               # (N, V)
    logp = logq.gather(1, k[:, None])[:, 0]; sum_p2 = logq.exp().pow(2).sum(-1)
    binary_stats(logp, sampled_logprob, sum_p2)
"""

from __future__ import annotations

import math

import torch

from . import directions as dirs
from . import divergences as divs
from . import ops
from ._validate import Batch, Checks, check_choice, prepare
from .keys import ESTIMATORS, SUPPORTS, ddot_key
from .rollout import Rollout

#: Cap on every exponentiated log-ratio: ``r = exp(min(log r, MAX_LOG_RATIO))`` in the
#: ``ratio`` statistic, the IS weight ``min(r, C)`` and the PPO ratio of the loss
#: (exp(50) ~ 5e21: finite in float32 even times an advantage and a floored log pi_k).
MAX_LOG_RATIO = 50.0


def capped_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """``r = exp(min(log r, MAX_LOG_RATIO))``."""
    return log_ratio.clamp(max=MAX_LOG_RATIO).exp()


def binary_stats(logp: torch.Tensor, sampled_logprob: torch.Tensor, sum_p2: torch.Tensor) -> dict[str, torch.Tensor]:
    """The statistics of the sampled token alone, from (N,) ``log pi_k``, ``log mu_k`` and
    ``sum_i pi_i^2`` (detached inputs): ``log_ratio``, ``ratio`` (capped, see
    :data:`MAX_LOG_RATIO`), ``binary_tv``, ``binary_kl``, ``ddot_binary_tv``,
    ``ddot_binary_kl``.

    Naive torch: ``log_ratio = logp - sampled_logprob``; ``binary_tv = |exp(logp) -
    exp(sampled_logprob)|``; the rest in :mod:`pdmask.divergences` / :mod:`pdmask.directions`.
    """
    log_ratio = dirs.log_ratio(logp, sampled_logprob)
    return {
        "log_ratio": log_ratio,
        "ratio": capped_ratio(log_ratio),
        "binary_tv": divs.binary_tv(logp, sampled_logprob),
        "binary_kl": divs.binary_kl(logp, sampled_logprob),
        ddot_key("binary_tv"): dirs.ddot_binary_tv(logp, sampled_logprob, sum_p2),
        ddot_key("binary_kl"): dirs.ddot_binary_kl(logp, sampled_logprob, sum_p2),
    }


def _sanitise_padding(red: dict[str, torch.Tensor], valid: torch.Tensor, V: int) -> dict[str, torch.Tensor]:
    """The reductions with padding rows replaced by those of a uniform pi = mu.

    Padding logits may hold anything (NaN, inf): their statistics are junk, and a NaN
    there would reach the gradient through a multiplication by zero. ``where`` cuts both
    the value and the gradient path (the op's backward then sees a zero upstream gradient
    on those rows and writes zeros there, whatever the logits hold). (N,) work only."""
    if not valid.is_cuda and bool(valid.all()):
        return red  # CPU without padding: nothing to replace (the test is free on CPU)
    logv = math.log(V)
    # (lse_tail, sum_p2_tail: finite stand-ins; padding rows are never read beyond this)
    fill = {"lse": 0.0, "logp": -logv, "sum_p2": 1.0 / V, "entropy": logv, "topk_logp": -logv,
            "lse_tail": -logv, "sum_p2_tail": 0.0,
            "full_kl": 0.0, "full_tv": 0.0, "full_mu_k": 1.0 / V, "sum_p_mu": 1.0 / V, "sum_p_s": 0.0,
            "sum_p2_s": 0.0, "kept_mass": 1.0, "kept_size": V, "sampled_outside": 0, "kept_topk_mismatch": 0}
    out = {}
    for k, x in red.items():
        m = valid if x.dim() == 1 else valid[:, None]
        out[k] = torch.where(m, x, torch.full_like(x, fill[k])) if k in fill else x
    return out


def stats_from_batch(
    batch: Batch, *, sampling: ops.Sampling, compute: ops.Compute, validate: bool = True,
    support: str = "topk+sampled",
) -> dict[str, torch.Tensor]:
    """All per-token statistics on flattened (N,) rows; ``logp`` carries the gradient.

    ``support`` (:data:`pdmask.keys.SUPPORTS`, checked by the caller): the support of the
    top-K divergences, ``topK ∪ {k}`` or the top-K alone (:func:`pdmask.divergences.build_support`).

    ``compute`` (:class:`pdmask.ops.Compute`: ``impl``, ``chunk_rows``, ``chunk_cols``) is
    passed to :mod:`pdmask.ops`; ``"auto"`` never needs Triton on CPU. ``sampling`` gives
    the temperature; its truncation (or ``batch.kept_mask``) makes every statistic that
    of pi renormalised over the kept set and adds ``kept_mass``, ``kept_size``,
    ``sampled_outside`` (and, with top-K, ``kept_topk_mismatch``). A batch with ``hidden``
    states goes to :func:`pdmask.ops.hidden_row_stats`.
    """
    trunc = sampling if sampling.truncated else None
    T = sampling.temperature
    if batch.hidden is not None:
        red = ops.hidden_row_stats(batch.hidden, batch.lm_head_weight, batch.sampled_ids, batch.topk_ids,
                                   temperature=T, chunk_cols=compute.chunk_cols, chunk_rows=compute.chunk_rows,
                                   validate=False, kept_mask=batch.kept_mask, truncation=trunc)
    else:
        red = ops.row_stats(batch.logits, batch.sampled_ids, batch.topk_ids, temperature=T,
                            chunk_rows=compute.chunk_rows, impl=compute.impl, validate=False,
                            rollout_logits=batch.rollout_logits, kept_mask=batch.kept_mask, truncation=trunc)
    if validate:  # one host sync, made only when validating (off on a trusted hot path)
        v = batch.valid
        checks = Checks()
        what = "logits" if batch.hidden is None else "hidden"
        checks.add(what, "a response row has no finite logit (all -inf, or NaN/inf values)",
                   (~torch.isfinite(red["lse"]) & v).any())
        if batch.rollout_logits is not None:
            bad = ~(torch.isfinite(red["full_tv"]) & torch.isfinite(red["full_mu_k"]))
            checks.add("rollout.logits", "a response row has no finite logit (all -inf, or NaN/inf values)",
                       (bad & v).any())
        checks.run()
    red = _sanitise_padding(red, batch.valid, batch.vocab_size)
    logp, lse = red["logp"], red["lse"]
    logp_d = logp.detach()
    rlp = batch.sampled_logprob.to(lse.dtype)
    sum_p2 = red["sum_p2"]
    bin_ = binary_stats(logp_d, rlp, sum_p2)
    st = {
        "logp": logp,
        "sampled_logprob": rlp,
        "log_ratio": bin_.pop("log_ratio"),
        "ratio": bin_.pop("ratio"),
        "entropy": red["entropy"],
        "sum_p2": sum_p2,
        **bin_,
    }
    if batch.topk_ids is not None:
        # pi's tail comes from its own reduction (lse_tail), not from 1 - sum pi: that
        # rounds to 0 in float32 once the tail holds less than ~6e-8 of the mass
        sup = divs.build_support(
            batch.sampled_ids, logp_d, rlp, batch.topk_ids, red["topk_logp"],
            batch.topk_logprobs.to(lse.dtype), sum_p2, batch.vocab_size,
            log_pi_tail=red["lse_tail"] - lse, sum_p2_tail=red["sum_p2_tail"], support=support,
        )
        st.update({
            "topk_kl": divs.topk_kl(sup),
            "topk_tv": divs.topk_tv(sup),
            "rollout_tail_mass": sup.mu_tail,
            "policy_tail_mass": sup.pi_tail,
            "tail_clamped": sup.mu_tail_clamped,
            "sampled_in_topk": sup.k_col < batch.topk_ids.shape[1],
        })
        for est in ESTIMATORS:
            st[ddot_key("topk_kl", est)] = dirs.ddot_topk_kl(sup, est)
            st[ddot_key("topk_tv", est)] = dirs.ddot_topk_tv(sup, est)
    if "kept_mass" in red:
        st.update(kept_mass=red["kept_mass"], kept_size=red["kept_size"], sampled_outside=red["sampled_outside"])
        if batch.topk_ids is not None:
            # share of the top-K entries whose membership of the kept set differs between the
            # engine (a -inf processed log-prob: outside) and the trainer's rebuilt set
            eng = torch.isfinite(batch.topk_logprobs)
            mine = torch.isfinite(red["topk_logp"])
            st["kept_topk_mismatch"] = (eng != mine).to(lse.dtype).mean(-1)
    if batch.rollout_logits is not None:
        st.update({
            "full_kl": red["full_kl"],
            "full_tv": red["full_tv"],
            ddot_key("full_kl"): dirs.ddot_full_kl(logp_d, red["full_mu_k"], red["sum_p_mu"], sum_p2),
            ddot_key("full_tv"): dirs.ddot_full_tv(logp_d, red["full_mu_k"], red["sum_p_s"], red["sum_p2_s"], sum_p2),
        })
    st["valid"] = batch.valid
    return st


def unflatten(stats: dict[str, torch.Tensor], lead_shape: tuple) -> dict[str, torch.Tensor]:
    return {k: v.reshape(lead_shape + tuple(v.shape[1:])) for k, v in stats.items()}


def token_stats(
    logits: torch.Tensor,
    rollout,
    *,
    sampling: ops.Sampling | None = None,
    compute: ops.Compute | None = None,
    validate: bool = True,
    support: str = "topk+sampled",
) -> dict[str, torch.Tensor]:
    """Every per-token statistic of the library, shaped like ``rollout.sampled_ids``.

    Args:
        logits: (B, T, V) trainer logits (any float dtype; reduced in float32, or
            float64 for float64 input). ``pi = softmax(logits / sampling.temperature)``.
        rollout: :class:`pdmask.Rollout` (its top-K optional: without it there are no
            top-K keys; its ``logits``, the rollout policy's full logits at the same
            temperature, add the ``full_*`` keys; its ``response_mask`` marks the
            positions to check, the others are padding, sanitised).
        sampling: :class:`pdmask.Sampling` (None: temperature 1, no truncation); with
            truncation (or ``rollout.kept_mask``) the statistics are those of pi
            renormalised over the kept set, plus ``kept_mass``, ``kept_size``,
            ``sampled_outside`` (and ``kept_topk_mismatch`` with top-K).
        compute: :class:`pdmask.ops.Compute` (None: ``impl="auto"``, each
            implementation's default chunk).
        support: the support of the top-K divergences (:data:`pdmask.keys.SUPPORTS`):
            ``"topk+sampled"`` (default) ``S' = topK ∪ {k}``; ``"topk"`` the rollout's
            top-K alone, a sampled token outside it counted in the tail bucket (the DPPO
            reference code, Stable-RL's ``compute_topk_kl``). docs/core.md.

    Returns a dict (``log_ratio = log pi_k - log mu_k``, ``ratio = exp(log_ratio)``
    capped at ``exp(MAX_LOG_RATIO)``):
      ``logp`` (differentiable log pi_k), ``sampled_logprob`` (log mu_k), ``log_ratio``,
      ``ratio``, ``entropy``, ``sum_p2``, ``binary_tv``, ``binary_kl``, ``ddot_binary_tv``,
      ``ddot_binary_kl``; with top-K: ``topk_kl``, ``topk_tv``,
      ``ddot_topk_{kl,tv}_{exact,aggregated,uniform,truncated}``,
      ``rollout_tail_mass`` (mu_T), ``policy_tail_mass`` (pi_T), ``tail_clamped``
      (sum of mu on the support exceeded 1 by rounding), ``sampled_in_topk``; with
      ``rollout.logits``: ``full_kl``, ``full_tv``, ``ddot_full_kl``, ``ddot_full_tv``;
      and ``valid`` (the response mask). ``Ddot`` is ``grad_{z/T} D . (e_k - pi)``.

    Naive torch (binary part): ``logq = log_softmax(logits / T, -1)``;
    ``logp = logq.gather(-1, ids[..., None])``; ``log_ratio = logp - rollout.sampled_logprob``.
    """
    sampling = ops.Sampling() if sampling is None else sampling
    compute = ops.Compute() if compute is None else compute
    for name, v, cls in (("sampling", sampling, ops.Sampling), ("compute", compute, ops.Compute)):
        if not isinstance(v, cls):
            raise ValueError(f"{name}: must be a pdmask.{cls.__name__} (or None), got {type(v).__name__}")
    if not isinstance(rollout, Rollout):
        raise ValueError(f"rollout: must be a pdmask.Rollout, got {type(rollout).__name__}")
    check_choice("support", support, SUPPORTS)
    ops.check_truncation(compute.impl, sampling, rollout.kept_mask, rollout.logits, rollout=True)
    batch = prepare(logits, rollout, validate)
    st = stats_from_batch(batch, sampling=sampling, compute=compute, validate=validate, support=support)
    return unflatten(st, batch.lead_shape)
