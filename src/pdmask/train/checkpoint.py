"""Resumable checkpoints: ``run_dir/checkpoints/step-NNNNNN/``.

Contents: ``model.safetensors`` (trainer weights), ``engine.safetensors`` (the engine's
own, possibly stale and low-precision, weights, when the backend exposes them),
``optimizer.pt`` (AdamW state), ``state.pt`` (step, data position, python/numpy/torch
RNG states). A checkpoint is written into a temporary directory and renamed when
complete, so a SIGKILL while saving leaves the previous checkpoint intact.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import numpy as np
import torch


def ckpt_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    root = ckpt_root(run_dir)
    if not root.exists():
        return None
    done = sorted(p for p in root.glob("step-*") if (p / "state.pt").exists())
    return done[-1] if done else None


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(s: dict) -> None:
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])


def _contiguous(sd: dict) -> dict:
    # safetensors refuses shared storage (tied embeddings): save each name once, cloned
    return {k: v.detach().contiguous().clone() for k, v in sd.items()}


def save_checkpoint(run_dir, *, step: int, model, optimizer, engine=None, extra: dict | None = None,
                    keep: int = 1) -> Path:
    from safetensors.torch import save_file

    root = ckpt_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-step-{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(_contiguous(model.state_dict()), str(tmp / "model.safetensors"))
    if engine is not None and hasattr(engine, "state_dict"):
        save_file(_contiguous(engine.state_dict()), str(tmp / "engine.safetensors"))
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save({"step": step, "rng": rng_state(), **(extra or {})}, tmp / "state.pt")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in sorted(root.glob("step-*"))[:-keep]:  # names sort by step; the newest survive
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: str | Path, *, model, optimizer, engine=None) -> dict:
    """Restore model, optimizer, engine and RNG states; returns ``state.pt``'s dict."""
    from safetensors.torch import load_file

    p = Path(path)
    model.load_state_dict(load_file(str(p / "model.safetensors")))
    optimizer.load_state_dict(torch.load(p / "optimizer.pt", weights_only=False))
    if engine is not None and (p / "engine.safetensors").exists() and hasattr(engine, "load_state_dict"):
        engine.load_state_dict(load_file(str(p / "engine.safetensors")))
    state = torch.load(p / "state.pt", weights_only=False)
    set_rng_state(state["rng"])
    return state
