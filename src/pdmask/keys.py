"""The statistics' vocabulary: the divergence, estimator and support names, and the stat
key of every ``Ddot`` (``ddot_key``; ``DDOT_KEY`` the table), written once here
(docs/core.md): ``binary_*`` (the sampled token), ``topk_*`` (the rollout's top-K plus a
tail bucket: the registered ones, :func:`pdmask.divergences.register_divergence`),
``full_*`` (the rollout's full logits; simulation / oracle). The tables below that name the
top-K divergences are filled by that registration (plain containers, so that reading them
on the loss's path runs no function of this module).
"""

from __future__ import annotations

from ._validate import check_choice

ESTIMATORS = ("exact", "aggregated", "uniform", "truncated")
#: The supports of the top-K divergences: ``"topk+sampled"`` (default) ``S' = topK ∪ {k}``;
#: ``"topk"`` the rollout's top-K alone, a sampled token outside it in the tail bucket (the
#: DPPO reference code, Stable-RL's ``compute_topk_kl``). docs/core.md, METHOD.md section 3.
SUPPORTS = ("topk+sampled", "topk")
BINARY_DIVERGENCES = ("binary_tv", "binary_kl")
FULL_DIVERGENCES = ("full_kl", "full_tv")
#: The registered top-K divergences: name -> :class:`pdmask.divergences.TopKDivergence`.
TOPK_DIVERGENCES: dict = {}
#: Every divergence name: the binary ones, the registered top-K ones, the full ones.
DIVERGENCES: list = [*BINARY_DIVERGENCES, *FULL_DIVERGENCES]
#: ``(divergence, estimator) -> stat key of its Ddot``, every pair (:func:`ddot_key` checks its names).
DDOT_KEY: dict = {(d, e): f"ddot_{d}" for d in DIVERGENCES for e in ESTIMATORS}
#: stat key of a top-K ``Ddot`` -> ``(divergence, estimator)``.
TOPK_DDOTS: dict = {}


def add_topk_divergence(name: str, divergence) -> None:
    """Enter a top-K divergence in the tables above (:func:`pdmask.divergences.register_divergence`)."""
    TOPK_DIVERGENCES[name] = divergence
    DIVERGENCES[:] = [*BINARY_DIVERGENCES, *TOPK_DIVERGENCES, *FULL_DIVERGENCES]
    for e in ESTIMATORS:
        DDOT_KEY[name, e] = f"ddot_{name}_{e}"
        TOPK_DDOTS[f"ddot_{name}_{e}"] = (name, e)


def ddot_key(divergence: str, estimator: str = "exact") -> str:
    """``ddot_topk_kl_exact`` for a top-K divergence, ``ddot_binary_tv`` / ``ddot_full_kl`` otherwise."""
    check_choice("divergence", divergence, DIVERGENCES)
    if divergence in TOPK_DIVERGENCES:
        check_choice("estimator", estimator, ESTIMATORS)
    return DDOT_KEY[divergence, estimator if estimator in ESTIMATORS else ESTIMATORS[0]]
