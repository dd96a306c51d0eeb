"""The rollout-engine interface shared by every backend (transformers, vLLM).

The trainer and the audit only ever see this interface, so they never know which
backend produced the tokens. An engine owns its own copy of the weights (that is what
makes training-inference mismatch real) and reports, for every generated token, the
sampled token's log-prob and the top-K ids/log-probs of the *sampling distribution*
(after temperature), as production engines do.

Layout conventions of :class:`RolloutBatch` (B sequences, P prompt slots, T response slots):
prompts are left-padded to P, responses right-padded to T, so ``sequences[:, P:]`` are
the response tokens (``rollout.sampled_ids``) and ``rollout.response_mask`` marks the
real ones (the EOS token, when generated, is a real response token).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..rollout import Rollout


@dataclass
class RolloutBatch:
    """Generated sequences and the engine's :class:`pdmask.Rollout` of their responses.

    ``rollout`` holds ``sampled_ids`` (= ``sequences[:, P:]``), ``sampled_logprob`` (B, T)
    float32 ``log mu_k``, ``topk_ids`` / ``topk_logprobs`` (B, T, K) of the sampling
    distribution, ``response_mask`` (B, T) bool and, when requested (oracle path),
    ``logits`` (B, T, V) float32 raw engine logits; pass it to the core as it is."""

    sequences: torch.Tensor  # (B, P + T) int64: left-padded prompt + right-padded response
    attention_mask: torch.Tensor  # (B, P + T) bool: real tokens
    prompt_len: int  # P
    rollout: Rollout

    @property
    def response_ids(self) -> torch.Tensor:  # (B, T)
        return self.sequences[:, self.prompt_len:]

    @property
    def response_mask(self) -> torch.Tensor:  # (B, T) bool
        return self.rollout.response_mask

    def __getitem__(self, rows) -> "RolloutBatch":
        """The sequences ``rows`` (an index tensor or slice of dim 0)."""
        return RolloutBatch(self.sequences[rows], self.attention_mask[rows], self.prompt_len, self.rollout[rows])


class RolloutEngine(ABC):
    """A generator with its own weights, precision and sampling settings."""

    #: sampling temperature; log-probs are those of softmax(logits / temperature)
    temperature: float
    #: number of top-K entries reported per token
    top_k_logprobs: int

    @abstractmethod
    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, seed: int,
                 return_logits: bool = False) -> RolloutBatch:
        """Sample one response per prompt (repeat a prompt n times for a group)."""

    @abstractmethod
    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Replace the engine's weights with the trainer's (cast to the engine precision)."""

    @abstractmethod
    def score(self, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
        """Teacher-forced raw logits (B, T, V) float32 of the engine at the response positions.

        Used by the oracle path and the audit (full-vocabulary mu)."""
