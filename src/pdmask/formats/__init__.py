"""Rollout engines' per-token log-probs -> the :class:`pdmask.Rollout` :func:`pdmask.policy_loss` takes.

Pure converters: they duck-type the engines' output objects and import no engine.

- :mod:`pdmask.formats.topk` -- the one assembler every engine format goes through
  (entries -> a :class:`pdmask.Rollout` of padded (B, T, K) tensors).
- :mod:`pdmask.formats.vllm` -- vLLM ``CompletionOutput.logprobs`` (dicts of
  ``Logprob`` or ``FlatLogprobs``) and TRL's rank-sorted lists; ``logprobs_mode`` checks.
- :mod:`pdmask.formats.sglang` -- SGLang ``meta_info`` (nested or flat raw format).

Layering: like the core, this package never imports ``pdmask.engine``, ``pdmask.train``,
``pdmask_lab`` or ``pdmask.integrations``; the rollout engines and the framework
plugins import it.
"""

from ..rollout import Rollout

__all__ = ["Rollout"]
