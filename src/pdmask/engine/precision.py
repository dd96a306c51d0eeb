"""Engine precisions: how the rollout engine's copy of the weights differs from the trainer's.

=========  ===========================================  ==================
name       weights                                      compute (matmuls)
=========  ===========================================  ==================
fp32       float32 copy (bit-identical after a sync)    float32
bf16       cast to bfloat16                             bfloat16
fp16       cast to float16                              float16
fp8        Linear weights of the decoder blocks cast    float32
           through ``torch.float8_e4m3fn`` and back
           with one scale per tensor; embeddings,
           norms and the LM head stay float32
fp8-bf16   same fp8 round trip, then everything cast    bfloat16
           to bfloat16
=========  ===========================================  ==================

The fp8 round trip is what an FP8 inference engine does to the weights (per-tensor
scaled e4m3, the format FP8 rollouts use); activations stay in the compute dtype, so
this simulates weight-only FP8. Naive equivalent of :func:`fp8_roundtrip`::

    s = w.abs().max() / 448                     # 448 = largest finite e4m3 value
    w_hat = (w / s).to(torch.float8_e4m3fn).to(w.dtype) * s
"""

from __future__ import annotations

import torch

from .._validate import check_choice

PRECISIONS = ("fp32", "bf16", "fp16", "fp8", "fp8-bf16")

#: Largest finite value of float8_e4m3fn.
E4M3_MAX = 448.0

_COMPUTE = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.float32,
    "fp8-bf16": torch.bfloat16,
}


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype the engine's matmuls run in."""
    check_precision(precision)
    return _COMPUTE[precision]


def check_precision(precision: str) -> None:
    check_choice("precision", precision, PRECISIONS)


def fp8_roundtrip(w: torch.Tensor) -> torch.Tensor:
    """Per-tensor scaled cast through float8_e4m3fn and back (same dtype as ``w``)."""
    w32 = w.float()
    amax = w32.abs().max()
    if not torch.isfinite(amax):
        raise ValueError("weights: non-finite value in a tensor being cast to fp8")
    scale = (amax / E4M3_MAX).clamp(min=1e-12)
    return ((w32 / scale).to(torch.float8_e4m3fn).float() * scale).to(w.dtype)


def fp8_targets(model: torch.nn.Module) -> set[str]:
    """Parameter names quantised by the fp8 precisions: ``weight`` of every ``nn.Linear``
    that is not the LM head (production FP8 engines keep the head and embeddings high)."""
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = set()
    for mod_name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and mod is not out_emb:
            names.add(f"{mod_name}.weight" if mod_name else "weight")
    return names


@torch.no_grad()
def apply_precision(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], precision: str) -> None:
    """Load ``state_dict`` into ``model`` and convert it to ``precision`` in place.

    The model must already be in the compute dtype of ``precision`` (see
    :func:`compute_dtype`); values are cast on copy. Tied weights are loaded once.
    """
    check_precision(precision)
    targets = fp8_targets(model) if precision.startswith("fp8") else set()
    params = dict(model.named_parameters(remove_duplicate=False))
    params.update(dict(model.named_buffers()))
    for name, p in params.items():
        if name not in state_dict:
            continue
        src = state_dict[name].detach().to(p.device)
        if name in targets:
            src = fp8_roundtrip(src.float())
        p.copy_(src.to(p.dtype))
