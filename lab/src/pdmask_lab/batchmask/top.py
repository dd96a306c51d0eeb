"""Forward mode over the top blocks only (``params=N``): replay them from captured inputs.

For the last-N variant the tangent is zero below block ``L - N``, yet a JVP of the whole
model would recompute the primal of every lower block. So the first forward (the one
that gives Phi) records, with forward pre-hooks, the inputs of each top block (the
hidden state entering block ``L - N`` and every block's other arguments: attention mask,
rotary tables, ...), and the JVP replays only::

    h = captured hidden state;  h = block(h, *its args, **its kwargs) for the top blocks
    logits = head(norm(h[:, -T:]))

This is the structure of transformers' decoder-only LMs (Llama, Qwen2/3, Mistral). A
model that does anything else between the last block and the logits (a logit scale or
soft-cap, say) is caught by comparing the replay's primal log-probs with the first
forward's; :func:`jvp_top_logprob` then returns None and the whole-model JVP is used.
"""

from __future__ import annotations

import torch
from torch.func import functional_call, jvp

from pdmask.train.frozen_prefix import split_block_call
from .directional import math_attention, sampled_logprob


class TopCapture:
    """Forward pre-hooks that record the inputs of the top blocks during one forward."""

    def __init__(self, blocks: list):
        self.calls: dict[int, tuple] = {}
        self.n = len(blocks)
        self.handles = [m.register_forward_pre_hook(self._hook(i), with_kwargs=True)
                        for i, (_, m) in enumerate(blocks)]

    def _hook(self, i):
        def hook(module, args, kwargs):
            h, rest, kw = split_block_call(args, kwargs)
            # only the first block's hidden state is kept; the later ones are recomputed
            self.calls[i] = (h.detach() if i == 0 and isinstance(h, torch.Tensor) else None, rest, kw)

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    @property
    def complete(self) -> bool:
        return len(self.calls) == self.n and self.calls.get(0, (None,))[0] is not None


def _local(named: dict, prefix: str) -> dict:
    p = prefix + "."
    return {n[len(p):]: t for n, t in named.items() if n.startswith(p)}


def jvp_top_logprob(subset, capture: TopCapture, primals, tangents, ids, temperature,
                    reference_logp: torch.Tensor, valid: torch.Tensor):
    """``J v`` (B, T) by forward mode through the top blocks only, or None when the replay
    does not reproduce ``reference_logp`` (the first forward's log pi, on ``valid``)."""
    top = subset.top
    T = ids.shape[1]

    def f(*xs):
        named = {n: x for names, x in zip(subset.names, xs) for n in names}
        h = capture.calls[0][0]
        for i, (name, block) in enumerate(top.blocks):
            _, rest, kw = capture.calls[i]
            out = functional_call(block, _local(named, name), (h, *rest), kw, strict=False)
            h = out[0] if isinstance(out, (tuple, list)) else out
        h = h[:, h.shape[1] - T:]
        if top.norm is not None:
            h = functional_call(top.norm[1], _local(named, top.norm[0]), (h,), strict=False)
        logits = functional_call(top.head[1], _local(named, top.head[0]), (h,), strict=False)
        return sampled_logprob(logits, ids, temperature)

    with torch.no_grad(), math_attention():
        primal, d = jvp(f, tuple(primals), tuple(t.to(p.dtype) for p, t in zip(primals, tangents)))
    ref = reference_logp.to(primal.dtype)
    tol = 1e-9 if primal.dtype == torch.float64 else 1e-3
    same = torch.isclose(primal, ref, rtol=tol, atol=tol) | ~valid
    return d if bool(same.all()) else None
