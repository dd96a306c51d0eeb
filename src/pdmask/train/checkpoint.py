"""Resumable checkpoints: ``run_dir/checkpoints/step-NNNNNN/``, no pickles.

Contents (format 2):

- ``model.safetensors``: the trainer's weights (every tensor of its state dict: with LoRA
  the frozen base weights and the adapters, so a checkpoint is complete on its own);
- ``engine.safetensors``: the engine's own (possibly stale, low-precision) weights, when
  the backend exposes them;
- ``optimizer.safetensors`` + ``optimizer.json``: the optimizer's ``state_dict``, its
  tensors in safetensors and everything else (param groups, hyperparameters, the nesting)
  as JSON that refers to the tensors by key (:func:`encode_tree`);
- ``rng.safetensors`` + ``state.json``: the torch RNG state (a byte tensor), and as JSON
  the step, the data position, the python and numpy RNG states and the caller's extras
  (the trainer's include its trainable-parameter variant, checked on resume);
- ``MANIFEST.json``, written last: the format, the step, and the SHA-256 and size of every
  file above.

Nothing is ever unpickled: tensors come from safetensors, the rest from JSON, so a run
directory written by someone else cannot run code on resume (``weights_only`` in spirit
and in fact: ``torch.load`` is not called at all).

Writing: into ``.tmp-step-NNNNNN/``, each file flushed to disk, then renamed, so a SIGKILL
while saving leaves the previous checkpoints intact. The newest ``keep`` checkpoints are
kept (default 2: the previous one is the fallback).

Reading: :func:`latest_checkpoint` returns the newest checkpoint whose files match their
manifest; a corrupt or truncated newer one is reported (``warn``) and skipped, and when
none is usable the error names each checkpoint's bad file. A checkpoint of the old
pickle format (``state.pt``, ``optimizer.pt``) is refused, never loaded.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch

from .rundir import share_like_umask, writing

FORMAT = 2
MANIFEST = "MANIFEST.json"
#: files every checkpoint has (engine.safetensors is optional)
REQUIRED = ("model.safetensors", "optimizer.safetensors", "optimizer.json", "rng.safetensors", "state.json")


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (corrupt, truncated, or of the old pickle format)."""


def ckpt_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def is_run_dir(path: str | Path) -> bool:
    """A ``pdmask train`` run directory: ``config.yaml`` and ``checkpoints/`` inside."""
    p = Path(path)
    return (p / "config.yaml").exists() and ckpt_root(p).is_dir()


def drop_checkpoints(run_dir: str | Path) -> int:
    """Delete a finished run's checkpoints (``keep_checkpoints`` 0 of compare / ladder); the
    empty ``checkpoints/`` stays, so the directory is still recognised as a run (and says
    why it cannot be resumed or audited: no checkpoint). Returns how many were deleted."""
    root = ckpt_root(run_dir)
    if not root.is_dir():
        return 0
    gone = [d for d in root.iterdir() if d.is_dir()]
    for d in gone:
        shutil.rmtree(d)
    return len(gone)


# ------------------------------------------------------------------ RNG states as JSON
def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(s: dict) -> None:
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])


def _rng_to_json(s: dict) -> dict:
    v, internal, gauss = s["python"]
    name, keys, pos, has_gauss, cached = s["numpy"]
    return {"python": [v, list(internal), gauss],
            "numpy": [name, [int(x) for x in keys], int(pos), int(has_gauss), float(cached)]}


def _rng_from_json(d: dict, torch_state: torch.Tensor) -> dict:
    v, internal, gauss = d["python"]
    name, keys, pos, has_gauss, cached = d["numpy"]
    return {"python": (v, tuple(internal), gauss),
            "numpy": (name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached),
            "torch": torch_state}


# ------------------------------------------------------------------ state dicts as safetensors + JSON
def encode_tree(obj, tensors: dict[str, torch.Tensor]):
    """A JSON-able copy of ``obj`` with each tensor moved into ``tensors`` (by key).

    Tuples, dicts with non-string keys (an optimizer's ``state`` is keyed by int), NumPy
    arrays (stored as tensors) and NumPy scalars are tagged so that :func:`decode_tree`
    rebuilds exactly the same types."""
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = obj.detach().contiguous().clone()
        return {"__tensor__": key}
    if isinstance(obj, np.ndarray):
        key = f"t{len(tensors)}"
        tensors[key] = torch.from_numpy(np.ascontiguousarray(obj)).clone()
        return {"__ndarray__": key}
    if isinstance(obj, np.generic):
        return {"__npscalar__": [obj.dtype.str, encode_tree(obj.item(), tensors)]}
    if isinstance(obj, dict):
        return {"__dict__": [[encode_tree(k, tensors), encode_tree(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [encode_tree(x, tensors) for x in obj]}
    if isinstance(obj, list):
        return [encode_tree(x, tensors) for x in obj]
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"__float__": repr(obj)}
    raise TypeError(f"checkpoint: cannot store a {type(obj).__name__} without pickling it")


def decode_tree(obj, tensors: dict[str, torch.Tensor]):
    if isinstance(obj, list):
        return [decode_tree(x, tensors) for x in obj]
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__ndarray__" in obj:
            return tensors[obj["__ndarray__"]].numpy()
        if "__npscalar__" in obj:
            dtype, value = obj["__npscalar__"]
            return np.dtype(dtype).type(decode_tree(value, tensors))
        if "__dict__" in obj:
            return {decode_tree(k, tensors): decode_tree(v, tensors) for k, v in obj["__dict__"]}
        if "__tuple__" in obj:
            return tuple(decode_tree(x, tensors) for x in obj["__tuple__"])
        if "__float__" in obj:
            return float(obj["__float__"])
        raise ValueError(f"unknown tagged value {sorted(obj)}")
    return obj


def _contiguous(sd: dict) -> dict:
    # safetensors refuses shared storage (tied embeddings): save each name once, cloned
    return {k: v.detach().contiguous().clone() for k, v in sd.items()}


# ------------------------------------------------------------------ writing
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_tensors(tensors: dict, path: Path) -> None:
    from safetensors.torch import save_file

    with writing(path):
        save_file(tensors, str(path))


def _save_json(obj, path: Path) -> None:
    with writing(path):
        path.write_text(json.dumps(obj, indent=1))


def save_checkpoint(run_dir, *, step: int, model, optimizer, engine=None, extra: dict | None = None,
                    keep: int = 2) -> Path:
    """Write checkpoint ``step`` (see the module docstring); keep the newest ``keep``."""
    root = ckpt_root(run_dir)
    with writing(root):
        root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-step-{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    with writing(tmp):
        tmp.mkdir()
    _save_tensors(_contiguous(model.state_dict()), tmp / "model.safetensors")
    if engine is not None and hasattr(engine, "state_dict"):
        _save_tensors(_contiguous(engine.state_dict()), tmp / "engine.safetensors")
    opt_tensors: dict[str, torch.Tensor] = {}
    opt_tree = encode_tree(optimizer.state_dict(), opt_tensors)
    _save_tensors(opt_tensors, tmp / "optimizer.safetensors")
    _save_json(opt_tree, tmp / "optimizer.json")
    rng = rng_state()
    _save_tensors({"torch": rng["torch"]}, tmp / "rng.safetensors")
    extra_tensors: dict[str, torch.Tensor] = {}
    state = {"step": step, "rng": _rng_to_json(rng), "extra": encode_tree(dict(extra or {}), extra_tensors)}
    if extra_tensors:
        raise TypeError("checkpoint: extra must hold plain values (numbers, strings, lists), not tensors")
    _save_json(state, tmp / "state.json")
    files = sorted(p.name for p in tmp.iterdir())
    for name in files:
        with writing(tmp / name):
            _fsync(tmp / name)
    manifest = {"format": FORMAT, "step": step,
                "files": {n: {"sha256": _sha256(tmp / n), "bytes": (tmp / n).stat().st_size} for n in files}}
    _save_json(manifest, tmp / MANIFEST)
    with writing(tmp / MANIFEST):
        _fsync(tmp / MANIFEST)
    share_like_umask(tmp)
    shutil.rmtree(final, ignore_errors=True)
    with writing(final):
        tmp.rename(final)
    for old in sorted(root.glob("step-*"))[:-keep]:  # names sort by step; the newest survive
        shutil.rmtree(old, ignore_errors=True)
    return final


# ------------------------------------------------------------------ reading
def verify(path: str | Path) -> str | None:
    """None if the checkpoint's files match its manifest, else what is wrong (naming the file)."""
    p = Path(path)
    if not (p / MANIFEST).exists():
        if (p / "state.pt").exists() or (p / "optimizer.pt").exists():
            return (f"{p / 'state.pt'} is of the old pickle format; it is not loaded (no pickles are "
                    "unpickled on resume): start a new run")
        return f"{p / MANIFEST} is missing (an incomplete checkpoint)"
    try:
        man = json.loads((p / MANIFEST).read_text())
        files = man["files"]
        fmt = man["format"]
    except (ValueError, KeyError, TypeError, OSError) as e:
        return f"{p / MANIFEST} is unreadable ({type(e).__name__}: {e})"
    if fmt != FORMAT:
        return f"{p / MANIFEST} has format {fmt!r}; this pdmask reads format {FORMAT}"
    for name in REQUIRED:
        if name not in files:
            return f"{p / MANIFEST} does not list {name}"
    for name, want in files.items():
        f = p / name
        if not f.is_file():
            if name not in REQUIRED:
                continue  # an optional part removed (engine.safetensors): loaded only when present
            return f"{f} is missing"
        size = f.stat().st_size
        if size != want.get("bytes"):
            return f"{f} is truncated or changed ({size} bytes, the manifest says {want.get('bytes')})"
        if _sha256(f) != want.get("sha256"):
            return f"{f} does not match its SHA-256 checksum (corrupted)"
    return None


def _candidates(run_dir) -> list[Path]:
    root = ckpt_root(run_dir)
    if not root.exists():
        return []
    return sorted((p for p in root.glob("step-*") if p.is_dir()), reverse=True)  # newest first


def latest_checkpoint(run_dir: str | Path, warn=None) -> Path | None:
    """The newest usable checkpoint of ``run_dir`` (its files match their checksums), or
    None when there is none at all.

    A corrupt newer checkpoint is skipped with a message through ``warn`` (a callable
    taking a string; default: a :class:`CheckpointWarning`). When checkpoints exist but
    none is usable, a ValueError names each one's bad file."""
    say = warn or (lambda m: warnings.warn(m, CheckpointWarning, stacklevel=3))
    problems = []
    for p in _candidates(run_dir):
        why = verify(p)
        if why is None:
            for bad, reason in problems:
                say(f"checkpoint {bad.name} is not usable ({reason}); falling back to {p.name}")
            return p
        problems.append((p, why))
    if problems:
        raise ValueError(f"checkpoint: no usable checkpoint in {str(ckpt_root(run_dir))!r}: "
                         + "; ".join(f"{p.name}: {why}" for p, why in problems))
    return None


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises its own error types on a bad header
        raise ValueError(f"checkpoint: {str(path)!r} is not a readable safetensors file ({e})") from None


def _load_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (ValueError, OSError) as e:
        raise ValueError(f"checkpoint: {str(path)!r} is not readable JSON ({e})") from None


def _checked(path) -> Path:
    p = Path(path)
    why = verify(p)
    if why is not None:
        raise ValueError(f"checkpoint: {why}")
    return p


def load_optimizer_state(path: str | Path) -> dict:
    """The optimizer ``state_dict`` of a checkpoint, rebuilt from safetensors + JSON."""
    p = Path(path)
    return decode_tree(_load_json(p / "optimizer.json"), _load_tensors(p / "optimizer.safetensors"))


def check_extras(path: str | Path, expect: dict) -> None:
    """The checkpoint's extras hold ``expect`` (name -> value), or a ValueError naming the
    first that differs. A name that is a trainer-config field and that an older
    checkpoint lacks counts as the field's default: the checkpoint was written before the
    field existed, so with its default."""
    from .config import FIELDS

    p = Path(path)
    extra = decode_tree(_load_json(p / "state.json")["extra"], {})
    for k, want in expect.items():
        got = extra.get(k, FIELDS[k].default if k in FIELDS else None)
        if got != want:
            raise ValueError(f"{k}: checkpoint {p.name} was written with {k}={got!r}, this run has {k}={want!r}; "
                             "resume with the settings the run was started with (its config.yaml)")


def load_weights(path: str | Path, model, *, engine=None, optimizer=None, expect: dict | None = None
                 ) -> dict[str, bool]:
    """Restore the weights of a checkpoint (no step, no RNG): the trainer's into ``model``,
    the engine's own into ``engine`` and the optimizer state into ``optimizer`` (each only
    when given and present in the checkpoint; the trainer's weights must be there).
    The checkpoint's files are verified against their checksums first, then its extras
    against ``expect`` (:func:`check_extras`: e.g. the trainable-parameter variant, whose
    frozen set and adapters decide which tensors the model and the optimizer hold).

    Returns which parts were restored: ``{"model": True, "engine": bool, "optimizer": bool}``
    (an engine without ``load_state_dict`` or a checkpoint without ``engine.safetensors``
    leaves the engine as it was: re-sync it from ``model`` if that matters).
    """
    p = _checked(path)
    if expect:
        check_extras(p, expect)
    model.load_state_dict(_load_tensors(p / "model.safetensors"))
    done = {"model": True, "engine": False, "optimizer": False}
    if engine is not None and (p / "engine.safetensors").exists() and hasattr(engine, "load_state_dict"):
        engine.load_state_dict(_load_tensors(p / "engine.safetensors"))
        done["engine"] = True
    if optimizer is not None:
        optimizer.load_state_dict(load_optimizer_state(p))
        done["optimizer"] = True
    return done


def load_checkpoint(path: str | Path, *, model, optimizer, engine=None, expect: dict | None = None) -> dict:
    """Resume: restore model, optimizer, engine (:func:`load_weights`, ``expect`` checked
    first) and RNG states; returns the state: ``step``, ``data_pos`` and the other extras
    given when saving."""
    p = _checked(path)
    load_weights(p, model, engine=engine, optimizer=optimizer, expect=expect)
    state = _load_json(p / "state.json")
    set_rng_state(_rng_from_json(state["rng"], _load_tensors(p / "rng.safetensors")["torch"]))
    return {"step": state["step"], **decode_tree(state["extra"], {})}
