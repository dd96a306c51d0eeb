"""The statistics' vocabulary: the divergence, estimator and support names, and the stat
key of every ``Ddot`` (``ddot_key``; ``DDOT_KEY`` the table), written once here
(docs/core.md): ``binary_*`` (the sampled token), ``topk_*`` (the rollout's top-K plus a
tail bucket), ``full_*`` (the rollout's full logits; simulation / oracle).
"""

from __future__ import annotations

from ._validate import check_choice

ESTIMATORS = ("exact", "aggregated", "uniform", "truncated")
#: The supports of the top-K divergences: ``"topk+sampled"`` (default) ``S' = topK ∪ {k}``;
#: ``"topk"`` the rollout's top-K alone, a sampled token outside it in the tail bucket (the
#: DPPO reference code, Stable-RL's ``compute_topk_kl``). docs/core.md, METHOD.md section 3.
SUPPORTS = ("topk+sampled", "topk")
BINARY_DIVERGENCES = ("binary_tv", "binary_kl")
TOPK_DIVERGENCES = ("topk_kl", "topk_tv")
FULL_DIVERGENCES = ("full_kl", "full_tv")
DIVERGENCES = BINARY_DIVERGENCES + TOPK_DIVERGENCES + FULL_DIVERGENCES
#: ``(divergence, estimator) -> stat key of its Ddot``, every pair (:func:`ddot_key` checks its names).
DDOT_KEY = {(d, e): f"ddot_{d}_{e}" if d in TOPK_DIVERGENCES else f"ddot_{d}" for d in DIVERGENCES for e in ESTIMATORS}


def ddot_key(divergence: str, estimator: str = "exact") -> str:
    """``ddot_topk_kl_exact`` for a top-K divergence, ``ddot_binary_tv`` / ``ddot_full_kl`` otherwise."""
    check_choice("divergence", divergence, DIVERGENCES)
    if divergence in TOPK_DIVERGENCES:
        check_choice("estimator", estimator, ESTIMATORS)
    return DDOT_KEY[divergence, estimator if estimator in ESTIMATORS else ESTIMATORS[0]]
