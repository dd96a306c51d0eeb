"""The ``autograd.Function`` around a fused implementation: all row statistics in the
forward, the gradient of ``log pi_k`` (and only of it) in the backward."""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

KEYS = ("lse", "logp", "sum_p2", "entropy", "topk_logp", "lse_tail", "sum_p2_tail")
#: the keys that come only with the rollout's top-K (absent without it)
TOPK_KEYS = ("topk_logp", "lse_tail", "sum_p2_tail")


class FusedRowStats(torch.autograd.Function):
    """``(lse, logp, sum_p2, entropy, topk_logp, lse_tail, sum_p2_tail) = f(logits)`` with
    ``logp`` differentiable.

    ``d logp / d logits = (e_k - softmax(logits / T)) / T`` per row; the other outputs
    are marked non-differentiable (the masks use them detached). The backward recomputes
    ``p`` from the saved logits and ``lse``, chunk by chunk (torch) or row by row
    (Triton), so autograd holds no (N, V) float copy.
    """

    @staticmethod
    def forward(ctx, logits, sampled_ids, topk_ids, temperature, chunk_rows, backend, rollout_logits=None,
                full_sink=None):
        # rollout_logits (a backend with FUSES_FULL): the full-vocabulary keys, which carry
        # no gradient, leave through the full_sink dict instead of the output tuple
        kw = _kw(backend, chunk_rows)
        if rollout_logits is not None:
            kw["rollout_logits"] = rollout_logits
        out = backend.forward(logits, sampled_ids, topk_ids, temperature=temperature, **kw)
        if full_sink is not None:
            full_sink.update({k: v for k, v in out.items() if k not in KEYS})
        ctx.save_for_backward(logits, sampled_ids, out["lse"])
        ctx.temperature, ctx.chunk_rows, ctx.backend = temperature, chunk_rows, backend
        return outputs_tuple(ctx, out)

    @staticmethod
    @once_differentiable
    def backward(ctx, g_lse, g_logp, *rest):
        logits, ids, lse = ctx.saved_tensors
        grad = ctx.backend.backward(logits, ids, lse, g_logp, temperature=ctx.temperature,
                                    **_kw(ctx.backend, ctx.chunk_rows))
        return grad, None, None, None, None, None, None, None


def outputs_tuple(ctx, out: dict) -> tuple:
    """The op's dict as the Function's output tuple (:data:`KEYS`); only ``logp`` is
    differentiable.

    Absent top-K keys travel as empty tensors (a Function cannot return None next to
    tensors that need marking); :func:`as_dict` drops them again."""
    res = tuple(out.get(k, out["lse"].new_empty(0)) for k in KEYS)
    ctx.mark_non_differentiable(*(t for k, t in zip(KEYS, res) if k != "logp"))
    return res


def as_dict(res: tuple, has_topk: bool, keys=KEYS) -> dict:
    """A Function's output tuple as the op's dict, without the top-K keys when there are none."""
    out = dict(zip(keys, res))
    if not has_topk:
        for k in TOPK_KEYS:
            del out[k]
    return out


def _kw(backend, chunk_rows) -> dict:
    return {"chunk_rows": chunk_rows} if getattr(backend, "CHUNKED", False) else {}
