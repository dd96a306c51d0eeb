"""One policy update on a rollout batch: the trainer's optimizer, the loss, the step.

- :func:`make_optimizer` — the trainer's AdamW (betas :data:`ADAMW_BETAS`).
- :func:`select` — rows of a rollout batch (a mini-batch) with padding columns trimmed.
- :func:`compute_loss` — one trainer forward, then :func:`pdmask.policy_loss`.
- :func:`update_step` — loss -> backward -> clip -> optimizer step (one mini-batch).

The training loop (:mod:`.grpo`) and the direction audit's lag steps both update the
policy with these, so the two cannot drift apart.
"""

from __future__ import annotations

import math

import torch

from ..engine.base import RolloutBatch
from ..engine.hf import response_logits
from ..loss import PolicyLossOutput, policy_loss
from .config import TrainConfig, correction_kwargs

#: AdamW betas of the built-in trainer (the audit starts its batch step from the same)
ADAMW_BETAS = (0.9, 0.99)


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """The trainer's optimizer: ``AdamW(lr=cfg.lr, weight_decay=cfg.weight_decay, betas=ADAMW_BETAS)``."""
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=ADAMW_BETAS)


def select(batch: RolloutBatch, idx: list[int], prompt_lens: list[int], response_lens: list[int]) -> RolloutBatch:
    """Rows ``idx`` of a rollout batch with all-padding prompt/response columns trimmed.

    ``prompt_lens`` / ``response_lens`` are the per-row real lengths as host ints (read
    once per step, so slicing mini-batches never syncs)."""
    P = batch.prompt_len
    p0 = P - max(prompt_lens[i] for i in idx)  # first prompt column any selected row uses
    T = max(1, max(response_lens[i] for i in idx))
    ix = torch.as_tensor(idx, device=batch.sequences.device)
    return RolloutBatch(
        sequences=batch.sequences[ix, p0:P + T], attention_mask=batch.attention_mask[ix, p0:P + T],
        prompt_len=P - p0, response_mask=batch.response_mask[ix, :T],
        sampled_logprob=batch.sampled_logprob[ix, :T], topk_ids=batch.topk_ids[ix, :T],
        topk_logprobs=batch.topk_logprobs[ix, :T],
        logits=batch.logits[ix, :T] if batch.logits is not None else None)


def compute_loss(model, batch: RolloutBatch, advantages: torch.Tensor, cfg: TrainConfig, *,
                 validate: bool = False) -> PolicyLossOutput:
    """The batch loss: one trainer forward, then :func:`pdmask.policy_loss`.

    Args:
        model: the trainer's causal LM.
        batch: rollout tokens with the engine's ``log mu_k`` and top-K of mu.
        advantages: (B,) per-sequence advantages (broadcast over the response tokens).
        cfg: reads mode, estimator, delta_low/high, eps_low/high, is_cap, loss_agg,
            temperature (and uses ``batch.logits`` as ``rollout_logits`` if present), the
            off-policy corrections and the engine's truncated sampling
            (:func:`pdmask.train.config.correction_kwargs`).
        validate: pass through to ``policy_loss`` (off on the trainer's hot path, where
            the engine's outputs are known good).

    Returns :class:`pdmask.PolicyLossOutput` (``loss`` differentiable, ``metrics`` detached).
    """
    logits = response_logits(model, batch.sequences, batch.attention_mask, batch.prompt_len)  # (B, T, V)
    return policy_loss(
        logits, batch.response_ids, batch.sampled_logprob, batch.topk_ids, batch.topk_logprobs,
        advantages.to(logits.device), batch.response_mask, mode=cfg.mode, estimator=cfg.estimator,
        delta_low=cfg.delta_low, delta_high=cfg.delta_high, eps_low=cfg.eps_low, eps_high=cfg.eps_high,
        is_cap=cfg.is_cap, loss_agg=cfg.loss_agg, temperature=cfg.temperature, rollout_logits=batch.logits,
        validate=validate, **correction_kwargs(cfg))


def update_step(model, optimizer: torch.optim.Optimizer, batch: RolloutBatch, advantages: torch.Tensor,
                cfg: TrainConfig, *, validate: bool = False) -> tuple[PolicyLossOutput, torch.Tensor]:
    """One optimizer step on ``batch``: :func:`compute_loss` -> backward -> clip -> step.

    Gradients are clipped to ``cfg.grad_clip`` (global norm; ``<= 0``: no clipping, the
    norm is still measured). Returns the loss output (at the weights before the step)
    and the pre-clip gradient norm, a detached 0-dim tensor (no host sync).
    """
    out = compute_loss(model, batch, advantages, cfg, validate=validate)
    optimizer.zero_grad(set_to_none=True)
    out.loss.backward()
    gn = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
    optimizer.step()
    return out, gn.detach()
