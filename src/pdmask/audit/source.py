"""What the audit needs from the built-in trainer's pieces: the policy at a checkpoint,
the rollout engine (precision, temperature, K, lag) and a per-seed sampler that draws a
GRPO batch and its advantages exactly as training does.

Checkpoint: the built-in SFT model of the trainer config (trained and cached on first
use), a local Hugging Face model directory, or a run directory of ``pdmask train``.

Lag: with ``lag = N`` the engine keeps the checkpoint's weights while the policy takes
N RL steps of the trainer config's loss (``mode``, ``lr``, ...) on batches the engine
samples, so the audited policy is N updates ahead of the sampler (the
``sync_every = N + 1`` situation). The optimizer state of those steps is then the
starting state of every seed's batch step, as it would be in training.
"""

from __future__ import annotations

import copy
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

#: seeds of the lag steps' rollouts (kept away from the audit seeds)
LAG_SEED_BASE = 1_000_000


@dataclass
class Source:
    model: torch.nn.Module
    engine: object
    forward: Callable
    sample: Callable[[int], tuple]
    optimizer_state: dict | None = None
    info: dict = field(default_factory=dict)


def resolve_model_dir(model: str | Path) -> tuple[Path, dict]:
    """A Hugging Face model directory from ``model``: the directory itself, or the latest
    checkpoint's model directory inside a run directory (one with ``config.json`` below it).
    Returns ``(path, {"kind": ..., ...})``."""
    p = Path(model)
    if (p / "config.json").exists():
        return p, {"kind": "hf-directory"}
    if not p.is_dir():
        raise ValueError(f"model: {str(model)!r} is neither a Hugging Face model directory nor a run directory")
    found = sorted((c.parent for c in p.rglob("config.json")), key=lambda d: d.stat().st_mtime)
    if not found:
        raise ValueError(f"model: {str(model)!r} holds no Hugging Face model directory (no config.json below it)")
    return found[-1], {"kind": "run-directory", "run_dir": str(p)}


def build_source(tcfg, *, model: str = "", lag: int = 0, console=None) -> Source:
    """Policy, engine and sampler for the trainer config ``tcfg`` (a validated ``TrainConfig``)."""
    from ..engine.hf import response_logits
    from ..engine.registry import make_engine
    from ..train.model import encode_prompts, load_model_and_tokenizer, num_params
    from ..train.rollout import decode_responses, group_advantages, rewards_for
    from ..train.sft import ensure_sft_checkpoint, sft_info
    from ..train.tasks import build_task, get_reward

    if not isinstance(lag, int) or lag < 0:
        raise ValueError(f"lag: must be a non-negative int, got {lag!r}")
    torch.set_num_threads(tcfg.threads)
    if model:
        path, ck = resolve_model_dir(model)
    else:
        path, ck = ensure_sft_checkpoint(tcfg, console=console), {"kind": "built-in SFT"}
    policy, tok = load_model_and_tokenizer(path, tcfg.device)
    policy.eval()  # no dropout: the audit's numbers must not depend on a dropout draw
    task = build_task(tcfg)
    reward_fn = get_reward(tcfg.reward)
    engine = make_engine(tcfg.engine, policy, tokenizer=tok, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id,
                         precision=tcfg.engine_precision, temperature=tcfg.temperature, top_k_logprobs=tcfg.top_k)
    G = tcfg.group_size

    def sample(seed: int):
        rng = random.Random(int(seed))
        probs = rng.sample(task.train, tcfg.prompts_per_step)
        ids = encode_prompts(tok, [p.prompt for p in probs], use_chat_template=tcfg.use_chat_template)
        rb = engine.generate([x for x in ids for _ in range(G)], max_new_tokens=tcfg.max_new_tokens,
                             seed=int(seed), return_logits=True)
        answers = [p.answer for p in probs for _ in range(G)]
        r = rewards_for(decode_responses(tok, rb), answers, reward_fn)
        adv = group_advantages(r, G, std_norm=tcfg.adv_std_norm)
        flat = (r.reshape(-1, G).std(-1, unbiased=False) == 0).float().mean()
        return rb, adv, {"reward_mean": float(r.mean()), "flat_group_frac": float(flat)}

    opt_state, lag_info = None, []
    if lag:
        opt_state, lag_info = _lag_steps(policy, sample, tcfg, lag, response_logits, console)
    info = {"checkpoint": str(path), **ck, "sft": sft_info(path), "num_params": num_params(policy),
            "vocab_size": policy.get_output_embeddings().weight.shape[0], "engine": tcfg.engine,
            "engine_precision": tcfg.engine_precision, "temperature": tcfg.temperature, "top_k": tcfg.top_k,
            "lag": lag, "lag_steps": lag_info, "prompts_per_step": tcfg.prompts_per_step, "group_size": G,
            "max_new_tokens": tcfg.max_new_tokens, "task": tcfg.task, "threads": tcfg.threads}
    return Source(policy, engine, response_logits, sample, opt_state, json.loads(json.dumps(info, default=str)))


def _lag_steps(policy, sample, tcfg, lag, forward, console):
    """N RL steps of the trainer config's loss on the policy; the engine is never synced."""
    from ..loss import policy_loss
    from ..train.progress import make_progress

    opt = torch.optim.AdamW(policy.parameters(), lr=tcfg.lr, weight_decay=tcfg.weight_decay)
    log = []
    with make_progress(tcfg.progress, console) as prog:
        task = prog.add_task(f"lag: {lag} policy steps ahead of the engine", total=lag)
        for i in range(lag):
            rb, adv, info = sample(LAG_SEED_BASE + i)
            logits = forward(policy, rb.sequences, rb.attention_mask, rb.prompt_len)
            out = policy_loss(logits, rb.response_ids, rb.sampled_logprob, rb.topk_ids, rb.topk_logprobs, adv,
                              rb.response_mask, mode=tcfg.mode, estimator=tcfg.estimator, delta_low=tcfg.delta_low,
                              delta_high=tcfg.delta_high, eps_low=tcfg.eps_low, eps_high=tcfg.eps_high,
                              is_cap=tcfg.is_cap, loss_agg=tcfg.loss_agg, temperature=tcfg.temperature,
                              rollout_logits=rb.logits)
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            if tcfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(policy.parameters(), tcfg.grad_clip)
            opt.step()
            log.append({"step": i, "loss": float(out.loss), "reward_mean": info["reward_mean"],
                        "masked_frac": float(out.metrics["masked_frac"])})
            prog.update(task, advance=1)
    opt.zero_grad(set_to_none=True)
    return copy.deepcopy(opt.state_dict()), log
