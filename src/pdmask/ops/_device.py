"""Device checks for the Triton path that must run before Triton is imported."""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """``TRITON_INTERPRET=1``: Triton runs kernels on CPU tensors in its interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_device(logits: torch.Tensor) -> None:
    if not logits.is_cuda and not interpreting():
        raise ValueError(
            f"impl: 'triton' needs CUDA tensors (got logits on {logits.device}); on CPU use "
            "impl='torch' or 'auto', or set TRITON_INTERPRET=1 before triton is first imported "
            "to run the kernel in Triton's (slow) interpreter"
        )
