"""verl (0.9.1) plugin: pdmask trust-region masks as verl policy losses, plus the plumbing
verl lacks for the top-K and predictive modes.

Loaded by verl itself: ``pip install 'pdmask[verl]'`` installs the entry point
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
  FSDP engine computing the per-token statistics from the logits -- :mod:`.actor`.

Importing this package does not import verl.
"""

from __future__ import annotations

from .losses import BINARY_MODES, TOPK_MODES, loss_name, registered_names
from .rollout import EXTRA_KEYS, REPLICA_NAME

from .actor import MODEL_TYPE


def register() -> None:
    """Register the losses, the rollout replica and the training engine with verl (idempotent)."""
    from .actor import register_engine
    from .losses import register_losses
    from .rollout import register_rollout

    register_losses()
    register_rollout()
    register_engine()


def check_registered() -> dict[str, bool]:
    """Which pdmask pieces verl currently knows (after ``import verl``)."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    return {
        "losses": all(n in POLICY_LOSS_REGISTRY for n in registered_names()),
        "rollout": REPLICA_NAME in RolloutReplicaRegistry._registry,
        "engine": MODEL_TYPE in EngineRegistry._engines,
    }


__all__ = ["BINARY_MODES", "EXTRA_KEYS", "MODEL_TYPE", "REPLICA_NAME", "TOPK_MODES", "check_registered",
           "loss_name", "register", "registered_names"]
