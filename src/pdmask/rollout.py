"""The rollout: what a rollout engine reports about the tokens it sampled.

One :class:`Rollout` carries every per-token tensor of the sampling policy mu that the
core reads. Converters (:mod:`pdmask.formats`), engines (:mod:`pdmask.engine`) and the
TRL / verl captures produce it; :func:`pdmask.policy_loss`, :func:`pdmask.trust_region_mask`
and :func:`pdmask.token_stats` consume it. Each quantity has this one name everywhere in
the library.

Naive torch equivalent of what an engine puts in it (``z`` the engine's raw logits)::

    logq = torch.log_softmax(z / T, -1)                        # (B, T, V) log mu
    Rollout(sampled_ids=k, sampled_logprob=logq.gather(-1, k[..., None])[..., 0],
            topk_ids=logq.topk(K).indices, topk_logprobs=logq.topk(K).values, response_mask=m)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


def _fail(name: str, msg: str) -> None:
    raise ValueError(f"rollout.{name}: {msg}")


@dataclass(frozen=True)
class Rollout:
    """The rollout engine's view of mu at the sampled positions.

    Attributes:
        sampled_ids: (B, T) integer, the tokens the engine sampled.
        sampled_logprob: (B, T) float, ``log mu_k`` of each sampled token (at the
            sampling temperature, after any truncation: vLLM ``processed_logprobs``).
        topk_ids, topk_logprobs: (B, T, K) the engine's top-K of its sampling
            distribution (given together), or None for the modes that need no top-K.
        response_mask: (B, T) bool / 0-1, True on response tokens; None: all are.
        kept_mask: (B, T, V) bool, the engine's own kept set under truncated sampling.
        logits: (B, T, V) float, the rollout policy's raw full logits (the ``*-full-*``
            modes; simulation / oracle path).

    Any leading shape works as long as every tensor shares it (``(N,)`` rows too).
    Types and the top-K pair are checked here; shapes against the trainer's logits and
    every value are checked by the function that consumes the rollout (one host sync).
    Padding positions may hold anything.
    """

    sampled_ids: torch.Tensor
    sampled_logprob: torch.Tensor
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None
    response_mask: torch.Tensor | None = None
    kept_mask: torch.Tensor | None = None
    logits: torch.Tensor | None = None

    def __post_init__(self) -> None:
        for name in ("sampled_ids", "sampled_logprob"):
            if not isinstance(getattr(self, name), torch.Tensor):
                _fail(name, f"must be a torch.Tensor, got {type(getattr(self, name)).__name__}")
        for name in ("topk_ids", "topk_logprobs", "response_mask", "kept_mask", "logits"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, torch.Tensor):
                _fail(name, f"must be a torch.Tensor or None, got {type(v).__name__}")
        if (self.topk_ids is None) != (self.topk_logprobs is None):
            missing = "topk_logprobs" if self.topk_logprobs is None else "topk_ids"
            _fail(missing, "must be given together with its partner (top-K ids and log-probs go in pairs)")

    @property
    def has_topk(self) -> bool:
        return self.topk_ids is not None

    @property
    def lengths(self) -> torch.Tensor:
        """(B,) number of response tokens per sequence."""
        if self.response_mask is None:
            return torch.full(self.sampled_ids.shape[:-1], self.sampled_ids.shape[-1], dtype=torch.long,
                              device=self.sampled_ids.device)
        return self.response_mask.sum(-1)

    def replace(self, **changes) -> "Rollout":
        """A copy with some fields replaced (``dataclasses.replace``)."""
        return replace(self, **changes)

    def to(self, device=None, dtype: torch.dtype | None = None) -> "Rollout":
        """Move to ``device``; ``dtype`` applies to the float tensors (log-probs, logits) only."""

        def mv(t, is_float):
            if t is None:
                return None
            return t.to(device=device, dtype=dtype if (is_float and dtype is not None) else None)

        return replace(self, sampled_ids=mv(self.sampled_ids, False), sampled_logprob=mv(self.sampled_logprob, True),
                       topk_ids=mv(self.topk_ids, False), topk_logprobs=mv(self.topk_logprobs, True),
                       response_mask=mv(self.response_mask, False), kept_mask=mv(self.kept_mask, False),
                       logits=mv(self.logits, True))

    def __getitem__(self, index) -> "Rollout":
        """The rollout of a subset of sequences (``rollout[idx]`` indexes dim 0 of every tensor)."""
        def ix(t):
            return None if t is None else t[index]

        return replace(self, sampled_ids=ix(self.sampled_ids), sampled_logprob=ix(self.sampled_logprob),
                       topk_ids=ix(self.topk_ids), topk_logprobs=ix(self.topk_logprobs),
                       response_mask=ix(self.response_mask), kept_mask=ix(self.kept_mask), logits=ix(self.logits))
