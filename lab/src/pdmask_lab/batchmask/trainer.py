"""The ``pdm-batch-*`` modes in the built-in trainer: their :class:`pdmask.train.forwards.TrainerForward`.

Imported by :mod:`pdmask_lab.batchmask`, which registers it for the modes that read the per-token extra :data:`DDOT`; the
trainer (library) never imports the lab. One :class:`BatchMask` per (model, optimizer,
settings) is cached: it resolves the parameter subset once and remembers
``method="auto"``'s fallback decision.
"""

from __future__ import annotations

import weakref

import torch

from pdmask._validate import check_choice
from pdmask.engine.base import RolloutBatch
from pdmask.train.config import TrainConfig
from pdmask.train.forwards import register_forward
from .mask import DDOT, METHODS, BatchMask, batch_mode_settings

#: BatchMask diagnostics logged by the batch modes (as ``batch_<name>``)
BATCH_METRICS = ("phi", "direction_norm", "outward_frac_out_of_region", "agree_ratio_frac", "agree_pdm_frac")

# one BatchMask per (model, optimizer, settings): it resolves the parameter subset once and
# remembers method="auto"'s fallback decision
_MASKERS: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def batch_params(cfg: TrainConfig):
    """``cfg.batch_params`` as :class:`pdmask_lab.batchmask.BatchMask` takes it: ``"all"`` or an int N."""
    return "all" if cfg.batch_params == "all" else int(cfg.batch_params)


def batch_masker(model, optimizer: torch.optim.Optimizer | None, cfg: TrainConfig) -> BatchMask:
    """The (cached) :class:`pdmask_lab.batchmask.BatchMask` of ``cfg.loss`` for ``model`` and
    ``optimizer``: its mode's divergence and scope, and the loss's estimator, thresholds,
    sampling and IS cap."""
    spec = cfg.loss
    if optimizer is None:
        raise ValueError(f"optimizer: mode {spec.mode!r} needs the optimizer that takes the step (its state is "
                         "the preconditioner of the batch direction); pass optimizer= to compute_loss")
    divergence, scope = batch_mode_settings(spec.mode)
    key = (id(optimizer), spec, cfg.batch_params, cfg.batch_method)
    hit = _MASKERS.get(model)
    if hit is not None and hit[0] == key and hit[1]() is optimizer:
        return hit[2]
    bm = BatchMask(model, params=batch_params(cfg), optimizer=optimizer, divergence=divergence,
                   estimator=spec.estimator, thresholds=spec.thresholds, scope=scope, method=cfg.batch_method,
                   sampling=spec.sampling, is_cap=spec.corrections.is_cap)
    _MASKERS[model] = (key, weakref.ref(optimizer), bm)
    return bm


def batch_forward(model, optimizer, batch: RolloutBatch, advantages: torch.Tensor, cfg: TrainConfig, *,
                  validate: bool = False) -> tuple[torch.Tensor, dict, dict]:
    """The trainer forward of a ``pdm-batch-*`` mode, with the batch direction computed on it.

    At the current parameters and with ``optimizer``'s current state (the preconditioner
    of the very step the loss is for): one forward (shared with the loss), the backward of
    Phi, ``P``, one forward-mode pass (:class:`pdmask_lab.batchmask.BatchMask`,
    ``share_forward=True``). Returns the (B, T, V) logits with their graph, the
    ``policy_loss`` keywords that apply the mask (``extras``) and the ``batch_*``
    diagnostics (detached).
    """
    bm = batch_masker(model, optimizer, cfg)
    out = bm(batch.sequences, batch.attention_mask, batch.rollout, advantages, validate=validate, share_forward=True)
    more = {f"batch_{k}": out.metrics[k] for k in BATCH_METRICS}
    return out.logits, {"extras": {DDOT: out.ddot}}, more


def check_config(cfg: TrainConfig) -> None:
    """The trainer config's batch settings this forward reads (``batch_method``)."""
    check_choice("batch_method", cfg.batch_method, METHODS)


register_forward(DDOT, batch_forward, check_config)
