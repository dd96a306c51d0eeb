"""SFT warm start with a content-addressed cache.

:func:`ensure_sft_checkpoint` returns a Hugging Face model directory (model +
tokenizer + ``sft.json``) to start RL from. The directory name is a hash of every
setting that changes its content (model shape, tokenizer, task, SFT hyperparameters,
``sft_seed``, this module's ``SFT_VERSION``); a later run with the same settings reuses
it. It is written to a temporary directory and renamed when complete, so a killed SFT
never leaves a half-written cache entry.

The SFT loss is the mean next-token cross-entropy over the solution tokens (and the
final EOS); prompt tokens are not trained on.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import time
from pathlib import Path

import torch

from .environment import torch_threads
from .named_models import resolve_model
from .model import build_model, encode_prompts, load_model_and_tokenizer, num_params, quiet_transformers
from .preflight import check_cache, check_environment, check_lengths
from .rollout import greedy_eval
from .rundir import share_like_umask, writing
from .tasks import TASK_VERSION, build_task, eval_rewards
from .tokenizer import train_bpe_tokenizer
from .update import build_optimizer

#: bump when the SFT procedure changes, so old cache entries are not reused
SFT_VERSION = 2
#: AdamW betas of the SFT warm start (its own schedule; the RL steps use ADAMW_BETAS)
SFT_BETAS = (0.9, 0.98)

_KEY_FIELDS = ("model_path", "arch", "vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size",
               "max_positions", "task", "task_seed", "train_size", "eval_size", "max_number", "min_steps",
               "max_steps", "train_file", "eval_file", "use_chat_template", "sft_steps", "sft_batch_size",
               "sft_lr", "sft_seed", "sft_alt_format")


def cache_root(cfg) -> Path:
    if cfg.cache_dir:  # "~/..." too: a run's config.yaml writes a cache_dir under home so (portable.py)
        return Path(cfg.cache_dir).expanduser()
    return Path(os.environ.get("PDMASK_CACHE", Path.home() / ".cache" / "pdmask"))


def _file_digest(path: str) -> str:
    if not path:
        return ""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def sft_key(cfg) -> str:
    """Hash of the settings that determine the SFT checkpoint."""
    d = {k: getattr(cfg, k) for k in _KEY_FIELDS}
    d["train_file_sha"], d["eval_file_sha"] = _file_digest(cfg.train_file), _file_digest(cfg.eval_file)
    d["version"], d["task_version"] = SFT_VERSION, TASK_VERSION
    if not cfg.tie_embeddings:  # only when untied, so the keys of existing (tied) bases stay valid
        d["tie_embeddings"] = False
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def sft_dir(cfg) -> Path:
    return cache_root(cfg) / f"sft-{sft_key(cfg)}"


def ensure_sft_checkpoint(cfg, *, console=None) -> Path:
    """Path of the SFT base for ``cfg``, training and caching it on a miss.

    With ``model_path`` set and ``sft_steps == 0`` the model directory itself is returned.
    Every file, device and function the config names is checked first
    (:func:`pdmask.train.preflight.check_environment`), so the trainer, ``compare`` and the
    audit refuse a bad one before any work.
    """
    check_environment(cfg)
    if cfg.model_path and cfg.sft_steps == 0:
        return Path(resolve_model(cfg.model_path, cache_dir=cfg.cache_dir or None, console=console))
    final = sft_dir(cfg)
    if (final / "sft.json").exists():
        return final
    check_cache(cfg, final.parent)  # a miss: the cache must take the new entry
    with writing(final.parent):
        final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        info = run_sft(cfg, tmp, console=console)
        with writing(tmp / "sft.json"):
            (tmp / "sft.json").write_text(json.dumps(info, indent=2))
        # readable by the other users of a shared cache (safetensors writes 0600)
        share_like_umask(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a full disk or a kill must not leave half an entry
        raise
    try:
        tmp.rename(final)
    except OSError:  # another process finished the same entry first; theirs is as good
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def sft_info(path: str | Path) -> dict:
    """The ``sft.json`` record of a cached SFT base ({} for a plain model directory)."""
    p = Path(path) / "sft.json"
    return json.loads(p.read_text()) if p.exists() else {}


def alt_format(solution: str) -> str:
    """``... answer: N`` -> ``... so there are N``: same content, a format the reward rejects."""
    head, sep, n = solution.rpartition(" answer: ")
    return f"{head} so there are {n}" if sep else solution


def _batch(seqs: list[tuple[list[int], list[int]]], pad_id: int):
    """Right-padded (B, L) ids, attention mask and labels (-100 on prompt and padding)."""
    L = max(len(p) + len(s) for p, s in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    labels = torch.full((len(seqs), L), -100, dtype=torch.long)
    attn = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, (p, s) in enumerate(seqs):
        ids[i, :len(p) + len(s)] = torch.tensor(p + s)
        labels[i, len(p):len(p) + len(s)] = torch.tensor(s)
        attn[i, :len(p) + len(s)] = 1
    return ids, attn, labels


def run_sft(cfg, out_dir: Path, *, console=None) -> dict:
    """Train the SFT base and save it (model, tokenizer) to ``out_dir``; returns its record.
    Trains at ``cfg.threads`` torch threads; the caller's count comes back after it."""
    with torch_threads(cfg.threads):
        return _run_sft(cfg, out_dir, console)


def _run_sft(cfg, out_dir: Path, console) -> dict:
    from .progress import make_progress

    t0 = time.time()
    quiet_transformers()
    task = build_task(cfg)
    data = [p for p in task.train if p.solution]
    if cfg.sft_steps > 0 and not data:
        raise ValueError("sft_steps: the training problems have no 'solution' to fine-tune on; set sft_steps=0")
    rng = random.Random(cfg.sft_seed)
    targets = [alt_format(p.solution) if rng.random() < cfg.sft_alt_format else p.solution for p in data]
    if cfg.model_path:
        model, tok = load_model_and_tokenizer(resolve_model(cfg.model_path, cache_dir=cfg.cache_dir or None,
                                                            console=console), cfg.device)
    else:
        tok = train_bpe_tokenizer([p.prompt + t for p, t in zip(data, targets)], cfg.vocab_size)
        model = build_model(cfg, len(tok), pad_id=tok.pad_token_id, eos_id=tok.eos_token_id, seed=cfg.sft_seed)
    prompts = encode_prompts(tok, data, use_chat_template=cfg.use_chat_template)
    ev_prompts = encode_prompts(tok, task.eval, use_chat_template=cfg.use_chat_template)
    check_lengths(cfg, model, prompts, ev_prompts)  # before the SFT steps, not after them
    sols = [ids + [tok.eos_token_id] for ids in tok(targets, add_special_tokens=False).input_ids]
    order: list[int] = []
    opt = build_optimizer(model.parameters(), lr=cfg.sft_lr, weight_decay=0.01, betas=SFT_BETAS)
    warm = max(1, cfg.sft_steps // 20)

    def lr_at(s):  # linear warmup, cosine decay to 10%
        if s < warm:
            return cfg.sft_lr * (s + 1) / warm
        frac = (s - warm) / max(1, cfg.sft_steps - warm)
        return cfg.sft_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    model.train()
    losses = []
    with torch.random.fork_rng(devices=[]), make_progress(cfg.progress, console) as prog:
        torch.manual_seed(cfg.sft_seed)
        task_id = prog.add_task("SFT warm start", total=cfg.sft_steps)
        for s in range(cfg.sft_steps):
            if len(order) < cfg.sft_batch_size:
                perm = list(range(len(data)))
                rng.shuffle(perm)
                order += perm
            idx, order = order[:cfg.sft_batch_size], order[cfg.sft_batch_size:]
            ids, attn, labels = (t.to(cfg.device) for t in _batch([(prompts[i], sols[i]) for i in idx], tok.pad_token_id))
            for g in opt.param_groups:
                g["lr"] = lr_at(s)
            loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.detach())
            prog.update(task_id, advance=1, description=f"SFT warm start loss {loss.detach().item():.3f}" if s % 20 == 0 else None)
    ev_ids = encode_prompts(tok, task.eval, use_chat_template=cfg.use_chat_template)
    ev = greedy_eval(model, tok, ev_ids, [p.answer for p in task.eval], eval_rewards(cfg),
                     max_new_tokens=cfg.max_new_tokens)
    with writing(out_dir):
        out_dir.mkdir(parents=True)
        model.save_pretrained(out_dir, safe_serialization=True)
        tok.save_pretrained(out_dir)
    tail = torch.stack(losses[-20:]).mean().item() if losses else float("nan")
    return {"key": sft_key(cfg), "settings": {k: getattr(cfg, k) for k in _KEY_FIELDS},
            "num_params": num_params(model), "vocab_size": len(tok), "final_loss": tail,
            "eval_greedy_accuracy": ev["accuracy"], "eval_greedy_last_number_accuracy": ev.get("last_number_accuracy"),
            "eval_mean_length": ev["length"], "eval_size": len(task.eval),
            "wall_s": time.time() - t0, "threads": cfg.threads}
