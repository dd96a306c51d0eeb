"""Engine factory: ``make_engine(cfg.engine, ...)`` picks a backend by name.

A backend registers one factory ``factory(model, *, tokenizer, eos_id, pad_id,
precision, temperature, top_k_logprobs, **options) -> RolloutEngine``. ``model`` is
the trainer's ``transformers`` causal LM (the backend copies or exports it; it must not
share storage with it). Adding the vLLM backend is one call::

    from pdmask.engine.registry import register_engine
    register_engine("vllm", make_vllm_engine)

Backends named in :data:`LAZY` are imported on first use, so heavy dependencies are
only needed when that backend is selected; a missing one is a :class:`MissingExtra`
(an ``ImportError`` naming the extra to install), which :func:`check_backend` raises
before any work. :func:`build_engine` is the same call with
its arguments read from a trainer config (the built-in trainer and the audit use it).
"""

from __future__ import annotations

import importlib
from typing import Callable

from .._validate import check_choice
from .base import RolloutEngine

ENGINES: dict[str, Callable[..., RolloutEngine]] = {}


class MissingExtra(ImportError):
    """An optional extra is not installed (or does not import): the message names it and
    how to install it, e.g. ``pip install -e '.[vllm]'`` (from a checkout: pdmask is on no package index). A user error, not a bug: the
    CLI prints it as one line (:data:`pdmask.cli.USER_ERRORS`)."""

    def __init__(self, extra: str, message: str):
        super().__init__(message)
        self.extra = extra

#: backend name -> module that calls ``register_engine`` for it when imported.
LAZY: dict[str, str] = {"vllm": "pdmask.engine.vllm"}


def register_engine(name: str, factory: Callable[..., RolloutEngine], *, overwrite: bool = False) -> None:
    if name in ENGINES and not overwrite:
        raise ValueError(f"engine: {name!r} is already registered (pass overwrite=True to replace it)")
    ENGINES[name] = factory


def engine_names() -> list[str]:
    return sorted(set(ENGINES) | set(LAZY))


def check_backend(name: str) -> None:
    """``name`` is a backend whose dependencies are installed, checked before any work: a
    lazy backend's module is imported (it imports no engine) and its ``check_installed()``
    raises :class:`MissingExtra` when the extra is missing."""
    if name not in ENGINES and name in LAZY:
        _import_lazy(name)
    check_choice("engine", name, tuple(engine_names()))
    if name in LAZY:
        check = getattr(importlib.import_module(LAZY[name]), "check_installed", None)
        if check is not None:
            check()


def _import_lazy(name: str) -> None:
    try:
        importlib.import_module(LAZY[name])
    except MissingExtra:
        raise
    except ImportError as e:
        raise ValueError(f"engine: backend {name!r} is not available ({e})") from e


def make_engine(name: str, model, *, tokenizer=None, eos_id: int, pad_id: int, precision: str = "fp32",
                temperature: float = 1.0, top_k_logprobs: int = 20, **options) -> RolloutEngine:
    """Build the rollout engine ``name`` (``hf``; ``vllm`` when its backend is installed)."""
    if name not in ENGINES and name in LAZY:
        _import_lazy(name)
    check_choice("engine", name, tuple(engine_names()))
    return ENGINES[name](model, tokenizer=tokenizer, eos_id=eos_id, pad_id=pad_id, precision=precision,
                         temperature=temperature, top_k_logprobs=top_k_logprobs, **options)


def build_engine(cfg, model, tokenizer) -> RolloutEngine:
    """The rollout engine named by ``cfg.engine`` with a copy of ``model``'s weights.

    ``cfg`` is a trainer config (:class:`pdmask.train.TrainConfig` or anything with its
    ``engine``, ``engine_precision``, ``top_k`` fields and a ``loss`` whose ``sampling`` is
    the :class:`pdmask.Sampling` the engine samples with); the token ids come from
    ``tokenizer``. Equivalent to ``make_engine(cfg.engine, model, tokenizer=tokenizer,
    eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id,
    precision=cfg.engine_precision, temperature=cfg.loss.sampling.temperature,
    top_k_logprobs=cfg.top_k)``, plus ``sampling=cfg.loss.sampling`` when it truncates
    (the hf engine samples with it; another backend refuses it).
    """
    s = cfg.loss.sampling
    on = {"sampling": s} if s.truncated else {}
    if on and cfg.engine != "hf":
        path = next(f"sampling.{k}" for k in ("top_k", "top_p", "min_p") if getattr(s, k) is not None)
        key = cfg.loss_key(path) if hasattr(cfg, "loss_key") else f"loss.{path}"
        raise ValueError(f"{key}: truncated sampling is built into the hf engine only "
                         f"(engine={cfg.engine!r} samples with the temperature alone)")
    if getattr(cfg, "engine_share_prefill", False):
        if cfg.engine != "hf":
            raise ValueError(f"engine_share_prefill: built into the hf engine only (engine={cfg.engine!r} "
                             "manages its own prefix cache); set it to false")
        on["share_prefill"] = True
    return make_engine(cfg.engine, model, tokenizer=tokenizer, eos_id=tokenizer.eos_token_id,
                       pad_id=tokenizer.pad_token_id, precision=cfg.engine_precision,
                       temperature=s.temperature, top_k_logprobs=cfg.top_k, **on)


def _make_hf(model, *, tokenizer=None, eos_id, pad_id, precision, temperature, top_k_logprobs, **options):
    from .hf import HFEngine

    trunc = {k: options.pop(k) for k in ("sampling", "share_prefill") if k in options}
    if options:
        raise ValueError(f"engine_options: the hf engine takes none, got {sorted(options)}")
    return HFEngine(model, eos_id=eos_id, pad_id=pad_id, precision=precision, temperature=temperature,
                    top_k_logprobs=top_k_logprobs, **trunc)


register_engine("hf", _make_hf)
