"""The built-in RL trainer (needs the ``train`` extra).

Stable entry points (the direction audit and notebooks import these):

- :class:`TrainConfig`, :func:`load_config` — the documented config (``config``).
- :func:`build_task`, :func:`get_reward`, :class:`Problem` — tasks and rewards (``tasks``).
- :func:`ensure_sft_checkpoint` — the cached SFT base directory (``sft``).
- :func:`load_model_and_tokenizer`, :func:`build_model`, :func:`encode_prompts` (``model``).
- :func:`build_engine` — the rollout engine from a config (``grpo``); ``pdmask.engine.make_engine``.
- :func:`group_advantages`, :func:`decode_responses`, :func:`rewards_for`,
  :func:`greedy_accuracy` (``rollout``).
- :func:`compute_loss` — one trainer forward + ``pdmask.policy_loss`` on a rollout batch.
- :func:`setup`, :func:`train` — the whole run.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "TrainConfig": "config", "load_config": "config", "replace": "config",
    "build_task": "tasks", "get_reward": "tasks", "Problem": "tasks", "Task": "tasks",
    "ensure_sft_checkpoint": "sft", "sft_info": "sft",
    "load_model_and_tokenizer": "model", "build_model": "model", "encode_prompts": "model",
    "group_advantages": "rollout", "decode_responses": "rollout", "rewards_for": "rollout",
    "greedy_accuracy": "rollout", "greedy_eval": "rollout", "eval_rewards": "tasks",
    "build_engine": "grpo", "compute_loss": "grpo", "select": "grpo", "setup": "grpo", "train": "grpo",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'pdmask.train' has no attribute {name!r}")
