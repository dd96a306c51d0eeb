"""Trainer step time of ``anchor: old`` against ``anchor: rollout``, with and without the frozen-prefix cache, side by side in one run.

    PYTHONPATH=src python benchmarks/bench_anchor_step.py --out docs/results/real-lm/anchor-bench
    PYTHONPATH=src python benchmarks/bench_anchor_step.py --rounds 1 --variants rollout,old   # a quick look

configs/real-lag.yaml (SmolLM2-135M-Instruct, the top 4 of 30 blocks train, fp8 hf engine,
48 new tokens, one mini-batch, fp32 trainer, one thread) at ``--prompts`` x ``--group``
rollouts. One process, the trainer's own pieces in the order of its loop
(``rollout_step``; :func:`pdmask.train.frozen_prefix.step_start`, which is the ``anchor: old``
forward and the cache's pass; ``select`` + ``update_step`` per mini-batch and epoch). Each
round draws one rollout (timed once: generation, rewards and advantages are the same work for
every variant, from the same engine and seed), then times every variant on it in a rotated
order, each from the same trained parameters and AdamW state (restored outside the timer):

- ``start``: :func:`step_start` (``anchor: old``: its no-grad forward, which also fills the
  cache; the rollout anchor with the cache: the frozen blocks only; otherwise nothing);
- ``updates``: the mini-batch updates (forward, loss, backward, clip, AdamW step);
- ``step``: the round's rollout + ``start`` + ``updates`` (the engine sync, evaluation, logging
  and checkpoints are excluded: they do not depend on the anchor).

Ratios (``x``) are medians over rounds of each variant's time over its baseline's in the same
round (``base``: today's step, the same settings with ``anchor: rollout`` and no cache). The
``epochs=2`` pair shows where the rollout anchor gains from the cache: with one epoch each
token's frozen prefix is computed once per step with or without it.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

#: name -> (config overrides, the name of its baseline); the first of each baseline is its own
VARIANTS = {
    "rollout": ({"loss.anchor": "rollout", "frozen_prefix_cache": "never"}, "rollout"),
    "old": ({"loss.anchor": "old", "frozen_prefix_cache": "never"}, "rollout"),
    "old + cache": ({"loss.anchor": "old", "frozen_prefix_cache": "auto"}, "rollout"),
    "rollout + cache": ({"loss.anchor": "rollout", "frozen_prefix_cache": "auto"}, "rollout"),
    "rollout, 2 epochs": ({"loss.anchor": "rollout", "frozen_prefix_cache": "never", "epochs": 2},
                          "rollout, 2 epochs"),
    "rollout + cache, 2 epochs": ({"loss.anchor": "rollout", "frozen_prefix_cache": "always", "epochs": 2},
                                  "rollout, 2 epochs"),
}
#: a cached variant -> the same step without the cache (their losses are compared)
UNCACHED = {"old + cache": "old", "rollout + cache": "rollout", "rollout + cache, 2 epochs": "rollout, 2 epochs"}
SHORT = {"rollout": "rollout", "old": "old", "old-cache": "old + cache", "rollout-cache": "rollout + cache",
         "rollout-2ep": "rollout, 2 epochs", "rollout-cache-2ep": "rollout + cache, 2 epochs"}
PHASES = ("start", "updates", "step")


# ------------------------------------------------------------------ the numbers (pure, tested)
def ratios(times: dict[str, dict[str, list[float]]], base: dict[str, str]) -> dict[str, dict[str, float]]:
    """Per variant and phase (``updates``, ``step``, and ``train`` = start + updates): the median over
    rounds of its time over its baseline's time of the same round."""
    out = {}
    for name, t in times.items():
        b = times[base[name]]
        train = [s + u for s, u in zip(t["start"], t["updates"])]
        train_b = [s + u for s, u in zip(b["start"], b["updates"])]
        out[name] = {"train": statistics.median(x / y for x, y in zip(train, train_b)),
                     **{p: statistics.median(x / y for x, y in zip(t[p], b[p])) for p in ("updates", "step")}}
    return out


def table(times: dict, base: dict[str, str], rollout_s: list[float]) -> str:
    """The markdown table: median seconds per phase, the ratios to each variant's baseline."""
    r = ratios(times, base)
    head = ("| variant | baseline | start s | updates s | step s | start + updates x | step x |\n"
            "|---|---|---|---|---|---|---|")
    rows = [head]
    for name, t in times.items():
        med = {p: statistics.median(t[p]) for p in PHASES}
        rows.append(f"| {name} | {base[name]} | {med['start']:.2f} | {med['updates']:.2f} | {med['step']:.2f} | "
                    f"{r[name]['train']:.3f} | {r[name]['step']:.3f} |")
    rows.append(f"\nThe rollout (generation, rewards, advantages; in every step s): median {statistics.median(rollout_s):.2f} s.")
    return "\n".join(rows)


# ------------------------------------------------------------------ one step of a variant
def run_step(model, opt, cfg, ro, step: int) -> tuple[float, float, list[float]]:
    """(start s, updates s, the losses) of one trainer step on the rollout ``ro``, as ``grpo._train`` runs it."""
    from pdmask.train.frozen_prefix import step_start
    from pdmask.train.grpo import rollout_seed
    from pdmask.train.update import select, update_step

    batch, adv = ro.batch, ro.advantages
    n = batch.sequences.shape[0]
    mb = n // cfg.minibatches
    g = torch.Generator().manual_seed(rollout_seed(cfg, step) + 1)
    plens = batch.attention_mask[:, :batch.prompt_len].sum(1).tolist()
    rlens = batch.response_mask.sum(1).tolist()
    perms = [torch.randperm(n, generator=g).tolist() for _ in range(cfg.epochs)]
    t0 = time.perf_counter()
    anchor, prefix = step_start(model, batch, adv, perms[0], mb, select, plens, rlens, cfg)
    t1 = time.perf_counter()
    losses = []
    for perm in perms:
        for j in range(cfg.minibatches):
            idx = perm[j * mb:(j + 1) * mb]
            sub = select(batch, idx, plens, rlens)
            out, _ = update_step(model, opt, sub, adv[idx], cfg,
                                 anchor=None if anchor is None else anchor.rows(idx, sub),
                                 prefix=None if prefix is None else prefix.rows(idx, sub, batch.prompt_len))
            losses.append(float(out.loss.detach()))  # the step's host sync
    return t1 - t0, time.perf_counter() - t1, losses


def loss_agreement(losses: dict[str, list[float]]) -> dict[str, float]:
    """Cached variant -> the largest relative difference of its updates' losses from the uncached
    variant's on the same rollout and state (0.0: the same bits)."""
    return {k: max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(losses[k], losses[u], strict=True))
            for k, u in UNCACHED.items() if k in losses and u in losses}


def measure(args) -> tuple[dict, dict, list, dict]:
    """Times per variant and phase over the rounds, the baselines, the rollout times, the setup's facts."""
    from pdmask.train.config import load_config, replace
    from pdmask.train.grpo import rollout_seed, setup, step_prompts
    from pdmask.train.rollout import rollout_step
    from pdmask.train.trainable import trainable_parameters

    names = [SHORT[v.strip()] for v in args.variants.split(",")]
    cfg = load_config(args.config, [f"prompts_per_step={args.prompts}", f"group_size={args.group}",
                                    f"threads={args.threads}", "progress=false", *args.overrides])
    S = setup(cfg)
    model, opt = S.model, S.optimizer
    answers = [p.answer for p in S.task.train]
    cfgs = {k: replace(cfg, VARIANTS[k][0]) for k in names}
    base = {k: VARIANTS[k][1] for k in names}
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    w0 = {n: p.detach().clone() for n, p in trained.items()}
    o0 = copy.deepcopy(opt.state_dict())

    def restore():
        with torch.no_grad():
            for n, p in trained.items():
                p.copy_(w0[n])
        opt.load_state_dict(copy.deepcopy(o0))

    times = {k: {p: [] for p in PHASES} for k in names}
    rollout_s, tokens, losses = [], [], {}
    for r in range(args.rounds + 1):  # round 0 warms up (allocations, AdamW state), untimed
        step = args.step + r
        pidx = step_prompts(step, cfg, len(S.train_ids))
        t0 = time.perf_counter()
        ro = rollout_step(S.engine, S.tokenizer, [S.train_ids[i] for i in pidx], [answers[i] for i in pidx],
                          S.reward_fn, group_size=cfg.group_size, max_new_tokens=cfg.max_new_tokens,
                          seed=rollout_seed(cfg, step), std_norm=cfg.adv_std_norm)
        t_ro = time.perf_counter() - t0
        order = names[r % len(names):] + names[:r % len(names)]
        for k in order:
            restore()
            s, u, ls = run_step(model, opt, cfgs[k], ro, step)
            if r == 1:
                losses[k] = ls
            if r:
                for p, v in (("start", s), ("updates", u), ("step", t_ro + s + u)):
                    times[k][p].append(v)
        if r:
            rollout_s.append(t_ro)
            tokens.append(int(ro.batch.response_mask.sum()))
            print(f"  round {r}/{args.rounds}: rollout {t_ro:.2f}s, "
                  + ", ".join(f"{k} {times[k]['start'][-1]:.2f}+{times[k]['updates'][-1]:.2f}s" for k in names),
                  file=sys.stderr, flush=True)
    facts = {"num_params": sum(p.numel() for p in model.parameters()),
             "num_trainable_params": sum(p.numel() for p in trainable_parameters(model)),
             "num_blocks": model.config.num_hidden_layers, "train_blocks": cfg.train_blocks,
             "rollouts": args.prompts * args.group, "response_tokens": tokens,
             "threads": torch.get_num_threads(), "loss_rel_diff_to_uncached": loss_agreement(losses)}
    return times, base, rollout_s, facts


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "real-lag.yaml"))
    ap.add_argument("--prompts", type=int, default=2, help="prompts per step")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (after one warm-up round)")
    ap.add_argument("--step", type=int, default=0, help="the first round's step index (its prompts and seed)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--variants", default=",".join(SHORT), help=f"comma list of: {', '.join(SHORT)}")
    ap.add_argument("--out", default="", help="write bench.json and bench.md here")
    ap.add_argument("overrides", nargs="*", help="config key=value overrides")
    args = ap.parse_args(argv)
    bad = [v for v in args.variants.split(",") if v.strip() not in SHORT]
    if bad:
        raise SystemExit(f"error: --variants: unknown variant {bad[0]!r}; valid: {', '.join(SHORT)}")
    missing = {VARIANTS[SHORT[v.strip()]][1] for v in args.variants.split(",")} - {
        SHORT[v.strip()] for v in args.variants.split(",")}
    if missing:
        raise SystemExit(f"error: --variants: the baseline {sorted(missing)[0]!r} of a variant is not in the list")
    if args.rounds < 1:
        raise SystemExit(f"error: --rounds: must be >= 1, got {args.rounds}")
    from pdmask.train.environment import environment, one_line

    t_run = time.time()
    times, base, rollout_s, facts = measure(args)
    env = environment(args.threads)
    cmd = "PYTHONPATH=src python benchmarks/bench_anchor_step.py " + " ".join(sys.argv[1:] if argv is None else argv)
    md = ["# Trainer step time: anchor old / rollout, with and without the frozen-prefix cache", "",
          f"Written by `{cmd}` ({time.time() - t_run:.0f} s).", "",
          f"{Path(args.config).name} at {args.prompts} prompts x {args.group} samples "
          f"({facts['train_blocks']} of {facts['num_blocks']} blocks train); one process, {args.rounds} timed round(s) "
          "after one warm-up round; in each round one rollout, then every variant on it from the same weights and "
          "AdamW state, in a rotated order. Medians over rounds; `x` is the median over rounds of the ratio to the "
          "baseline in the same round. `start` is `step_start` (the `anchor: old` forward, which also fills the "
          "cache), `updates` the mini-batch updates, `step` the rollout + start + updates.", "",
          table(times, base, rollout_s), "", f"Response tokens per round: {facts['response_tokens']}.", "",
          "The cached variants' update losses against the same step without the cache (round 1, largest relative "
          "difference; 0 is the same bits): " + (", ".join(f"{k} {v:.3g}" for k, v in
                                                         facts["loss_rel_diff_to_uncached"].items()) or "none run")
          + ".", "",
          one_line(env), ""]
    text = "\n".join(md)
    print("\n" + text)
    result = {"command": cmd, "times": times, "baseline": base, "ratios": ratios(times, base), "rollout_s": rollout_s,
              **facts, "environment": env}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.json").write_text(json.dumps(result, indent=1))
        (out / "bench.md").write_text(text)
    return result


if __name__ == "__main__":
    main()
