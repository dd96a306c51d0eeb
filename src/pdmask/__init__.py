"""pdmask: trust-region masks for LLM reinforcement learning, built around the
predictive divergence mask.

Public API (pure tensor functions taking a few typed objects):

- :class:`Rollout` — what the rollout engine reports (sampled ids, ``log mu_k``, top-K,
  response mask; optionally its kept set and full logits); every loss takes one.
  :class:`Anchor` — a proximal policy pi_old's log-probs, for a region centred on pi_old
  (``PolicyLoss(anchor="old")``; :mod:`pdmask.anchor`).
- :class:`Thresholds`, :class:`Corrections`, :class:`Sampling`, :class:`Aggregation`,
  :class:`Compute` — the settings, each checked once when made; :class:`PolicyLoss` holds
  one of each (errors are :class:`SpecError`, naming the field).
- :func:`token_stats` — every per-token statistic (:class:`TokenStats`: log pi_k, ratio,
  divergences, direction derivatives), the one contract between the reductions and the loss.
- :func:`policy_loss` — masked, IS-weighted policy-gradient loss + detached metrics:
  ``PolicyLoss(**spec)(logits, rollout, A)``, i.e. :func:`token_stats` then
  :func:`loss_from_stats`; :func:`policy_loss_from_hidden` the same from hidden states and
  the LM-head weight, without the (N, V) logits; :func:`trust_region_mask` the keep mask alone.
- :data:`MODES`, :func:`register_mode`, :class:`MaskMode` — the mode registry, with the
  building blocks of a mode: regions :func:`divergence_region`, :func:`ratio_region`;
  direction tests :func:`predictive`, :func:`ratio_sign`. The experimental batch-aware
  modes register themselves when :mod:`pdmask_lab.batchmask` is imported.
- :data:`SURROGATES`, :func:`register_surrogate`, :class:`Surrogate` — the per-token loss forms
  (:func:`token_loss`); :func:`register_divergence`, :class:`TopKDivergence` — the top-K
  divergences (docs/core.md, "Adding a surrogate, a divergence or a mode").
- :func:`aggregate` — verl's loss aggregation modes.
- :func:`importance_weights`, :func:`rejection_mask`, :func:`off_policy_mask` — the
  off-policy corrections (:mod:`pdmask.corrections`; in :func:`policy_loss` through its
  ``corrections=`` :class:`Corrections`).
"""

from . import _moved
from ._validate import SpecError
from .anchor import ANCHORS, Anchor
from .corrections import RULES as REJECTION_RULES
from .corrections import Corrections, importance_weights, off_policy_mask, rejection_mask
from .divergences import TopKDivergence, register_divergence
from .keys import ESTIMATORS, SUPPORTS, ddot_key
from .loss import (
    Aggregation, PolicyLoss, PolicyLossOutput, aggregate, loss_from_stats, policy_loss, policy_loss_from_hidden,
    trust_region_mask,
)
from .masks import (
    MODES, MaskMode, Thresholds, divergence_region, get_mode, mask_from_stats, predictive, ratio_region, ratio_sign,
    register_mode,
)
from .ops import Compute, Hidden, Sampling
from .rollout import Rollout
from .stats import TokenStats, token_stats
from .surrogates import SURROGATES, Surrogate, register_surrogate, token_loss

__version__ = "0.1.0"

_moved.install()  # `import pdmask.lab` names its new home, pdmask_lab, in one line

__all__ = [
    "ANCHORS", "Aggregation", "Anchor", "Compute", "Corrections", "ESTIMATORS", "Hidden", "MODES", "MaskMode", "PolicyLoss",
    "PolicyLossOutput", "REJECTION_RULES", "Rollout", "SUPPORTS", "SURROGATES", "Sampling", "SpecError", "Surrogate",
    "Thresholds", "TokenStats", "TopKDivergence", "aggregate", "ddot_key", "divergence_region", "get_mode",
    "importance_weights", "loss_from_stats", "mask_from_stats", "off_policy_mask", "policy_loss",
    "policy_loss_from_hidden", "predictive", "ratio_region", "ratio_sign", "register_divergence", "register_mode",
    "register_surrogate", "rejection_mask", "token_loss", "token_stats", "trust_region_mask",
]
