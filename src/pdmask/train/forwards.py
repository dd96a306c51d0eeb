"""Trainer forwards for the modes that need more than the logits.

A mode whose ``extras`` name a per-token tensor that the rollout does not carry (the
``pdm-batch-*`` modes' batch direction) gets it from a :class:`TrainerForward`, registered by the package
that computes it when that package is imported (:mod:`pdmask_lab.batchmask`). The trainer
looks forwards up here (:func:`forward_for`, in :func:`pdmask.train.update.compute_loss`
and :meth:`pdmask.train.config.TrainConfig.validate`) and never imports that package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..masks import get_mode


@dataclass(frozen=True)
class TrainerForward:
    """A trainer forward for the modes that need more than the logits: it runs the model
    once, computes that extra input on the same forward, and says how the loss takes it.

    ``forward(model, optimizer, batch, advantages, cfg, *, validate)`` returns the (B, T, V)
    logits with their graph, the keyword arguments of the loss call that carry the extra
    input, and detached metrics. ``check(cfg)`` refuses the config fields the forward
    reads, with one line naming the field (:meth:`TrainConfig.validate` calls it)."""

    forward: Callable
    check: Callable | None = None


#: ``MaskMode.extras`` name -> the forward that provides it. The package that computes the
#: input registers it when imported (the ``pdm-batch-*`` modes' batch direction:
#: :mod:`pdmask_lab.batchmask`), so the trainer never imports it.
FORWARDS: dict[str, TrainerForward] = {}
def register_forward(extra: str, forward: Callable, check: Callable | None = None) -> None:
    """Register the trainer forward of the modes that read the per-token extra ``extra``
    (replaces an earlier one)."""
    FORWARDS[extra] = TrainerForward(forward, check)


def forward_for(mode) -> TrainerForward | None:
    """The registered forward of ``mode`` (a name or a :class:`pdmask.MaskMode`), None when
    the plain forward serves it; a need nobody registered is refused, naming ``mode``."""
    mm = get_mode(mode)
    extra = list(mm.extras)
    missing = [n for n in extra if n not in FORWARDS]
    if missing:
        raise ValueError(f"mode: {mm.name!r} reads the per-token {missing[0]}, computed by a trainer forward that is not "
                         "registered; import the package that provides it (pdmask_lab.batchmask for the "
                         "pdm-batch-* modes; the pdmask command line does)")
    return FORWARDS[extra[0]] if extra else None
