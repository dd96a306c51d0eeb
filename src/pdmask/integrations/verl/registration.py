"""Registration of pdmask's pieces in verl's registries (each function imports verl).

The two classes that subclass verl's (:class:`.training_engine.PdmaskFSDPEngine`,
:class:`.vllm_server.PdmaskVLLMReplica`) import :mod:`.actor` and :mod:`.rollout`; they
are registered from here, not from those modules, so the imports run one way only. The
replica is registered as a loader: its module imports vLLM, which the verl workers that
never start a rollout server need not have.
"""

from __future__ import annotations

from .actor import MODEL_TYPE
from .losses import register_losses, registered_names
from .rollout import REPLICA_NAME


def _load_replica():
    from .vllm_server import PdmaskVLLMReplica

    return PdmaskVLLMReplica


def register_rollout() -> None:
    """``rollout.name=pdmask_vllm``: our replica for the servers, verl's vLLM adapter in the
    hybrid workers (weights sync exactly as with ``rollout.name=vllm``)."""
    from verl.workers.rollout import base as rollout_base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    RolloutReplicaRegistry.register(REPLICA_NAME, _load_replica)
    # get_rollout_class(name, mode) looks the worker-side adapter up in this dict; verl 0.9.1
    # has no function to add to it.
    rollout_base._ROLLOUT_REGISTRY[(REPLICA_NAME, "async")] = rollout_base._ROLLOUT_REGISTRY[("vllm", "async")]


def register_engine() -> None:
    """Register :class:`.training_engine.PdmaskFSDPEngine` for ``model_type=pdmask_language_model``
    (backends fsdp / fsdp2, devices cuda / npu)."""
    from verl.workers.engine.base import EngineRegistry

    if MODEL_TYPE in EngineRegistry._engines:  # idempotent (the plugin may be imported twice)
        return
    from .training_engine import PdmaskFSDPEngine

    EngineRegistry.register(model_type=MODEL_TYPE, backend=["fsdp", "fsdp2"], device=["cuda", "npu"])(
        PdmaskFSDPEngine)


def register() -> None:
    """Register the losses, the rollout replica and the training engine with verl, and the
    driver-side config check (:mod:`.config_check`) (idempotent)."""
    from . import config_check

    register_losses()
    register_rollout()
    register_engine()
    config_check.install()


def check_registered() -> dict[str, bool]:
    """Which pdmask pieces verl currently knows (after ``import verl``)."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    return {
        "losses": all(n in POLICY_LOSS_REGISTRY for n in registered_names()),
        "rollout": REPLICA_NAME in RolloutReplicaRegistry._registry,
        "engine": MODEL_TYPE in EngineRegistry._engines,
        "config_check": _config_check_installed(),
    }


def _config_check_installed() -> bool:
    import verl.utils.config as vcfg

    return bool(getattr(vcfg.validate_config, "__pdmask_wrapped__", False))


__all__ = ["check_registered", "register", "register_engine", "register_rollout"]
