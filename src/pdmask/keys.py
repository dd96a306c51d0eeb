"""The statistics' vocabulary: one definition of every divergence, estimator and stat key.

Every module that names a per-token statistic (the core, the audit, the integrations)
takes the names from here, so that a key such as ``ddot_topk_kl_exact`` is written once.

- divergences: ``binary_tv``, ``binary_kl`` (sampled token only), ``topk_kl``,
  ``topk_tv`` (rollout top-K plus a tail bucket), ``full_kl``, ``full_tv`` (the rollout's
  full logits; simulation / oracle).
- estimators of the top-K tail in ``Ddot``: ``exact``, ``aggregated``, ``uniform``,
  ``truncated`` (docs/core.md); supports of the top-K divergences: ``topk+sampled``,
  ``topk``.
- ``ddot_key(div, est)``: the stat key of ``Ddot`` of ``div`` (the estimator matters for
  the top-K divergences only).
- ``BATCH_DDOT``: the stat key of an externally computed direction (the batch-aware
  mask, :mod:`pdmask.batchmask`), passed to the loss as ``batch_ddot=``.
"""

from __future__ import annotations

ESTIMATORS = ("exact", "aggregated", "uniform", "truncated")
#: The supports of the top-K divergences: ``"topk+sampled"`` (default) ``S' = topK ∪ {k}``;
#: ``"topk"`` the rollout's top-K alone, a sampled token outside it in the tail bucket (the
#: DPPO reference code, Stable-RL's ``compute_topk_kl``). docs/core.md, METHOD.md section 3.
SUPPORTS = ("topk+sampled", "topk")
BINARY_DIVERGENCES = ("binary_tv", "binary_kl")
TOPK_DIVERGENCES = ("topk_kl", "topk_tv")
FULL_DIVERGENCES = ("full_kl", "full_tv")
DIVERGENCES = BINARY_DIVERGENCES + TOPK_DIVERGENCES + FULL_DIVERGENCES
#: stat key of the batch direction ``<grad log pi_t, P grad Phi>`` (``batch_ddot=`` argument)
BATCH_DDOT = "ddot_batch"


def ddot_key(divergence: str, estimator: str = "exact") -> str:
    """``ddot_topk_kl_exact`` for a top-K divergence, ``ddot_binary_tv`` / ``ddot_full_kl`` otherwise."""
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence: unknown value {divergence!r}; valid values are: {', '.join(DIVERGENCES)}")
    if divergence in TOPK_DIVERGENCES:
        if estimator not in ESTIMATORS:
            raise ValueError(f"estimator: unknown value {estimator!r}; valid values are: {', '.join(ESTIMATORS)}")
        return f"ddot_{divergence}_{estimator}"
    return f"ddot_{divergence}"
