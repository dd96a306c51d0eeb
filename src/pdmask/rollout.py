"""The rollout: what a rollout engine reports about the tokens it sampled. Naive torch of what
an engine puts in a :class:`Rollout` (``z`` its raw logits, ``logq = log_softmax(z / T, -1)``)::

    Rollout(sampled_ids=k, sampled_logprob=logq.gather(-1, k[..., None])[..., 0],
            topk_ids=logq.topk(K).indices, topk_logprobs=logq.topk(K).values, response_mask=m)
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch


def _fail(name: str, msg: str) -> None:
    raise ValueError(f"rollout.{name}: {msg}")


#: the fields holding floating-point tensors (the rest: ids and masks)
_FLOAT = ("sampled_logprob", "topk_logprobs", "logits")


@dataclass(frozen=True)
class Rollout:
    """The rollout engine's view of mu at the sampled positions, any leading shape shared by
    every tensor: ``sampled_ids`` (B, T); ``sampled_logprob`` ``log mu_k`` (after temperature
    and truncation: vLLM ``processed_logprobs``); ``topk_ids`` / ``topk_logprobs`` (B, T, K), a
    pair or None; ``response_mask`` (None: all); ``kept_mask`` (B, T, V) the engine's kept set;
    ``logits`` (B, T, V) mu's raw logits (``*-full-*``). Types here, shapes and values where
    it is consumed; padding may hold anything."""

    sampled_ids: torch.Tensor
    sampled_logprob: torch.Tensor
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None
    response_mask: torch.Tensor | None = None
    kept_mask: torch.Tensor | None = None
    logits: torch.Tensor | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, torch.Tensor) and (v is not None or f.name in ("sampled_ids", "sampled_logprob")):
                _fail(f.name, f"must be a torch.Tensor{'' if f.name.startswith('sampled') else ' or None'}, "
                              f"got {type(v).__name__}")
        if (self.topk_ids is None) != (self.topk_logprobs is None):
            missing = "topk_logprobs" if self.topk_logprobs is None else "topk_ids"
            _fail(missing, "must be given together with its partner (top-K ids and log-probs go in pairs)")

    def replace(self, **changes) -> "Rollout":
        """A copy with some fields replaced (``dataclasses.replace``)."""
        return replace(self, **changes)

    def _map(self, fn) -> "Rollout":
        return replace(self, **{f.name: None if getattr(self, f.name) is None else fn(f.name, getattr(self, f.name))
                                for f in fields(self)})

    def to(self, device=None, dtype: torch.dtype | None = None) -> "Rollout":
        """Move to ``device``; ``dtype`` applies to the float tensors (log-probs, logits) only."""
        return self._map(lambda k, t: t.to(device=device, dtype=dtype if k in _FLOAT else None))

    def __getitem__(self, index) -> "Rollout":
        """The rollout of a subset of sequences (``rollout[idx]`` indexes dim 0 of every tensor)."""
        return self._map(lambda k, t: t[index])
