"""What the audit needs from the built-in trainer's pieces: the policy at a checkpoint,
the rollout engine (precision, temperature, K, lag) and a per-seed sampler that draws a
GRPO batch and its advantages exactly as training does.

Checkpoint: the built-in SFT model of the trainer config (trained and cached on first
use), a local Hugging Face model directory, or a run directory of ``pdmask train``
(its latest checkpoint: trainer weights, the engine's own weights, the AdamW state).

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
#: AdamW betas of the built-in trainer (``pdmask.train.grpo.setup``)
TRAINER_BETAS = (0.9, 0.99)


@dataclass
class Source:
    model: torch.nn.Module
    engine: object
    forward: Callable
    sample: Callable[[int], tuple]
    optimizer_state: dict | None = None
    info: dict = field(default_factory=dict)


def is_run_dir(path: str | Path) -> bool:
    """A ``pdmask train`` run directory: ``config.yaml`` and ``checkpoints/step-*/`` inside."""
    p = Path(path)
    return (p / "config.yaml").exists() and (p / "checkpoints").is_dir()


def build_source(tcfg, *, model: str = "", lag: int = 0, console=None) -> Source:
    """Policy, engine and sampler for the trainer config ``tcfg`` (a validated ``TrainConfig``).

    ``model``: empty (the built-in SFT model of ``tcfg``), a local Hugging Face model
    directory, or a run directory (then ``tcfg`` should be the run's ``config.yaml``; the
    latest checkpoint's trainer weights are audited, its engine weights are restored
    when the engine precision is the run's, and its AdamW state starts the batch step).
    """
    from ..engine.hf import response_logits
    from ..train.grpo import build_engine
    from ..train.model import encode_prompts, load_model_and_tokenizer, num_params
    from ..train.rollout import decode_responses, group_advantages, rewards_for
    from ..train.sft import ensure_sft_checkpoint, sft_info
    from ..train.tasks import build_task, get_reward

    if not isinstance(lag, int) or lag < 0:
        raise ValueError(f"lag: must be a non-negative int, got {lag!r}")
    torch.set_num_threads(tcfg.threads)
    opt_state, ck = None, {}
    if model and is_run_dir(model):
        from ..train.checkpoint import latest_checkpoint
        ckpt = latest_checkpoint(model)
        if ckpt is None:
            raise ValueError(f"model: run directory {str(model)!r} has no complete checkpoint")
        path = ensure_sft_checkpoint(tcfg, console=console)
        ck = {"kind": "run-directory", "run_dir": str(model), "run_checkpoint": str(ckpt)}
    elif model:
        path = Path(model)
        if not (path / "config.json").exists():
            raise ValueError(f"model: {str(model)!r} is neither a Hugging Face model directory (config.json) "
                             "nor a pdmask run directory (config.yaml + checkpoints/)")
        ck = {"kind": "hf-directory"}
    else:
        path, ck = ensure_sft_checkpoint(tcfg, console=console), {"kind": "built-in SFT"}
    policy, tok = load_model_and_tokenizer(path, tcfg.device)
    engine = build_engine(tcfg, policy, tok)  # a copy of the base weights at the engine precision
    if ck["kind"] == "run-directory":
        from safetensors.torch import load_file
        policy.load_state_dict(load_file(str(ckpt / "model.safetensors")))
        run_prec = load_config_value(Path(model) / "config.yaml", "engine_precision")
        if (ckpt / "engine.safetensors").exists() and run_prec == tcfg.engine_precision:
            engine.load_state_dict(load_file(str(ckpt / "engine.safetensors")))
            ck["engine_weights"] = "from the checkpoint (as the run left them, possibly stale)"
        else:
            engine.load_weights(policy.state_dict())
            ck["engine_weights"] = f"the checkpoint's trainer weights at {tcfg.engine_precision}"
        if (ckpt / "optimizer.pt").exists():
            opt_state = torch.load(ckpt / "optimizer.pt", weights_only=False)
            ck["optimizer_state"] = "the run's AdamW state"
    policy.eval()  # no dropout: the audit's numbers must not depend on a dropout draw
    task = build_task(tcfg)
    reward_fn = get_reward(tcfg.reward)
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

    lag_info = []
    if lag:
        opt_state, lag_info = _lag_steps(policy, sample, tcfg, lag, response_logits, console, opt_state)
    info = {"checkpoint": str(path), **ck, "sft": sft_info(path), "num_params": num_params(policy),
            "vocab_size": policy.get_output_embeddings().weight.shape[0], "engine": tcfg.engine,
            "engine_precision": tcfg.engine_precision, "temperature": tcfg.temperature, "top_k": tcfg.top_k,
            "lag": lag, "lag_steps": lag_info, "prompts_per_step": tcfg.prompts_per_step, "group_size": G,
            "max_new_tokens": tcfg.max_new_tokens, "task": tcfg.task, "threads": tcfg.threads}
    return Source(policy, engine, response_logits, sample, opt_state, json.loads(json.dumps(info, default=str)))


def load_config_value(path: Path, key: str):
    import yaml
    return (yaml.safe_load(path.read_text()) or {}).get(key)


def _lag_steps(policy, sample, tcfg, lag, forward, console, opt_state=None):
    """N RL steps of the trainer config's loss on the policy; the engine is never synced."""
    from ..loss import policy_loss
    from ..train.progress import make_progress

    opt = torch.optim.AdamW(policy.parameters(), lr=tcfg.lr, weight_decay=tcfg.weight_decay, betas=TRAINER_BETAS)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
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
