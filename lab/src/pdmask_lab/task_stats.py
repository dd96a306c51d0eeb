"""What a model + task + engine look like before any training: ``pdmask task-stats``.

For a trainer preset (model, task, reward, temperature, response budget) and one or more
engine precisions, draw ``batches`` GRPO batches exactly as the trainer does (the
trainer's ``setup`` and ``rollout_step``; batch ``i`` uses sampling seed ``i`` and the
same prompts for every precision) and measure, pooled over the response tokens:

- the task at this temperature: accuracy (mean 0/1 reward), the share of groups with
  A != 0 (not flat), the share of responses that end within ``max_new_tokens``, the
  response length;
- the policy's shape: entropy, and the probability mass beyond the engine's top-K
  (``1 - sum_k mu_k``; mean, and the share of tokens where it exceeds 1%);
- the mismatch of each engine against the fp32 policy at the same weights: the top-K KL
  (``pdmask``'s ``topk_kl``, the DPPO estimator the masks threshold) with its quantiles,
  the full KL(mu || pi) and the binary KL.

The top-K KL quantiles are what a mask's delta is chosen from (docs/real_lm.md).
Naive equivalent per batch: ``b = engine.generate(...)``; ``z = policy(b.sequences)``;
``pdmask.token_stats(z, b.rollout)["topk_kl"][b.response_mask]``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from pdmask.train.portable import portable_path

QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99)


def _dist(x: np.ndarray) -> dict:
    return {"mean": float(x.mean()), **{f"q{int(q * 100)}": float(np.quantile(x, q)) for q in QUANTILES}}


def task_stats(cfg, *, precisions: list[str], batches: int, console=None) -> dict:
    """The measurements above for the trainer config ``cfg`` (validated), one entry per precision."""
    from pdmask.engine.hf import response_logits
    from pdmask.engine.registry import build_engine
    from pdmask.stats import token_stats
    from pdmask.train.config import replace
    from pdmask.train.grpo import setup
    from pdmask.train.rollout import response_shape, rollout_step

    if batches < 1:
        raise ValueError(f"batches: must be >= 1, got {batches}")
    if cfg.loss.sampling.truncated:
        raise ValueError("loss.sampling: task-stats measures the full-vocabulary KL against the engine's full logits, "
                         "which belong to the untruncated mu; run it without top_k / top_p / min_p")
    t0 = time.time()
    S = setup(cfg, console, keep_threads=True)  # the measurements run at cfg.threads
    policy = S.model.eval()
    eos = S.tokenizer.eos_token_id
    n_train = len(S.train_ids)
    out = {"precisions": {}}
    for prec in precisions:
        engine = build_engine(replace(cfg, engine_precision=prec), policy, S.tokenizer)
        rows = {k: [] for k in ("reward", "flat", "ended", "length", "tail", "entropy", "topk_kl", "full_kl",
                                "binary_kl", "binary_tv")}
        t1 = time.time()
        for i in range(batches):
            idx = [int(j) for j in torch.randperm(n_train, generator=torch.Generator().manual_seed(i))[
                :cfg.prompts_per_step]]
            ro = rollout_step(engine, S.tokenizer, [S.train_ids[j] for j in idx], [S.task.train[j].answer for j in idx],
                              S.reward_fn, group_size=cfg.group_size, max_new_tokens=cfg.max_new_tokens, seed=i,
                              std_norm=cfg.adv_std_norm, return_logits=True)
            b = ro.batch
            m = b.response_mask.bool()
            with torch.no_grad():
                z = response_logits(policy, b.sequences, b.attention_mask, b.prompt_len).float()  # (B, T, V)
                st = token_stats(z, b.rollout, sampling=cfg.loss.sampling)
            rows["reward"].append(ro.rewards.numpy())
            rows["flat"].append(np.array([float(ro.flat_group_frac)]))
            ended, tail = response_shape(b, eos)  # (B,), (B, T)
            rows["ended"].append(ended.float().numpy())
            rows["length"].append(m.sum(1).float().numpy())
            rows["tail"].append(tail[m].numpy())
            rows["entropy"].append(st["entropy"][m].numpy())
            for k in ("topk_kl", "full_kl", "binary_kl", "binary_tv"):
                rows[k].append(st[k][m].double().numpy())
        r = {k: np.concatenate(v) for k, v in rows.items()}
        out["precisions"][prec] = {
            "n_batches": batches, "n_responses": int(r["reward"].size), "n_tokens": int(r["tail"].size),
            "accuracy": float(r["reward"].mean()), "groups_with_signal": float(1.0 - r["flat"].mean()),
            "finished": float(r["ended"].mean()), "response_length": float(r["length"].mean()),
            "tail_beyond_topk": _dist(r["tail"]), "tail_over_1pct": float((r["tail"] > 0.01).mean()),
            "entropy": _dist(r["entropy"]), "topk_kl": _dist(r["topk_kl"]), "full_kl": _dist(r["full_kl"]),
            "binary_kl": _dist(r["binary_kl"]), "binary_tv": _dist(r["binary_tv"]),
            "wall_s": round(time.time() - t1, 1)}
    from pdmask.train.environment import environment

    out.update({"environment": environment(threads=cfg.threads), "model": portable_path(S.base_path), "task": cfg.task, "reward": cfg.reward, "temperature": cfg.loss.sampling.temperature,
                "top_k": cfg.top_k, "prompts_per_step": cfg.prompts_per_step, "group_size": cfg.group_size,
                "max_new_tokens": cfg.max_new_tokens, "threads": cfg.threads, "wall_s": round(time.time() - t0, 1)})
    return out


def task_stats_md(doc: dict, command: str) -> str:
    """The measurements as a markdown page (written next to the JSON)."""
    L = ["# Task statistics", "", "Written by:", "", "```", command, "```", "",
         f"Model `{doc['model']}`, task `{doc['task']}`, reward `{doc['reward']}`, temperature {doc['temperature']}, "
         f"{doc['prompts_per_step']} prompts x {doc['group_size']} samples per batch, {doc['max_new_tokens']} new "
         f"tokens at most, top-K = {doc['top_k']}. Mismatch: each engine against the fp32 policy at the same "
         "weights (no lag).", ""]
    if doc.get("environment"):
        from pdmask.train.environment import one_line

        L += [one_line(doc["environment"]), ""]
    precs = list(doc["precisions"])
    L += ["| quantity | " + " | ".join(precs) + " |", "|---|" + "---|" * len(precs)]

    def row(label, f):
        L.append(f"| {label} | " + " | ".join(f(doc["precisions"][p]) for p in precs) + " |")

    row("batches / responses / response tokens", lambda s: f"{s['n_batches']} / {s['n_responses']} / {s['n_tokens']}")
    row("accuracy at this temperature", lambda s: f"{s['accuracy']:.3f}")
    row("groups with A != 0", lambda s: f"{s['groups_with_signal']:.3f}")
    row("responses that end within the budget", lambda s: f"{s['finished']:.3f}")
    row("mean response length (tokens)", lambda s: f"{s['response_length']:.1f}")
    row("mass beyond the top-K, mean", lambda s: f"{s['tail_beyond_topk']['mean']:.4f}")
    row("tokens with > 1% beyond the top-K", lambda s: f"{s['tail_over_1pct']:.3f}")
    row("entropy (nats), mean", lambda s: f"{s['entropy']['mean']:.3f}")
    for k in ("topk_kl", "full_kl", "binary_kl"):
        row(f"{k}, mean", lambda s, k=k: f"{s[k]['mean']:.3g}")
    for q in QUANTILES:
        row(f"topk_kl, q{int(q * 100)}", lambda s, q=q: f"{s['topk_kl'][f'q{int(q * 100)}']:.3g}")
    if all("binary_tv" in doc["precisions"][p] for p in precs):  # |pi_k - mu_k|: DRPO's distance (pages since 2026-12-02)
        for q in QUANTILES:
            row(f"binary_tv, q{int(q * 100)}", lambda s, q=q: f"{s['binary_tv'][f'q{int(q * 100)}']:.3g}")
    row("wall time (s)", lambda s: f"{s['wall_s']}")
    return "\n".join(L) + "\n"


def write_task_stats(doc: dict, out: str | Path, command: str) -> list[Path]:
    from pdmask.train.rundir import writing

    out = Path(out)
    with writing(out):
        out.mkdir(parents=True, exist_ok=True)
    j, m = out / "task_stats.json", out / "task_stats.md"
    with writing(j):
        j.write_text(json.dumps({"command": command, **doc}, indent=1) + "\n")
    with writing(m):
        m.write_text(task_stats_md(doc, command))
    return [j, m]
