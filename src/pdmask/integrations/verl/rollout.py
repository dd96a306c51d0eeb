"""Rollout side of the top-K modes: a vLLM replica that returns the top-K with each token.

verl 0.9.1's vLLM server (``verl/workers/rollout/vllm_rollout/vllm_async_server.py:
vLLMHttpServer.generate``) builds ``SamplingParams`` with ``logprobs=0`` (the sampled
token only) and returns a ``TokenOutput`` whose ``extra_fields`` dict travels to the
trainer: the agent loop copies it into ``AgentLoopOutput.extra_fields``
(``experimental/agent_loop/single_turn_agent_loop.py``), ``_postprocess`` turns every key
into a per-sample object array of ``DataProto.non_tensor_batch``, and
``DataProto.to_tensordict`` hands those to the actor as ``NonTensorStack`` s.

The replica here (``rollout.name=pdmask_vllm``, registered in verl's
``RolloutReplicaRegistry``) runs verl's own server with one change: its engine handle
asks vLLM for ``logprobs=K`` and keeps the final ``RequestOutput``; the server then adds
four per-sample arrays to ``extra_fields`` (:data:`EXTRA_KEYS`), converted by pdmask's
vLLM reader :func:`pdmask.formats.vllm.from_vllm_logprobs`:

- ``pdmask_topk_ids`` (T, K) int32 and ``pdmask_topk_logprobs`` (T, K) float32: the
  top-K of the sampling distribution, by rank;
- ``pdmask_sampled_ids`` (T,) int32 and ``pdmask_sampled_logprobs`` (T,) float32: the
  sampled token and its log-prob (``log mu_k``), found by id.

With verl's default ``rollout.logprobs_mode=processed_logprobs`` these are log-probs of
``softmax(logits / T)`` after top-k/top-p truncation: the distribution the tokens were
sampled from, which is what the trust region is anchored to.

Everything in this module runs without verl or vLLM; :func:`.registration.register_rollout`
puts the replica (:mod:`.vllm_server`) in verl's registry.
"""

from __future__ import annotations

from typing import Any

import numpy as np

EXTRA_KEYS = ("pdmask_topk_ids", "pdmask_topk_logprobs", "pdmask_sampled_ids", "pdmask_sampled_logprobs")
REPLICA_NAME = "pdmask_vllm"
#: ``rollout.custom`` key of K, and its default (the paper's K).
TOPK_KEY = "pdmask_topk"
DEFAULT_TOPK = 20


def topk_from_config(config) -> int:
    """K from ``actor_rollout_ref.rollout.custom.pdmask_topk`` (default 20)."""
    custom = getattr(config, "custom", None) if not isinstance(config, dict) else config.get("custom")
    k = (custom or {}).get(TOPK_KEY, DEFAULT_TOPK)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"rollout.custom.{TOPK_KEY}: must be a positive int (top-K width), got {k!r}")
    return k


def completion_topk_fields(completion, *, k: int, logprobs_mode: str | None = None,
                           sampling_params=None) -> dict[str, np.ndarray]:
    """One vLLM ``CompletionOutput`` -> the :data:`EXTRA_KEYS` arrays.

    ``completion.logprobs`` may be dicts of ``Logprob`` or a ``FlatLogprobs``; the
    conversion (sampled token by id, ranks, merging) is
    :func:`pdmask.formats.vllm.from_vllm_logprobs`, which also checks
    ``logprobs_mode`` against the sampling settings (warns on ``raw_logprobs`` with a
    temperature or truncation, refuses ``*_logits``).
    """
    from ...formats.vllm import from_vllm_logprobs

    sp = sampling_params
    r = from_vllm_logprobs(
        [completion.logprobs], [list(completion.token_ids)], k=k, logprobs_mode=logprobs_mode,
        temperature=getattr(sp, "temperature", None), top_p=getattr(sp, "top_p", None),
        top_k=getattr(sp, "top_k", None), min_p=getattr(sp, "min_p", None),
    )
    return {
        "pdmask_topk_ids": r.topk_ids[0].numpy().astype(np.int32),
        "pdmask_topk_logprobs": r.topk_logprobs[0].numpy().astype(np.float32),
        "pdmask_sampled_ids": r.sampled_ids[0].numpy().astype(np.int32),
        "pdmask_sampled_logprobs": r.sampled_logprob[0].numpy().astype(np.float32),
    }


class TopKEngine:
    """Engine handle that asks for ``logprobs=K`` and keeps each request's final output.

    Wraps vLLM's ``AsyncLLM`` (everything but ``generate`` is forwarded). verl's server
    code reads ``logprobs[token_ids[i]].logprob`` from the outputs, which stays valid:
    vLLM always includes the sampled token next to the top-K.
    """

    def __init__(self, engine, k: int):
        self._engine = engine
        self._k = k
        #: request_id -> (final RequestOutput, SamplingParams)
        self.finished: dict[str, tuple[Any, Any]] = {}

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def generate(self, *args, **kwargs):
        return self._generate(*args, **kwargs)

    async def _generate(self, *args, **kwargs):
        sp = kwargs.get("sampling_params", args[1] if len(args) > 1 else None)
        request_id = kwargs.get("request_id", args[2] if len(args) > 2 else None)
        if sp is None:
            raise ValueError("sampling_params: required")
        sp.logprobs = max(self._k, sp.logprobs or 0)
        final = None
        async for out in self._engine.generate(*args, **kwargs):
            final = out
            yield out
        if final is not None and getattr(final, "outputs", None):
            self.finished[request_id] = (final, sp)

    def pop_fields(self, request_id: str, *, logprobs_mode: str | None) -> dict[str, np.ndarray]:
        """The :data:`EXTRA_KEYS` arrays of a finished request ({} if it was aborted)."""
        got = self.finished.pop(request_id, None)
        if got is None:
            return {}
        final, sp = got
        return completion_topk_fields(final.outputs[0], k=self._k, logprobs_mode=logprobs_mode,
                                      sampling_params=sp)


def check_max_logprobs(engine_kwargs: dict, k: int) -> None:
    """vLLM refuses ``logprobs`` above the engine's ``max_logprobs`` (default 20): raise it to K."""
    cur = engine_kwargs.get("max_logprobs")
    if cur is None:
        if k > 20:
            engine_kwargs["max_logprobs"] = k
    elif not (isinstance(cur, int) and (cur < 0 or cur >= k)):  # -1: no limit
        raise ValueError(f"rollout.engine_kwargs.vllm.max_logprobs: {cur!r} is below "
                         f"rollout.custom.{TOPK_KEY}={k}")


__all__ = ["DEFAULT_TOPK", "EXTRA_KEYS", "REPLICA_NAME", "TOPK_KEY", "TopKEngine", "check_max_logprobs",
           "completion_topk_fields", "topk_from_config"]
