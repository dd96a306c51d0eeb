"""Bridges from rollout engines and trainers to the core library.

- :mod:`pdmask.integrations.topk` -- :class:`RolloutTopK` and the one assembler every
  engine format goes through (entries -> padded (B, T, K) tensors).
- :mod:`pdmask.integrations.vllm` -- vLLM ``CompletionOutput.logprobs`` (dicts of
  ``Logprob`` or ``FlatLogprobs``) and TRL's rank-sorted lists; ``logprobs_mode`` checks.
- :mod:`pdmask.integrations.sglang` -- SGLang ``meta_info`` (nested or flat raw format).
- :mod:`pdmask.integrations.trl` -- ``GRPOConfig`` / ``GRPOTrainer`` subclasses for TRL
  (needs the ``trl`` extra).

None of these import vLLM, SGLang or TRL at module level except ``trl`` (which is only
imported when you import :mod:`pdmask.integrations.trl`).
"""

from .topk import RolloutTopK

__all__ = ["RolloutTopK"]
