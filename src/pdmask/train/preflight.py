"""Checks of a run's environment before any work: every user error up front, as one
``ValueError`` naming the config key (or file) and what is wrong.

:meth:`TrainConfig.validate` checks values on their own; this module checks them against
the machine and the files they name:

- :func:`check_environment` (called by :func:`pdmask.train.sft.ensure_sft_checkpoint`, so
  the trainer, ``compare`` and the audit all get it, before the SFT warm start): ``device`` exists, the
  ``engine`` backend's optional extra is installed, ``train_file`` /
  ``eval_file`` are readable files, ``model_path`` is a model directory whose
  ``config.json`` and tokenizer load, the SFT cache can be written (when it must be), the
  reward function takes ``(response_text, answer)``.
- :func:`check_run` (called by :func:`pdmask.train.grpo.train` before it locks the run
  directory): ``out_dir`` and the run directory are directories this process can write in.
- :func:`check_lengths`: the longest prompt plus ``max_new_tokens`` fits the model's
  positions (``max_positions`` for the built-in model).
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import torch

from ..engine.registry import check_backend
from .named_models import gguf_path, is_named
from .rundir import check_writable_dir
from .trainable import import_peft


def check_device(device: str) -> None:
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device: {device!r} is not a torch device (cpu, cuda, cuda:1, ...)") from None
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device: {device!r} requested but CUDA is not available to this torch "
                             f"({torch.__version__}); use device=cpu")
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise ValueError(f"device: {device!r} requested but only {torch.cuda.device_count()} CUDA device(s) "
                             "are visible")
    elif d.type not in ("cpu", "mps", "xpu"):
        raise ValueError(f"device: {device!r} is not supported by the trainer (cpu or cuda)")
    elif d.type != "cpu":
        mod = getattr(torch, d.type, None)
        if mod is None or not mod.is_available():
            raise ValueError(f"device: {device!r} requested but it is not available to this torch")


def check_file(key: str, path: str) -> None:
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{key}: file {path!r} not found")
    if p.is_dir():
        raise ValueError(f"{key}: {path!r} is a directory, not a jsonl file")
    try:
        with open(p, "rb") as f:
            f.read(1)
    except OSError as e:
        raise ValueError(f"{key}: cannot read {path!r} ({e.strerror or e})") from None


def check_model_dir(path: str, key: str = "model_path", chat_template: bool = False) -> None:
    """``path`` is a local Hugging Face model directory whose config and tokenizer load (and,
    with ``chat_template``, whose tokenizer has a chat template)."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{key}: {path!r} not found")
    if not p.is_dir():
        raise ValueError(f"{key}: {path!r} is a file; expected a Hugging Face model directory")
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{key}: {path!r} is not a Hugging Face model directory (no config.json)")
    try:
        data = json.loads(cfg_file.read_text())
    except (ValueError, OSError) as e:
        raise ValueError(f"{key}: {str(cfg_file)!r} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{key}: {str(cfg_file)!r} must hold a JSON object")
    from transformers import AutoConfig, AutoTokenizer

    try:
        AutoConfig.from_pretrained(p, local_files_only=True)
    except Exception as e:  # transformers raises ValueError, KeyError, OSError... on a bad config
        raise ValueError(f"{key}: {str(cfg_file)!r} cannot be loaded by transformers "
                         f"({type(e).__name__}: {_first_line(e)})") from None
    try:
        tok = AutoTokenizer.from_pretrained(p, local_files_only=True)
    except Exception as e:
        raise ValueError(f"{key}: the tokenizer in {path!r} cannot be loaded ({type(e).__name__}: "
                         f"{_first_line(e)})") from None
    if chat_template and not getattr(tok, "chat_template", None):
        raise ValueError(f"use_chat_template: the tokenizer in {path!r} has no chat template; "
                         "set use_chat_template=false")


def _first_line(e: Exception) -> str:
    s = str(e).strip().splitlines()
    return s[0] if s else ""


def check_reward(spec: str) -> None:
    """The reward function resolves and can be called as ``reward(response_text, answer)``."""
    from .tasks import get_reward

    fn = get_reward(spec)
    if not callable(fn):
        raise ValueError(f"reward: {spec!r} is not callable (a {type(fn).__name__})")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin without a signature: called as is
    try:
        sig.bind("response text", "answer")
    except TypeError:
        raise ValueError(f"reward: {spec!r} must take (response_text, answer); its signature is "
                         f"{fn.__name__}{sig}") from None


def check_environment(cfg) -> None:
    """Everything the configuration names must exist and be usable (see the module docstring;
    the SFT cache is checked by :func:`pdmask.train.sft.ensure_sft_checkpoint` with
    :func:`check_cache` when it must be written)."""
    check_device(cfg.device)
    check_backend(cfg.engine)  # a backend's optional extra (engine=vllm: vLLM) is installed
    if cfg.lora_rank:
        import_peft()  # the 'lora' extra
    if cfg.task == "jsonl":
        check_file("train_file", cfg.train_file)
        if cfg.eval_file:
            check_file("eval_file", cfg.eval_file)
    if is_named(cfg.model_path):
        gguf_path(cfg.model_path)  # installed? (converted, and its chat template checked, on first load)
    elif cfg.model_path:
        check_model_dir(cfg.model_path, chat_template=cfg.use_chat_template)
    check_reward(cfg.reward)


def check_cache(cfg, root: Path) -> None:
    """The SFT cache ``root`` can take a new entry."""
    check_writable_dir(root, "cache_dir" if cfg.cache_dir else "cache_dir (PDMASK_CACHE)")


def check_run(cfg, *, resume: bool = False) -> None:
    """``out_dir`` and the run directory can be written (a file there is an error)."""
    check_writable_dir(cfg.out_dir, "out_dir")
    if cfg.run_dir.exists() and not cfg.run_dir.is_dir():
        raise ValueError(f"name: {str(cfg.run_dir)!r} is a file, not a run directory")
    if cfg.run_dir.exists():
        check_writable_dir(cfg.run_dir, "out_dir")


def max_model_positions(cfg, model) -> int | None:
    """The positions the model has (``max_position_embeddings`` of its config, or the
    built-in model's ``max_positions``)."""
    n = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if n is None and not cfg.model_path:
        n = cfg.max_positions
    return int(n) if n else None


def check_lengths(cfg, model, train_prompts: list[list[int]], eval_prompts: list[list[int]]) -> None:
    """The longest prompt plus ``max_new_tokens`` fits the model's positions."""
    limit = max_model_positions(cfg, model)
    if limit is None:
        return
    for split, prompts in (("train", train_prompts), ("eval", eval_prompts)):
        if not prompts:
            continue
        i = max(range(len(prompts)), key=lambda j: len(prompts[j]))
        need = len(prompts[i]) + cfg.max_new_tokens
        if need > limit:
            key = "max_positions" if not cfg.model_path else "max_new_tokens"
            raise ValueError(f"{key}: the longest {split} prompt (problem {i}) has {len(prompts[i])} tokens; with "
                             f"max_new_tokens={cfg.max_new_tokens} it needs {need} positions, the model has {limit}")
