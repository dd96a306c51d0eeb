"""Calling the model functionally, and ``J v``: every token's ``<grad log pi_t, v>`` at once.

The model is called as a causal LM on ``input_ids[:, :-1]``::

    model(input_ids=..., attention_mask=..., [position_ids=..., use_cache=False, logits_to_keep=T])

(the bracketed keywords only when its ``forward`` accepts them; ``position_ids`` count
real tokens, so left padding does not shift RoPE, as in :mod:`pdmask.engine.hf`). It
returns logits (B, L - 1, V) or an object with ``.logits``; the last T positions predict
the T response tokens ``input_ids[:, -T:]``.

Two ways to get ``J v = d/de log pi_t(theta + e v)`` for all t, without ever holding a
per-token gradient:

- ``"jvp"``: one forward-mode pass, :func:`torch.func.jvp` over
  :func:`torch.func.functional_call` (cost: one forward carrying tangents).
- ``"double-backward"``: with ``y = log pi`` (B, T) and a dummy ``u`` (B, T),
  ``h(u) = J^T u = autograd.grad(y, theta, u, create_graph=True)`` is linear in u, so
  ``autograd.grad(h, u, v) = J v`` (cost: a backward that builds its own graph, then
  a backward through it; it reuses the forward that gave Phi).

Attention runs on PyTorch's math SDPA backend in these passes: the fused CPU/CUDA
kernels have neither a forward-mode derivative nor a double backward. The math
backend materialises the (L, L) attention scores, which is fine at RL lengths on CPU
and costs memory at long contexts on GPU.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch.func import functional_call, jvp

from pdmask.ops import compute_dtype


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counting real tokens only (left padding does not shift RoPE)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def math_attention():
    """Context: SDPA on the math backend (differentiable twice and in forward mode)."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # pragma: no cover - torch < 2.3
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.MATH])


def _accepted(model) -> set[str]:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
        return set()


def response_logits(model, tensors: dict, input_ids, attention_mask, T: int) -> torch.Tensor:
    """(B, T, V) logits of the response positions with the parameters ``tensors``."""
    ok = _accepted(model)
    am = attention_mask[:, :-1]
    kw = {"input_ids": input_ids[:, :-1], "attention_mask": am.long()}
    if "position_ids" in ok:
        kw["position_ids"] = position_ids(am)
    if "use_cache" in ok:
        kw["use_cache"] = False
    if "logits_to_keep" in ok:
        kw["logits_to_keep"] = T
    out = functional_call(model, tensors, (), kw, tie_weights=False, strict=False)
    logits = getattr(out, "logits", out)
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or logits.shape[1] < T:
        raise ValueError(f"model: expected logits (B, L - 1, V) from the forward, got "
                         f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}")
    return logits[:, logits.shape[1] - T:]


def sampled_logprob(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log pi_k`` (B, T) with ``pi = softmax(logits / T)``, in the compute dtype (differentiable)."""
    z = logits.to(compute_dtype(logits.dtype)) / temperature
    return z.gather(-1, ids[..., None]).squeeze(-1) - torch.logsumexp(z, -1)


def jvp_logprob(model, subset, primals, tangents, input_ids, attention_mask, ids, temperature) -> torch.Tensor:
    """``J v`` (B, T) by one forward-mode pass (raises NotImplementedError for ops without forward AD)."""
    T = ids.shape[1]

    def f(*xs):
        logits = response_logits(model, subset.tensors(xs), input_ids, attention_mask, T)
        return sampled_logprob(logits, ids, temperature)

    with torch.no_grad(), math_attention():
        _, d = jvp(f, tuple(primals), tuple(t.to(p.dtype) for p, t in zip(primals, tangents)))
    return d


def double_backward_logprob(logp: torch.Tensor, leaves, tangents) -> torch.Tensor:
    """``J v`` (B, T) from a graph of ``logp`` (B, T) over ``leaves`` (see the module doc)."""
    u = torch.zeros_like(logp, requires_grad=True)
    h = torch.autograd.grad(logp, leaves, grad_outputs=u, create_graph=True, allow_unused=True)
    pairs = [(a, t) for a, t in zip(h, tangents) if a is not None and a.requires_grad]
    if not pairs:
        return torch.zeros_like(logp)
    (jv,) = torch.autograd.grad([a for a, _ in pairs], u, grad_outputs=[t.to(a.dtype) for a, t in pairs],
                                allow_unused=True)
    return torch.zeros_like(logp) if jv is None else jv.detach()


def is_missing_forward_ad(err: BaseException) -> bool:
    """Whether an error means "this op has no forward-mode derivative" (then fall back)."""
    msg = str(err).lower()
    return isinstance(err, (NotImplementedError, RuntimeError)) and ("forward ad" in msg or "forward-mode" in msg
                                                                      or "forward mode" in msg or "jvp" in msg)
