"""verl (0.9.1) plugin: pdmask trust-region masks as verl policy losses, plus the plumbing
verl lacks for the top-K and predictive modes.

Loaded by verl itself: ``pip install -e '.[verl]'`` (from a checkout) installs the entry point
``pdmask = pdmask.integrations.verl.plugin`` in the ``verl.plugins`` group, and
``import verl`` imports every module of that group (``verl/__init__.py``; verl logs a
failing plugin at DEBUG level only, so check with :func:`check_registered`).

What it registers (see ``docs/verl.md``):

- policy losses (``actor_rollout_ref.actor.policy_loss.loss_mode``):
  ``pdmask_dppo_binary_tv``, ``pdmask_dppo_binary_kl`` (stock verl), and
  ``pdmask_dppo_topk_{kl,tv}``, ``pdmask_pdm_topk_{kl,tv}[_aggregated|_uniform|_truncated]``
  (need the two pieces below) -- :mod:`.losses`;
- rollout ``actor_rollout_ref.rollout.name=pdmask_vllm``: verl's vLLM replica asking for
  ``logprobs=K`` and returning the top-K with each token -- :mod:`.rollout`;
- training engine ``actor_rollout_ref.model.model_type=pdmask_language_model``: verl's
  FSDP engine computing the per-token statistics from the logits -- :mod:`.actor`,
  :mod:`.training_engine`.

:mod:`.registration` puts them in verl's registries.

Importing this package does not import verl.
"""

from __future__ import annotations

from .actor import MODEL_TYPE
from .losses import binary_modes, loss_name, registered_names, topk_modes
from .registration import check_registered, register
from .rollout import EXTRA_KEYS, REPLICA_NAME

__all__ = ["EXTRA_KEYS", "MODEL_TYPE", "REPLICA_NAME", "binary_modes", "check_registered", "loss_name", "register",
           "registered_names", "topk_modes"]


def __getattr__(name: str):
    if name in ("BINARY_MODES", "TOPK_MODES"):  # the names before issue 42: read from the registry when asked
        return binary_modes() if name == "BINARY_MODES" else topk_modes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
