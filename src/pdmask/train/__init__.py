"""The built-in RL trainer (needs the ``train`` extra).

Stable entry points (the direction audit and notebooks import these):

- :class:`TrainConfig`, :func:`load_config` — the documented config (``config``).
- :func:`build_task`, :func:`get_reward`, :class:`Problem` — tasks and rewards (``tasks``).
- :func:`ensure_sft_checkpoint` — the cached SFT base directory (``sft``).
- :func:`load_model_and_tokenizer`, :func:`build_model`, :func:`encode_prompts` (``model``).
- :func:`build_engine` — the rollout engine from a config (``pdmask.engine.registry``).
- :func:`rollout_step` — generate -> rewards -> advantages, :class:`RolloutStep`;
  :func:`group_advantages`, :func:`decode_responses`, :func:`rewards_for`,
  :func:`greedy_eval` (``rollout``).
- :func:`compute_loss` — one trainer forward + ``cfg.loss`` on a rollout batch;
  :func:`update_step` — loss, backward, clip, optimizer step; :func:`select`,
  :func:`make_optimizer`, :func:`build_optimizer` (``update``).
- :func:`latest_checkpoint`, :func:`load_weights`, :func:`is_run_dir` (``checkpoint``).
- :func:`setup`, :func:`train` — the whole run (``grpo``).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "TrainConfig": "config", "load_config": "config", "replace": "config",
    "build_task": "tasks", "get_reward": "tasks", "Problem": "tasks", "Task": "tasks",
    "ensure_sft_checkpoint": "sft", "sft_info": "sft",
    "load_model_and_tokenizer": "model", "build_model": "model", "encode_prompts": "model",
    "group_advantages": "rollout", "decode_responses": "rollout", "rewards_for": "rollout",
    "greedy_eval": "rollout", "eval_rewards": "tasks",
    "rollout_step": "rollout", "RolloutStep": "rollout",
    "compute_loss": "update", "select": "update", "update_step": "update", "make_optimizer": "update", "build_optimizer": "update",
    "latest_checkpoint": "checkpoint", "load_weights": "checkpoint", "is_run_dir": "checkpoint",
    "setup": "grpo", "Setup": "grpo", "train": "grpo",
    "build_engine": "pdmask.engine.registry",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        mod = _EXPORTS[name]  # a module of this package, or a full module path
        return getattr(importlib.import_module(mod if mod.startswith("pdmask.") else f"{__name__}.{mod}"), name)
    raise AttributeError(f"module 'pdmask.train' has no attribute {name!r}")
