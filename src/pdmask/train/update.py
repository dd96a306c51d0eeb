"""One policy update on a rollout batch: the trainer's optimizer, the loss, the step.

- :func:`make_optimizer` — the trainer's AdamW (betas :data:`ADAMW_BETAS`).
- :func:`select` — rows of a rollout batch (a mini-batch) with padding columns trimmed.
- :func:`compute_loss` — one trainer forward (:func:`trainer_forward`), then the loss
  (:func:`forward_loss`: :func:`pdmask.policy_loss` on the logits, or
  :func:`pdmask.policy_loss_from_hidden` on the final hidden states with
  ``loss_from=hidden``); for the ``pdm-batch-*`` modes the batch direction is computed on
  that same forward first (:func:`batch_forward`).
- :func:`update_step` — loss -> backward -> clip -> optimizer step (one mini-batch).

The training loop (:mod:`.grpo`) and the direction audit's lag steps both update the
policy with these, so the two cannot drift apart.
"""

from __future__ import annotations

import math
import weakref

import torch

from ..lab.batchmask import BatchMask
from ..engine.base import RolloutBatch
from ..engine.hf import response_hidden, response_logits
from ..loss import PolicyLossOutput
from ..masks import get_mode
from .config import TrainConfig, effective_is_cap, loss_spec
from .trainable import trainable_parameters

#: AdamW betas of the built-in trainer (the audit starts its batch step from the same)
ADAMW_BETAS = (0.9, 0.99)


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """The trainer's optimizer over the trainable parameters only (frozen ones carry no
    AdamW state): ``AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
    weight_decay=cfg.weight_decay, betas=ADAMW_BETAS)``."""
    return torch.optim.AdamW(trainable_parameters(model), lr=cfg.lr, weight_decay=cfg.weight_decay,
                             betas=ADAMW_BETAS)


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
                 validate: bool = False, optimizer: torch.optim.Optimizer | None = None) -> PolicyLossOutput:
    """The batch loss: one trainer forward, then :func:`pdmask.policy_loss`.

    Args:
        model: the trainer's causal LM.
        batch: rollout tokens with the engine's ``log mu_k`` and top-K of mu.
        advantages: (B,) per-sequence advantages (broadcast over the response tokens).
        cfg: its loss settings (:func:`pdmask.train.config.loss_spec`: mode, estimator,
            thresholds, corrections, the engine's sampling, aggregation; the rollout's
            ``logits`` feed the ``*-full-*`` modes when present); for the ``pdm-batch-*``
            modes also batch_params, batch_method.
        validate: pass through to ``policy_loss`` (off on the trainer's hot path, where
            the engine's outputs are known good).
        optimizer: the optimizer that will take the step this loss is for. Required by
            the ``pdm-batch-*`` modes (its current state is the preconditioner P of the
            batch direction, :func:`batch_forward`); ignored by the others.

    Returns :class:`pdmask.PolicyLossOutput` (``loss`` differentiable, ``metrics`` detached;
    the batch modes add the direction's diagnostics as ``batch_*`` metrics).
    """
    adv = advantages.to(batch.sequences.device)
    if is_batch_mode(cfg.mode):  # loss_from=logits (the config refuses hidden here)
        logits, extra, more = batch_forward(model, optimizer, batch, adv, cfg, validate=validate)  # (B, T, V)
        out = loss_spec(cfg, validate=validate)(logits, batch.rollout, adv, **extra)
        out.metrics.update(more)
        return out
    return forward_loss(model, trainer_forward(model, batch, cfg), batch, adv, cfg, validate=validate)


def trainer_forward(model, batch: RolloutBatch, cfg: TrainConfig) -> torch.Tensor:
    """The trainer forward the loss reads: (B, T, V) logits (``loss_from=logits``) or
    (B, T, H) final hidden states (``loss_from=hidden``), at the response positions."""
    if cfg.loss_from == "hidden":
        return response_hidden(model, batch.sequences, batch.attention_mask, batch.prompt_len)  # (B, T, H)
    return response_logits(model, batch.sequences, batch.attention_mask, batch.prompt_len)  # (B, T, V)


def forward_loss(model, x: torch.Tensor, batch: RolloutBatch, advantages: torch.Tensor, cfg: TrainConfig, *,
                 validate: bool = False) -> PolicyLossOutput:
    """The loss of :func:`trainer_forward`'s output ``x``.

    ``loss_from=logits``: ``loss_spec(cfg)(x, rollout, A)``. ``loss_from=hidden``:
    ``loss_spec(cfg).from_hidden(x, W, rollout, A)`` with ``W`` the LM-head weight. That
    is the same loss as ``loss_spec(cfg)(x @ W.T, rollout, A)`` up to rounding, but the
    (B, T, V) logits are made and reduced in column chunks and never kept for the
    backward. The rollout's full logits, when present (the audit's oracle view), are
    left out there. They feed only the ``*-full-*`` terms, which the config refuses with
    ``loss_from=hidden``."""
    spec = loss_spec(cfg, validate=validate)
    if cfg.loss_from == "hidden":
        r = batch.rollout if batch.rollout.logits is None else batch.rollout.replace(logits=None)
        return spec.from_hidden(x, lm_head_weight(model), r, advantages)
    return spec(x, batch.rollout, advantages)


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


# ------------------------------------------------------------------ pdm-batch-* modes
#: BatchMask diagnostics logged by the batch modes (as ``batch_<name>``)
BATCH_METRICS = ("phi", "direction_norm", "outward_frac_out_of_region", "agree_ratio_frac", "agree_pdm_frac")

# one BatchMask per (model, optimizer, settings): it resolves the parameter subset once and
# remembers method="auto"'s fallback decision
_MASKERS: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def is_batch_mode(mode: str) -> bool:
    """Whether ``mode`` needs the batch direction (``pdm-batch-*``)."""
    return "batch" in get_mode(mode).needs


def batch_params(cfg: TrainConfig):
    """``cfg.batch_params`` as :class:`pdmask.lab.batchmask.BatchMask` takes it: ``"all"`` or an int N."""
    return "all" if cfg.batch_params == "all" else int(cfg.batch_params)


def batch_masker(model, optimizer: torch.optim.Optimizer | None, cfg: TrainConfig) -> BatchMask:
    """The (cached) :class:`pdmask.lab.batchmask.BatchMask` of ``cfg.mode`` for ``model`` and ``optimizer``."""
    if optimizer is None:
        raise ValueError(f"optimizer: mode {cfg.mode!r} needs the optimizer that takes the step (its state is "
                         "the preconditioner of the batch direction); pass optimizer= to compute_loss")
    mode = get_mode(cfg.mode)
    key = (id(optimizer), cfg.mode, cfg.batch_params, cfg.batch_method, cfg.estimator, cfg.delta_low,
           cfg.delta_high, cfg.temperature, effective_is_cap(cfg))
    hit = _MASKERS.get(model)
    if hit is not None and hit[0] == key and hit[1]() is optimizer:
        return hit[2]
    bm = BatchMask(model, params=batch_params(cfg), optimizer=optimizer, divergence=mode.divergence,
                   estimator=cfg.estimator, delta_low=cfg.delta_low, delta_high=cfg.delta_high,
                   scope="all" if cfg.mode.startswith("pdm-batch-all-") else "region", method=cfg.batch_method,
                   temperature=cfg.temperature, is_cap=effective_is_cap(cfg))
    _MASKERS[model] = (key, weakref.ref(optimizer), bm)
    return bm


def batch_forward(model, optimizer, batch: RolloutBatch, advantages: torch.Tensor, cfg: TrainConfig, *,
                  validate: bool = False) -> tuple[torch.Tensor, dict, dict]:
    """The trainer forward of a ``pdm-batch-*`` mode, with the batch direction computed on it.

    At the current parameters and with ``optimizer``'s current state (the preconditioner
    of the very step the loss is for): one forward (shared with the loss), the backward of
    Phi, ``P``, one forward-mode pass (:class:`pdmask.lab.batchmask.BatchMask`,
    ``share_forward=True``). Returns the (B, T, V) logits with their graph, the
    ``policy_loss`` keywords that apply the mask (``batch_ddot``) and the ``batch_*``
    diagnostics (detached).
    """
    bm = batch_masker(model, optimizer, cfg)
    out = bm(batch.sequences, batch.attention_mask, batch.rollout, advantages, validate=validate, share_forward=True)
    more = {f"batch_{k}": out.metrics[k] for k in BATCH_METRICS}
    return out.logits, {"batch_ddot": out.ddot}, more


def update_step(model, optimizer: torch.optim.Optimizer, batch: RolloutBatch, advantages: torch.Tensor,
                cfg: TrainConfig, *, validate: bool = False) -> tuple[PolicyLossOutput, torch.Tensor]:
    """One optimizer step on ``batch``: :func:`compute_loss` -> backward -> clip -> step.

    Gradients are clipped to ``cfg.grad_clip`` (global norm; ``<= 0``: no clipping, the
    norm is still measured). Returns the loss output (at the weights before the step)
    and the pre-clip gradient norm, a detached 0-dim tensor (no host sync).
    """
    out = compute_loss(model, batch, advantages, cfg, validate=validate, optimizer=optimizer)
    optimizer.zero_grad(set_to_none=True)
    out.loss.backward()
    params = [p for g in optimizer.param_groups for p in g["params"]]  # the trained ones (frozen: no grad)
    gn = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
    optimizer.step()
    return out, gn.detach()
