"""Building and loading the policy model and its tokenizer.

- :func:`build_model` — a fresh ``transformers`` causal LM (Llama or Qwen3 architecture)
  from the config's size fields, seeded; nothing is downloaded.
- :func:`load_model_and_tokenizer` — from a local Hugging Face directory (``--model
  PATH``, or an SFT checkpoint made by :func:`pdmask.train.sft.ensure_sft_checkpoint`).
- :func:`encode_prompts` — prompt strings to token-id lists (optionally through the
  tokenizer's chat template).
"""

from __future__ import annotations

from pathlib import Path

import torch

from .._validate import check_choice
from .tokenizer import prepare_tokenizer

#: the built-in model's architectures (transformers' Llama and Qwen3)
ARCHS = ("llama", "qwen3")


def model_config(cfg, vocab_size: int, *, pad_id: int, eos_id: int):
    """The ``transformers`` config of the built-in model."""
    check_choice("arch", cfg.arch, ARCHS)
    common = dict(vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                  num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                  num_key_value_heads=cfg.num_heads, max_position_embeddings=cfg.max_positions,
                  tie_word_embeddings=cfg.tie_embeddings, pad_token_id=pad_id, eos_token_id=eos_id, bos_token_id=eos_id)
    if cfg.arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common)
    from transformers import Qwen3Config  # qwen3

    return Qwen3Config(head_dim=cfg.hidden_size // cfg.num_heads, **common)


def build_model(cfg, vocab_size: int, *, pad_id: int, eos_id: int, seed: int):
    """A freshly initialised causal LM in float32 (initialisation seeded with ``seed``)."""
    from transformers import AutoModelForCausalLM

    hf_cfg = model_config(cfg, vocab_size, pad_id=pad_id, eos_id=eos_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    return model.to(cfg.device)


def quiet_transformers() -> None:
    """No per-file progress bars from transformers (we draw our own)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def load_model_and_tokenizer(path: str | Path, device: str = "cpu"):
    """(model in float32, tokenizer) from a local HF directory; never downloads."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .named_models import resolve_model

    quiet_transformers()
    p = Path(resolve_model(path))
    if not (p / "config.json").exists():
        raise ValueError(f"model_path: {str(path)!r} is not a Hugging Face model directory (no config.json)")
    tok = prepare_tokenizer(AutoTokenizer.from_pretrained(p, local_files_only=True))
    model = AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32, local_files_only=True)
    return model.to(device), tok


def encode_prompts(tokenizer, prompts: list, *, use_chat_template: bool = False) -> list[list[int]]:
    """Token ids of each prompt (no special tokens added unless the chat template adds them).

    A prompt is a string or a :class:`pdmask.train.tasks.Problem`; with the chat template a
    problem's system message and worked examples come before its question (its
    :meth:`~pdmask.train.tasks.Problem.messages`), without it only its ``prompt`` is used."""
    if use_chat_template:
        chats = [p.messages() if hasattr(p, "messages") else [{"role": "user", "content": p}] for p in prompts]
        return [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False)
                for c in chats]
    return [tokenizer(getattr(p, "prompt", p), add_special_tokens=False).input_ids for p in prompts]


def num_params(model) -> int:
    return sum(p.numel() for p in model.parameters())
