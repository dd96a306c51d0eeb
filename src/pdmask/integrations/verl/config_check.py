"""Driver-side checks of a verl config that selects a pdmask loss (before any worker starts).

verl 0.9.1 hands a registered policy loss only ``(old_log_prob, log_prob, advantages,
response_mask, loss_agg_mode, config, rollout_is_weights)``; some settings that look like
they configure that loss never reach it. Where the pdmask loss cannot honour a setting,
this module refuses it with one line naming the key, instead of letting verl drop it:

- ``algorithm.rollout_correction.rollout_is`` / ``rollout_rs`` with ``bypass_mode=true``:
  both trainers compute the rollout correction only in decoupled mode
  (``trainer/ppo/v1/trainer_base.py:_compute_advantage``, ``ray_trainer.py:fit``: "In bypass
  mode, this is skipped"); in bypass mode verl expects its own ``bypass_mode`` loss, which
  reads ``actor.policy_loss.rollout_correction``. With a pdmask loss the correction would
  silently not happen. In decoupled mode the pdmask losses take verl's
  ``rollout_is_weights`` and its rejected ``response_mask`` (:mod:`.losses`).
- ``actor_rollout_ref.actor.policy_loss.rollout_correction``: read only by verl's
  ``bypass_mode`` loss (``core_algos.compute_policy_loss_bypass_mode``).
- ``actor_rollout_ref.rollout.top_k`` / ``top_p`` truncating with a loss anchored on the
  rollout's mu (the top-K losses; the binary ones in bypass mode): that mu is renormalised
  over the kept set, verl's differentiable ``log_prob`` is not, and a
  registered loss cannot change that (the core's truncated-sampling correction needs the
  logits' gradient path).
- a top-K loss in decoupled mode (``bypass_mode=false``) with the legacy trainer
  (``trainer.use_v1=false``): the region is then centred on pi_old, whose top-K the pdmask
  engine computes in the old-log-prob pass, but ``RayPPOTrainer._compute_old_log_prob``
  keeps only ``old_log_probs`` / ``entropys`` / ``routed_experts`` / ``sum_pi_squared`` of
  that pass's output: no hook carries pi_old's top-K to the update (the v1 trainer writes
  every output of the pass to TransferQueue, which does).
- ``actor_rollout_ref.model.use_fused_kernels=true`` with a top-K loss: the fused forward
  returns log-probs and entropy computed from the hidden states inside the model
  (``FusedLinearForPPO``); no logits and no hidden states reach any hook (docs/verl.md).

:func:`install` wraps ``verl.utils.config.validate_config`` (which ``main_ppo`` calls before
it starts Ray) when the plugin loads; :func:`check_config` is the check itself.
"""

from __future__ import annotations

from typing import Any

from .losses import binary_modes, registered_names


def _get(cfg: Any, path: str, default=None):
    cur = cfg
    for part in path.split("."):
        if cur is None:
            return default
        try:
            cur = cur.get(part, None) if hasattr(cur, "get") else getattr(cur, part, None)
        except Exception:  # an OmegaConf interpolation that does not resolve: not ours to judge
            return default
    return default if cur is None else cur


def _has(cfg: Any, path: str) -> bool:
    *head, last = path.split(".")
    node = _get(cfg, ".".join(head)) if head else cfg
    try:
        return node is not None and last in node
    except TypeError:
        return False


def check_config(config: Any) -> None:
    """Refuse (one-line ``ValueError`` naming the key) the settings a pdmask loss cannot honour.
    Does nothing when ``actor_rollout_ref.actor.policy_loss.loss_mode`` is not a pdmask loss."""
    loss_mode = _get(config, "actor_rollout_ref.actor.policy_loss.loss_mode")
    names = registered_names()
    if loss_mode not in names:
        return
    mode, _ = names[loss_mode]
    rc = "algorithm.rollout_correction"
    if _get(config, f"{rc}.bypass_mode", False):
        for key in ("rollout_is", "rollout_rs"):
            if _get(config, f"{rc}.{key}") is not None:
                raise ValueError(
                    f"{rc}.{key}: verl computes the rollout correction only with bypass_mode=false (in bypass mode "
                    f"it expects its own bypass_mode loss), so with loss_mode={loss_mode} it would not be applied; "
                    f"set {rc}.bypass_mode=false (the pdmask losses take verl's IS weights and rejection mask) or "
                    f"{key}=null")
    if mode not in binary_modes() and not _get(config, f"{rc}.bypass_mode", False) \
            and not _get(config, "trainer.use_v1", True):
        raise ValueError(
            f"trainer.use_v1: loss_mode={loss_mode} in decoupled mode ({rc}.bypass_mode=false) centres the region on "
            "pi_old, whose top-K the pdmask engine computes in the old-log-prob pass, but the legacy trainer's "
            "RayPPOTrainer._compute_old_log_prob keeps only old_log_probs, entropys, routed_experts and "
            "sum_pi_squared of that pass: verl 0.9.1 has no hook that carries pi_old's top-K to the update; set "
            f"trainer.use_v1=true, or {rc}.bypass_mode=true to centre the region on the rollout's mu")
    if _has(config, "actor_rollout_ref.actor.policy_loss.rollout_correction"):
        raise ValueError(
            f"actor_rollout_ref.actor.policy_loss.rollout_correction: read only by verl's bypass_mode loss, not by "
            f"loss_mode={loss_mode}; configure {rc} (with bypass_mode=false) instead")
    # the top-K modes anchor on the rollout's mu (bypass mode) or read mu in pi_old / mu
    # (decoupled mode); the binary modes read mu only in bypass mode
    if mode not in binary_modes() or _get(config, f"{rc}.bypass_mode", False):
        ro = "actor_rollout_ref.rollout"
        top_k, top_p = _get(config, f"{ro}.top_k", -1), _get(config, f"{ro}.top_p", 1.0)
        if (top_k not in (-1, 0) and top_k is not None) or (top_p is not None and float(top_p) < 1.0):
            key = f"{ro}.top_k" if top_k not in (-1, 0, None) else f"{ro}.top_p"
            raise ValueError(
                f"{key}: truncated sampling is not supported with loss_mode={loss_mode} reading the rollout's mu in "
                "verl: mu is renormalised over the kept tokens while the log-prob verl differentiates (and pi_old) "
                "span the vocabulary, and a registered loss cannot renormalise them; sample with top_k=-1 and "
                "top_p=1 (verl's defaults)")
    if mode not in binary_modes() and _get(config, "actor_rollout_ref.model.use_fused_kernels", False):
        raise ValueError(
            f"actor_rollout_ref.model.use_fused_kernels: loss_mode={loss_mode} needs the logits, which verl's fused "
            "forward never builds (it returns log-probs from the hidden states inside the model, and no hook "
            "receives the hidden states); set it to false")


def install() -> bool:
    """Make ``verl.utils.config.validate_config`` run :func:`check_config` after verl's own
    checks (idempotent). ``main_ppo`` imports the name after ``import verl`` has loaded the
    plugin, so it calls the wrapped function. Returns False when verl has no such function."""
    try:
        import verl.utils.config as vcfg
    except ImportError:  # pragma: no cover - verl without its utils (not 0.9.1)
        return False
    orig = getattr(vcfg, "validate_config", None)
    if orig is None:
        return False
    if getattr(orig, "__pdmask_wrapped__", False):
        return True

    def validate_config(config, *args, **kwargs):
        out = orig(config, *args, **kwargs)
        check_config(config)
        return out

    validate_config.__pdmask_wrapped__ = True
    validate_config.__wrapped__ = orig
    validate_config.__doc__ = orig.__doc__
    vcfg.validate_config = validate_config
    return True


__all__ = ["check_config", "install"]
