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


def is_run_dir(path: str | Path) -> bool:
    """A ``pdmask train`` run directory: ``config.yaml`` and ``checkpoints/`` inside."""
    p = Path(path)
    return (p / "config.yaml").exists() and ckpt_root(p).is_dir()


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


def load_weights(path: str | Path, model, *, engine=None, optimizer=None) -> dict[str, bool]:
    """Restore the weights of a checkpoint (no step, no RNG): the trainer's into ``model``,
    the engine's own into ``engine`` and the AdamW state into ``optimizer`` (each only
    when given and present in the checkpoint; the trainer's weights must be there).

    Returns which parts were restored: ``{"model": True, "engine": bool, "optimizer": bool}``
    (an engine without ``load_state_dict`` or a checkpoint without ``engine.safetensors``
    leaves the engine as it was: re-sync it from ``model`` if that matters).
    """
    from safetensors.torch import load_file

    p = Path(path)
    if not (p / "model.safetensors").exists():
        raise ValueError(f"checkpoint: {str(p)!r} has no model.safetensors")
    model.load_state_dict(load_file(str(p / "model.safetensors")))
    done = {"model": True, "engine": False, "optimizer": False}
    if engine is not None and (p / "engine.safetensors").exists() and hasattr(engine, "load_state_dict"):
        engine.load_state_dict(load_file(str(p / "engine.safetensors")))
        done["engine"] = True
    if optimizer is not None and (p / "optimizer.pt").exists():
        optimizer.load_state_dict(torch.load(p / "optimizer.pt", weights_only=False))
        done["optimizer"] = True
    return done


def load_checkpoint(path: str | Path, *, model, optimizer, engine=None) -> dict:
    """Resume: restore model, optimizer, engine (:func:`load_weights`) and RNG states;
    returns ``state.pt``'s dict (``step``, ``data_pos``, ...)."""
    p = Path(path)
    if not load_weights(p, model, engine=engine, optimizer=optimizer)["optimizer"]:
        raise ValueError(f"checkpoint: {str(p)!r} has no optimizer.pt; it cannot resume a run")
    state = torch.load(p / "state.pt", weights_only=False)
    set_rng_state(state["rng"])
    return state
