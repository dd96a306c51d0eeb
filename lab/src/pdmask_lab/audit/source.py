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

Everything comes from the trainer's own seams, so the audit cannot drift from training:
``setup`` (model, tokenizer, task, AdamW, engine), ``rollout_step`` (generate -> rewards
-> advantages), ``update_step`` (the lag steps) and ``checkpoint.load_weights``.

Trainable-parameter variants (``train_blocks``, ``lora_*`` of the trainer config) come
with ``setup``: the audit's steps move the parameters that train (``requires_grad``),
with the AdamW state over those, and the engine holds the base model with LoRA merged.
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


def build_source(tcfg, *, model: str = "", lag: int = 0, console=None) -> Source:
    """Policy, engine and sampler for the trainer config ``tcfg`` (a validated ``TrainConfig``).

    ``model``: empty (the built-in SFT model of ``tcfg``), a local Hugging Face model
    directory, or a run directory (then ``tcfg`` should be the run's ``config.yaml``; the
    latest checkpoint's trainer weights are audited, its engine weights are restored
    when the engine precision is the run's, and its AdamW state starts the batch step).
    """
    from pdmask.engine.hf import response_logits
    from pdmask.train.checkpoint import is_run_dir, latest_checkpoint, load_weights
    from pdmask.train.config import replace
    from pdmask.train.grpo import setup
    from pdmask.train.model import num_params
    from pdmask.train.rollout import rollout_step, zero_advantage_warning
    from pdmask.train.sft import sft_info
    from pdmask.train.trainable import engine_state_dict, variant

    from pdmask.train.named_models import resolve_model
    from pdmask.train.portable import portable_path

    if not isinstance(lag, int) or lag < 0:
        raise ValueError(f"lag: must be a non-negative int, got {lag!r}")
    if not model and tcfg.model_path and tcfg.sft_steps == 0:  # the config names the model itself
        model = tcfg.model_path
    model = resolve_model(model, cache_dir=tcfg.cache_dir or None, console=console) if model else model
    ckpt = None
    if model and is_run_dir(model):
        ckpt = latest_checkpoint(model)
        if ckpt is None:
            raise ValueError(f"model: run directory {str(model)!r} has no complete checkpoint")
        S = setup(tcfg, console, keep_threads=True)  # the run's SFT base; the checkpoint's weights follow
        ck = {"kind": "run-directory", "run_dir": portable_path(model),
              "run_checkpoint": Path(ckpt).relative_to(model).as_posix()}  # relative to the run directory
    elif model:
        if not (Path(model) / "config.json").exists():
            raise ValueError(f"model: {str(model)!r} is neither a Hugging Face model directory (config.json) "
                             "nor a pdmask run directory (config.yaml + checkpoints/)")
        S = setup(replace(tcfg, model_path=str(model), sft_steps=0), console, keep_threads=True)
        ck = {"kind": "hf-directory"}
    else:
        S, ck = setup(tcfg, console, keep_threads=True), {"kind": "built-in SFT"}
    policy, engine, opt_state = S.model, S.engine, None  # the engine: a copy of the base weights
    if ckpt is not None:
        same_prec = load_config_value(Path(model) / "config.yaml", "engine_precision") == tcfg.engine_precision
        done = load_weights(ckpt, policy, engine=engine if same_prec else None, optimizer=S.optimizer,
                            expect=variant(tcfg))
        if done["engine"]:
            ck["engine_weights"] = "from the checkpoint (as the run left them, possibly stale)"
        else:
            engine.load_weights(engine_state_dict(policy))  # LoRA merged: the engine holds the base model
            ck["engine_weights"] = f"the checkpoint's trainer weights at {tcfg.engine_precision}"
        if done["optimizer"]:
            opt_state = copy.deepcopy(S.optimizer.state_dict())
            ck["optimizer_state"] = "the run's AdamW state"
    eos_id = S.tokenizer.eos_token_id
    policy.eval()  # no dropout: the audit's numbers must not depend on a dropout draw
    G = tcfg.group_size

    def sample(seed: int):
        """A GRPO batch of ``prompts_per_step`` problems drawn with ``seed`` (B = prompts x G)."""
        idx = random.Random(int(seed)).sample(range(len(S.train_ids)), tcfg.prompts_per_step)
        ro = rollout_step(engine, S.tokenizer, [S.train_ids[i] for i in idx], [S.task.train[i].answer for i in idx],
                          S.reward_fn, group_size=G, max_new_tokens=tcfg.max_new_tokens, seed=int(seed),
                          std_norm=tcfg.adv_std_norm, return_logits=True)
        if console is not None and (flat := zero_advantage_warning(ro)) is not None:
            console.print(f"[yellow]warning:[/yellow] seed {seed}: {flat}", soft_wrap=True)
        return ro.batch, ro.advantages, {"reward_mean": float(ro.rewards.mean()),
                                         "flat_group_frac": float(ro.flat_group_frac), **rollout_shape(ro, eos_id)}

    lag_info = []
    if lag:
        opt_state, lag_info = _lag_steps(policy, S.optimizer, sample, tcfg, lag, console)
    path = S.base_path
    info = {"checkpoint": portable_path(path), **ck, "sft": sft_info(path), "num_params": num_params(policy),
            "vocab_size": policy.get_output_embeddings().weight.shape[0], "engine": tcfg.engine,
            "engine_precision": tcfg.engine_precision, "temperature": tcfg.loss.sampling.temperature, "top_k": tcfg.top_k,
            "lag": lag, "lag_steps": lag_info, "prompts_per_step": tcfg.prompts_per_step, "group_size": G,
            "max_new_tokens": tcfg.max_new_tokens, "task": tcfg.task, "threads": tcfg.threads}
    return Source(policy, engine, response_logits, sample, opt_state, json.loads(json.dumps(info, default=str)))


def rollout_shape(ro, eos_id: int) -> dict:
    """What a rollout batch says about the task at this temperature: the share of responses
    that end (write EOS within the budget) and the engine's probability mass beyond its
    reported top-K, mean over response tokens (``1 - sum_k mu_k``)."""
    from pdmask.train.rollout import response_shape

    m = ro.batch.response_mask.bool()
    ended, tail = response_shape(ro.batch, eos_id)  # (B,), (B, T)
    return {"finished_frac": float(ended.float().mean()),
            "tail_beyond_topk": float(tail[m].mean()) if bool(m.any()) else 0.0}


def load_config_value(path: Path, key: str):
    import yaml
    return (yaml.safe_load(path.read_text()) or {}).get(key)


def _lag_steps(policy, optimizer, sample, tcfg, lag, console):
    """N RL steps of the trainer config's loss on the policy; the engine is never synced.

    ``optimizer``: the trainer's AdamW over ``policy`` (fresh, or holding a run's state).
    Returns the optimizer state after the steps and a log line per step."""
    from pdmask.train.progress import make_progress
    from pdmask.train.update import update_step

    opt, log = optimizer, []
    with make_progress(tcfg.progress, console) as prog:
        task = prog.add_task(f"lag: {lag} policy steps ahead of the engine", total=lag)
        for i in range(lag):
            rb, adv, info = sample(LAG_SEED_BASE + i)
            out, _ = update_step(policy, opt, rb, adv, tcfg, validate=True)
            log.append({"step": i, "loss": float(out.loss.detach()), "reward_mean": info["reward_mean"],
                        "masked_frac": float(out.metrics["masked_frac"])})
            prog.update(task, advance=1)
    opt.zero_grad(set_to_none=True)
    return copy.deepcopy(opt.state_dict()), log
