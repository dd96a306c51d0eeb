"""The optimizer's preconditioner P: how the next update responds to an extra gradient.

Definition. For an optimizer in its current state, let ``U(g)`` be the parameter change
its next ``step()`` makes when the gradient is ``g``. Then

    U(g0 + g) - U(g0) = -P g + O(|g|^2)    at g0 = 0,

so ``eta P grad l_t`` (with the learning rate inside P) is the first-order change of
theta caused by adding token t's surrogate ``l_t`` to the loss that is minimised (its
gradient ``-grad l_t``). P is diagonal for every optimizer supported here:

- ``optimizer=None``: ``P = I`` (the identity; plain gradient geometry, no learning rate).
- ``torch.optim.SGD`` (lr, momentum mu, dampening tau, nesterov): ``P = lr * s`` with
  ``s = 1`` without momentum; with momentum, ``s = 1`` (non-nesterov) or ``1 + mu``
  (nesterov) before the first step (the buffer starts as a copy of the gradient) and
  ``1 - tau`` or ``1 + mu (1 - tau)`` after. Weight decay adds ``wd theta`` to the
  gradient, independent of ``g``, so it is not part of P.
- ``torch.optim.AdamW`` / ``torch.optim.Adam`` (betas b1, b2, eps, lr), with ``n`` =
  ``state["step"]`` (steps taken so far, 0 when the state is empty) and ``v`` =
  ``state["exp_avg_sq"]`` (zeros when empty)::

      P = lr (1 - b1) / (1 - b1^(n+1)) / ( sqrt( b2 v / (1 - b2^(n+1)) ) + eps )

  i.e. ``1 / (sqrt(v_hat) + eps)`` with ``v_hat`` the bias-corrected second moment the
  next step would use for a vanishing gradient (``b2 v``, corrected with the step count
  ``n + 1`` of that step), times the weight of ``g`` in the next step's bias-corrected
  first moment. With ``amsgrad`` the second moment is ``max(max_exp_avg_sq, b2 v)``.
  The momentum ``b1 m`` and AdamW's decoupled weight decay ``-lr wd theta`` do not
  depend on ``g`` and cancel in the difference.

  What the linearisation at ``g0 = 0`` leaves out: the batch gradient's own ``(1 - b2)
  G^2`` in the next second moment. It is exact for a small batch gradient (what the
  tests check: AdamW's real step with ``+eps g`` and ``-eps g``) and an approximation
  otherwise. Before the first step (empty state) the formula gives ``P = lr / eps``
  (``v = 0``): the SGD direction. The real first AdamW step is sign-like
  (``|G| >> eps``) and not linear in any token's gradient; the mask then behaves as
  with ``optimizer=None``.

  Refused (one-line error): ``maximize=True``; ``torch.optim.Adam`` with
  ``weight_decay > 0`` and no decoupled decay (L2 decay moves the linearisation point
  off ``g0 = 0``); any other optimizer class. Gradient clipping in the trainer scales
  the whole gradient by a factor that itself depends on g; it is not modelled.
"""

from __future__ import annotations

import torch


def _group_of(optimizer, p, name: str) -> dict:
    for group in optimizer.param_groups:
        if any(q is p for q in group["params"]):
            return group
    raise ValueError(f"optimizer: parameter {name!r} is not in any of its param groups")


def _f(x) -> float:
    return float(x.item() if isinstance(x, torch.Tensor) else x)


def _sgd_scale(optimizer, group, p) -> float:
    mu, tau, nesterov = _f(group["momentum"]), _f(group["dampening"]), bool(group["nesterov"])
    if mu == 0:
        s = 1.0
    elif optimizer.state.get(p, {}).get("momentum_buffer") is None:
        s = 1.0 + mu if nesterov else 1.0
    else:
        s = 1.0 + mu * (1.0 - tau) if nesterov else 1.0 - tau
    return _f(group["lr"]) * s


def _adam_diag(optimizer, group, p) -> torch.Tensor:
    b1, b2 = (_f(b) for b in group["betas"])
    eps, lr = _f(group["eps"]), _f(group["lr"])
    state = optimizer.state.get(p, {})
    n = int(_f(state["step"])) if "step" in state else 0
    v = state.get("exp_avg_sq")
    v_next = torch.zeros_like(p.detach()) if v is None else v.detach() * b2  # one parameter-sized buffer
    if group.get("amsgrad", False) and state.get("max_exp_avg_sq") is not None:
        torch.maximum(state["max_exp_avg_sq"].detach(), v_next, out=v_next)
    bc1, bc2 = 1.0 - b1 ** (n + 1), 1.0 - b2 ** (n + 1)
    return v_next.div_(bc2).sqrt_().add_(eps).reciprocal_().mul_(lr * (1.0 - b1) / bc1)


def _check_optimizer(optimizer) -> bool:
    """Whether it is an Adam-family optimizer (else SGD); refuses every other class."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer: expected None or a torch.optim.Optimizer, got {type(optimizer).__name__}")
    is_adam = isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
    if not is_adam and not isinstance(optimizer, torch.optim.SGD):
        raise ValueError(f"optimizer: {type(optimizer).__name__} is not supported; use None (identity), "
                         "torch.optim.SGD, torch.optim.Adam or torch.optim.AdamW")
    return is_adam


def _checked_group(optimizer, is_adam: bool, p, name: str) -> dict:
    group = _group_of(optimizer, p, name)
    if group.get("maximize", False):
        raise ValueError("optimizer: maximize=True is not supported (the mask assumes the loss is minimised)")
    if is_adam:
        decoupled = isinstance(optimizer, torch.optim.AdamW) or group.get("decoupled_weight_decay", False)
        if _f(group["weight_decay"]) != 0 and not decoupled:
            raise ValueError("optimizer: torch.optim.Adam with L2 weight_decay > 0 is not supported "
                             "(use AdamW or decoupled_weight_decay=True)")
    return group


def check(optimizer, params: list, names: list[str]) -> None:
    """Refuse an optimizer (or a parameter outside it) before any work is done."""
    if optimizer is not None:
        is_adam = _check_optimizer(optimizer)
        for p, name in zip(params, names):
            _checked_group(optimizer, is_adam, p, name)


def _diags(optimizer, params, names):
    if optimizer is None:
        for _ in params:
            yield 1.0
        return
    is_adam = _check_optimizer(optimizer)
    for p, name in zip(params, names):
        group = _checked_group(optimizer, is_adam, p, name)
        yield _adam_diag(optimizer, group, p) if is_adam else _sgd_scale(optimizer, group, p)


def preconditioner(optimizer, params: list, names: list[str]) -> list:
    """Diagonal P per parameter: a float (scalar times identity) or a tensor like the parameter."""
    return list(_diags(optimizer, params, names))


def precondition_(optimizer, params: list, names: list[str], grads: list) -> list:
    """``P g`` in place of each gradient, one parameter at a time (no second copy of theta)."""
    for g, d in zip(grads, _diags(optimizer, params, names)):
        g.mul_(d.to(g.dtype) if isinstance(d, torch.Tensor) else d)
    return grads
