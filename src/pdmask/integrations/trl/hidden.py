"""The loss from hidden states inside the model's forward (``loss_from_hidden=True``).

:func:`install` patches the model's ``forward`` (as TRL's own ``add_fused_lm_head``
does): called with ``pdmask_hidden_loss=fn``, it runs the backbone only (no LM head, so
no (B, T, V) logits), then returns ``fn(last_hidden_state, lm_head.weight)`` -- the
trainer's :func:`pdmask.policy_loss_from_hidden` call. Without that keyword it is the
previous forward, so ``generate`` and TRL's own scoring are unchanged.

Why the loss runs *inside* the forward: the trainer calls the wrapped model (DDP / FSDP /
DeepSpeed), so the wrapper's forward stays the entry point. Its pre-forward work
(FSDP's parameter gathering) covers the head weight, and every parameter, the head's
included, is reached from the forward's output, so DDP's unused-parameter search and its
gradient hooks see the same graph as on the logits path.

Naive equivalent: ``fn(model.model(...).last_hidden_state, model.lm_head.weight)`` ==
``policy_loss(model(...).logits, ...)`` for a head that is exactly ``hidden @ W.T``;
:func:`check_head` refuses the others.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext

import torch

#: config attributes that scale or cap the logits after ``hidden @ W.T`` (those TRL's fused head reads)
SCALING_ATTRS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                 "logits_scaling")


def _target(model):
    """The ``PreTrainedModel`` whose forward is patched (PEFT: the base model, as TRL patches it)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def check_head(model, *, cast_lm_head_to_fp32: bool, aux_loss_enabled: bool) -> None:
    """Raise a one-line ``ValueError`` naming ``loss_from_hidden`` if the logits are not ``hidden @ W.T``."""
    m = _target(model)
    cfg = m.config.get_text_config()
    for name in SCALING_ATTRS:
        v = getattr(cfg, name, None)
        if v is not None and v != 1.0:
            raise ValueError(f"loss_from_hidden: the model's {name}={v!r} changes the logits after hidden @ W.T, "
                             "which the hidden-state loss does not compute; set loss_from_hidden=False")
    head = m.get_output_embeddings()
    if type(head) is not torch.nn.Linear:  # PEFT adapters and custom heads are subclasses / other modules
        raise ValueError(f"loss_from_hidden: the LM head is a {type(head).__name__}, not a plain nn.Linear (a PEFT "
                         "adapter on lm_head?); the hidden-state loss uses lm_head.weight only; "
                         "set loss_from_hidden=False")
    if head.bias is not None:
        raise ValueError("loss_from_hidden: the LM head has a bias, which the hidden-state loss does not add; "
                         "set loss_from_hidden=False")
    if "forward" in vars(head) and not cast_lm_head_to_fp32:
        raise ValueError("loss_from_hidden: the LM head's forward is patched (not hidden @ W.T); "
                         "set loss_from_hidden=False")
    if not hasattr(m, "base_model") or m.base_model is m:
        raise ValueError(f"loss_from_hidden: {type(m).__name__} exposes no backbone (base_model) to run without "
                         "its head; set loss_from_hidden=False")
    if aux_loss_enabled:
        raise ValueError("loss_from_hidden: the MoE router auxiliary loss (output_router_logits with "
                         "router_aux_loss_coef != 0) is not computed on the hidden path; set loss_from_hidden=False "
                         "or router_aux_loss_coef=0")


def install(model, *, cast_lm_head_to_fp32: bool) -> None:
    """Patch ``forward`` to accept ``pdmask_hidden_loss=fn`` (see the module docstring)."""
    m = _target(model)
    previous = m.forward  # TRL's fused-head forward (itself falling back to the model's own)

    # Keep the original signature: generate validates its model kwargs against it
    @functools.wraps(type(m).forward)
    def forward(self, *args, pdmask_hidden_loss=None, **kwargs):
        if pdmask_hidden_loss is None:
            return previous(*args, **kwargs)
        kwargs["use_cache"] = False
        kwargs.pop("logits_to_keep", None)
        hidden = self.base_model(*args, **kwargs).last_hidden_state  # (B, L, H), after the final norm
        weight = self.get_output_embeddings().weight  # (V, H)
        if hasattr(weight, "full_tensor"):  # FSDP2 DTensor: gather the head, as TRL's fused head does
            weight = weight.full_tensor()
        hidden = hidden.to(weight.device)
        ctx = nullcontext()
        if cast_lm_head_to_fp32:  # TRL's cast head: float32 hidden @ float32 W, outside autocast
            hidden = hidden.float()
            ctx = torch.autocast(hidden.device.type, enabled=False)
        with ctx:
            return pdmask_hidden_loss(hidden, weight)

    m.forward = forward.__get__(m)
