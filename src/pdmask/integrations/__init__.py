"""Plugins for the trainers practitioners already use.

- :mod:`pdmask.integrations.trl` -- ``GRPOConfig`` / ``GRPOTrainer`` subclasses for TRL
  (needs the ``trl`` extra).
- :mod:`pdmask.integrations.verl` -- a verl plugin: policy losses, a top-K vLLM rollout
  and a training engine (needs the ``verl`` extra; loaded by verl through its entry point).

Importing this package imports neither framework; each subpackage imports its own when
imported. The engine-output converters they use are in :mod:`pdmask.formats`.
"""
