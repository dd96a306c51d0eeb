"""One policy update on a rollout batch: the trainer's optimizer, the loss, the step.

- :func:`build_optimizer` — the one optimizer factory (the trainer's AdamW, betas
  :data:`ADAMW_BETAS`; the SFT warm start's; the audit's batch steps), with the
  hyperparameters re-applied after a loaded state; :func:`make_optimizer` — the
  trainer's, over its trainable parameters.
- :func:`select` — rows of a rollout batch (a mini-batch) with padding columns trimmed.
- :func:`compute_loss` — one trainer forward (:func:`trainer_forward`), then the loss
  (:func:`forward_loss`: :func:`pdmask.policy_loss` on the logits, or
  :func:`pdmask.policy_loss_from_hidden` on the final hidden states with
  ``loss_from=hidden``); a mode that needs more than the logits (the ``pdm-batch-*``
  modes' batch direction) gets it from its registered :class:`TrainerForward`
  (:func:`pdmask.train.forwards.register_forward`), on that same forward.
- :func:`update_step` — loss -> backward -> clip -> optimizer step (one mini-batch).

The training loop (:mod:`.grpo`) and the direction audit's lag steps both update the
policy with these, so the two cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..engine.base import RolloutBatch
from ..engine.hf import response_hidden, response_logits
from .._validate import check_choice
from ..loss import PolicyLossOutput
from ..ops import Hidden
from .config import TrainConfig
from .forwards import forward_for
from .trainable import trainable_parameters

#: AdamW betas of the built-in trainer (the audit starts its batch step from the same)
ADAMW_BETAS = (0.9, 0.99)
#: Optimizers :func:`make_optimizer` makes (the audit's batch step may use any of them).
OPTIMIZERS = ("adamw", "adam", "sgd")


def build_optimizer(params, *, lr: float, weight_decay: float = 0.0, betas=ADAMW_BETAS, kind: str = "adamw",
                    state: dict | None = None) -> torch.optim.Optimizer:
    """An optimizer over ``params``: ``torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay,
    betas=betas)`` (``kind="adam"``: ``Adam``; ``"sgd"``: ``SGD(params, lr=lr, weight_decay=weight_decay)``).

    ``state``: an ``optimizer.state_dict()`` of the same kind over the same parameters
    (a training checkpoint's, the audit's lag steps'), loaded from a copy (never changed);
    its moments are kept and *these* hyperparameters re-applied to every group, since
    ``load_state_dict`` restores the saved ones. An Adam(W) state given to ``sgd`` is
    refused, naming ``optimizer_state``."""
    import copy

    check_choice("optimizer", kind, OPTIMIZERS)
    params = list(params)
    if kind == "sgd":
        if state is not None:
            raise ValueError("optimizer_state: given with optimizer='sgd'; a saved state is an Adam(W) state")
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
    opt = cls(params, lr=lr, betas=betas, weight_decay=weight_decay)
    if state is not None:
        opt.load_state_dict(copy.deepcopy(state))  # the moments (cast to the parameters' dtype by torch)
        for g in opt.param_groups:  # the state's moments, this call's hyperparameters
            g.update(lr=lr, betas=tuple(betas), weight_decay=weight_decay)
    return opt


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """The trainer's optimizer over the trainable parameters only (frozen ones carry no
    AdamW state): ``build_optimizer(trainable_parameters(model), lr=cfg.lr,
    weight_decay=cfg.weight_decay)``."""
    return build_optimizer(trainable_parameters(model), lr=cfg.lr, weight_decay=cfg.weight_decay)


def select(batch: RolloutBatch, idx: list[int], prompt_lens: list[int], response_lens: list[int]) -> RolloutBatch:
    """Rows ``idx`` of a rollout batch with all-padding prompt/response columns trimmed.

    ``prompt_lens`` / ``response_lens`` are the per-row real lengths as host ints (read
    once per step, so slicing mini-batches never syncs)."""
    P = batch.prompt_len
    p0 = P - max(prompt_lens[i] for i in idx)  # first prompt column any selected row uses
    T = max(1, max(response_lens[i] for i in idx))
    ix = torch.as_tensor(idx, device=batch.sequences.device)
    r = batch.rollout
    cut = {name: None if t is None else t[ix, :T] for name, t in (
        ("sampled_ids", r.sampled_ids), ("sampled_logprob", r.sampled_logprob), ("topk_ids", r.topk_ids),
        ("topk_logprobs", r.topk_logprobs), ("response_mask", r.response_mask), ("kept_mask", r.kept_mask),
        ("logits", r.logits))}
    return RolloutBatch(sequences=batch.sequences[ix, p0:P + T], attention_mask=batch.attention_mask[ix, p0:P + T],
                        prompt_len=P - p0, rollout=r.replace(**cut))


def compute_loss(model, batch: RolloutBatch, advantages: torch.Tensor, cfg: TrainConfig, *,
                 validate: bool | None = None, optimizer: torch.optim.Optimizer | None = None,
                 anchor=None, prefix=None) -> PolicyLossOutput:
    """The batch loss: one trainer forward, then :func:`pdmask.policy_loss`.

    Args:
        model: the trainer's causal LM.
        batch: rollout tokens with the engine's ``log mu_k`` and top-K of mu.
        advantages: (B,) per-sequence advantages (broadcast over the response tokens).
        cfg: its loss is ``cfg.loss``, the one :class:`pdmask.PolicyLoss` (mode, estimator,
            thresholds, corrections, the engine's sampling, aggregation; the rollout's
            ``logits`` feed the ``*-full-*`` modes when present); for the ``pdm-batch-*``
            modes also batch_params, batch_method.
        validate: replaces ``cfg.loss.validate`` for this call (None: the config's; the
            trainer's default is off on its hot path, where the engine's outputs are known
            good).
        optimizer: the optimizer that will take the step this loss is for. Required by
            the ``pdm-batch-*`` modes (its current state is the preconditioner P of the
            batch direction, :mod:`pdmask_lab.batchmask`); ignored by the others.
        anchor: pi_old's :class:`pdmask.Anchor` for this batch (``anchor: old``), else None.
        prefix: this batch's cached frozen prefix (:class:`pdmask.train.frozen_prefix.PrefixRows`,
            ``frozen_prefix_cache``): the forward runs the trained blocks only; None: the whole model.

    Returns :class:`pdmask.PolicyLossOutput` (``loss`` differentiable, ``metrics`` detached;
    the batch modes add the direction's diagnostics as ``batch_*`` metrics).
    """
    adv = advantages.to(batch.sequences.device)
    spec = loss_of(cfg, validate)
    fwd = forward_for(spec.mode)
    if fwd is not None:  # loss_from=logits (the config refuses hidden here)
        logits, extra, more = fwd.forward(model, optimizer, batch, adv, cfg, validate=spec.validate)  # (B, T, V)
        out = spec(logits, batch.rollout, adv, anchor=anchor, **extra)
        out.metrics.update(more)
        return out
    return forward_loss(model, trainer_forward(model, batch, cfg, prefix), batch, adv, cfg, validate=spec.validate,
                        anchor=anchor)


def loss_of(cfg: TrainConfig, validate: bool | None = None):
    """``cfg.loss``, with ``validate`` in place of its own when given."""
    if validate is None or validate == cfg.loss.validate:
        return cfg.loss
    return dataclasses.replace(cfg.loss, validate=validate)


def trainer_forward(model, batch: RolloutBatch, cfg: TrainConfig, prefix=None) -> torch.Tensor:
    """The trainer forward the loss reads: (B, T, V) logits (``loss_from=logits``) or
    (B, T, H) final hidden states (``loss_from=hidden``), at the response positions;
    from the cached frozen prefix ``prefix`` when given (the same numbers, :mod:`.frozen_prefix`)."""
    if prefix is not None:
        return prefix.forward(model, batch, hidden=cfg.loss_from == "hidden")
    if cfg.loss_from == "hidden":
        return response_hidden(model, batch.sequences, batch.attention_mask, batch.prompt_len)  # (B, T, H)
    return response_logits(model, batch.sequences, batch.attention_mask, batch.prompt_len)  # (B, T, V)


def forward_loss(model, x: torch.Tensor, batch: RolloutBatch, advantages: torch.Tensor, cfg: TrainConfig, *,
                 validate: bool | None = None, anchor=None) -> PolicyLossOutput:
    """The loss of :func:`trainer_forward`'s output ``x``.

    ``loss_from=logits``: ``cfg.loss(x, rollout, A)``. ``loss_from=hidden``:
    ``cfg.loss(Hidden(x, W), rollout, A)`` with ``W`` the LM-head weight. That
    is the same loss as ``cfg.loss(x @ W.T, rollout, A)`` up to rounding, but the
    (B, T, V) logits are made and reduced in row chunks and never kept for the
    backward. The rollout's full logits, when present (the audit's oracle view), are
    left out there. They feed only the ``*-full-*`` terms, which the config refuses with
    ``loss_from=hidden``."""
    spec = loss_of(cfg, validate)
    if cfg.loss_from == "hidden":
        r = batch.rollout if batch.rollout.logits is None else batch.rollout.replace(logits=None)
        return spec(Hidden(x, lm_head_weight(model)), r, advantages, anchor=anchor)
    return spec(x, batch.rollout, advantages, anchor=anchor)


def lm_head_weight(model) -> torch.Tensor:
    """The (V, H) LM-head weight, for ``loss_from=hidden``. The head must be a plain
    product ``h @ W.T``: no bias, no logit scaling or soft-capping (one line naming
    ``loss_from`` otherwise)."""
    head = model.get_output_embeddings()
    conf = getattr(model, "config", None)
    extra = [k for k in ("final_logit_softcapping", "logit_scale", "output_multiplier_scale")
             if getattr(conf, k, None) not in (None, 1, 1.0)]
    if not isinstance(head, torch.nn.Linear) or head.bias is not None or extra:
        why = (f"{', '.join(extra)} set" if extra else "a bias" if isinstance(head, torch.nn.Linear)
               else f"a {type(head).__name__}")
        raise ValueError(f"loss_from: hidden needs an LM head that is a plain h @ W.T; {type(model).__name__}'s "
                         f"has {why}; use loss_from=logits")
    return head.weight


def update_step(model, optimizer: torch.optim.Optimizer, batch: RolloutBatch, advantages: torch.Tensor,
                cfg: TrainConfig, *, validate: bool | None = None, anchor=None,
                prefix=None) -> tuple[PolicyLossOutput, torch.Tensor]:
    """One optimizer step on ``batch``: :func:`compute_loss` -> backward -> clip -> step.

    Gradients are clipped to ``cfg.grad_clip`` (global norm; ``<= 0``: no clipping, the
    norm is still measured). Returns the loss output (at the weights before the step)
    and the pre-clip gradient norm, a detached 0-dim tensor (no host sync).
    """
    out = compute_loss(model, batch, advantages, cfg, validate=validate, optimizer=optimizer, anchor=anchor,
                       prefix=prefix)
    optimizer.zero_grad(set_to_none=True)
    out.loss.backward()
    params = [p for g in optimizer.param_groups for p in g["params"]]  # the trained ones (frozen: no grad)
    gn = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
    optimizer.step()
    return out, gn.detach()
