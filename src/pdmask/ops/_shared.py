"""What the backends share with the package, in a leaf module (no import cycle): Triton's
interpreter switch, read before Triton is imported, and the tail of a row with its own max."""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """``TRITON_INTERPRET=1``: Triton runs kernels on CPU tensors in its interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def tail_rows(z: torch.Tensor, sup: torch.Tensor, lse: torch.Tensor,
              keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lse_tail, sum_p2_tail)`` of scaled logits ``z`` (r, V) over the ids outside ``sup``
    (and inside ``keep``), with the tail's own max: the rows whose tail a pass's running max
    could have flushed. Naive: ``logsumexp(z.scatter(1, sup, -inf))``."""
    zt = z.masked_fill(~keep, float("-inf")) if keep is not None else z.clone()
    zt.scatter_(1, sup, float("-inf"))
    inside = zt > float("-inf")
    p2 = torch.where(inside, torch.exp(2 * (zt - lse[:, None])), torch.zeros_like(zt)).sum(-1)
    return torch.logsumexp(zt, -1), p2
