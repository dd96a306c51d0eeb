"""Trainer step time of the batch-aware modes against dppo-topk-kl, side by side in one run.

    flock /work/locks/exp.lock env PYTHONPATH=src python benchmarks/bench_batch_train.py
    PYTHONPATH=src python benchmarks/bench_batch_train.py --rounds 3        # a quick look
    PYTHONPATH=src python benchmarks/bench_batch_train.py --config configs/stress.yaml --json out.jsonl

One process, the trainer's own pieces (``setup``, ``rollout_step``, ``select``,
``update_step``) on the preset's SFT base (cached). AdamW first takes ``--warm`` real
updates so its state (the batch direction's P) is a trained one. Then, in each round and
for each variant in a rotated order, one **trainer step** is timed from the same model
and optimizer state (restored outside the timer): the rollout (generate -> rewards ->
advantages, identical work for every variant) and the ``minibatches`` mini-batch updates
(forward, mask, loss, backward, clip, AdamW step). Ratios are medians over rounds of each
variant's time over dppo-topk-kl's:

- ``update x``: the updates alone (what the mode changes);
- ``step x``: rollout + updates, the trainer step time the issue's targets are about
  (evaluation, logging and checkpoints excluded; they do not depend on the mode).

``--breakdown`` then times the phases of one batch-mode update (forward, statistics,
backward of Phi, P, forward-mode pass, loss, loss backward, optimizer step) against the
same phases of dppo-topk-kl, one mini-batch, minimum over rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import env_line  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def variants(num_layers: int, lasts: list[int]) -> dict[str, dict]:
    out = {"dppo-topk-kl": {"mode": "dppo-topk-kl"}, "pdm-topk-kl": {"mode": "pdm-topk-kl"},
           "pdm-batch-topk-kl (all)": {"mode": "pdm-batch-topk-kl", "batch_params": "all"}}
    for n in lasts:
        if 1 <= n <= num_layers:
            out[f"pdm-batch-topk-kl (last {n})"] = {"mode": "pdm-batch-topk-kl", "batch_params": str(n)}
    return out


def main(argv=None) -> None:
    from pdmask.train.config import load_config, replace
    from pdmask.train.grpo import rollout_seed, setup, step_prompts
    from pdmask.train.model import num_params
    from pdmask.train.rollout import rollout_step
    from pdmask.train.update import select, update_step

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "main.yaml"))
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--warm", type=int, default=4, help="real updates before timing (AdamW state, drift)")
    ap.add_argument("--lasts", default="1,2", help="last-N-blocks variants to time (comma list)")
    ap.add_argument("--breakdown", action="store_true", help="also time the phases of one update")
    ap.add_argument("--json", default=None, help="append the results as JSON lines to this file")
    ap.add_argument("overrides", nargs="*", help="config key=value overrides")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, list(args.overrides) + ["progress=false"])
    S = setup(cfg)
    model, opt = S.model, S.optimizer
    answers = [p.answer for p in S.task.train]
    n = cfg.prompts_per_step * cfg.group_size
    mb = n // cfg.minibatches

    def rollout(step):
        pidx = step_prompts(step, cfg, len(S.train_ids))
        return rollout_step(S.engine, S.tokenizer, [S.train_ids[i] for i in pidx], [answers[i] for i in pidx],
                            S.reward_fn, group_size=cfg.group_size, max_new_tokens=cfg.max_new_tokens,
                            seed=rollout_seed(cfg, step), std_norm=cfg.adv_std_norm)

    def updates(ro, c, step):
        b = ro.batch
        g = torch.Generator().manual_seed(rollout_seed(cfg, step) + 1)
        plens = b.attention_mask[:, :b.prompt_len].sum(1).tolist()
        rlens = b.response_mask.sum(1).tolist()
        perm = torch.randperm(n, generator=g).tolist()
        outs = []
        for j in range(cfg.minibatches):
            idx = perm[j * mb:(j + 1) * mb]
            out, _ = update_step(model, opt, select(b, idx, plens, rlens), ro.advantages[idx], c)
            outs.append(out.metrics)
        return outs

    for s in range(args.warm // cfg.minibatches + (args.warm % cfg.minibatches > 0)):  # warm AdamW
        updates(rollout(s), replace(cfg, mode="dppo-topk-kl"), s)
    m0 = copy.deepcopy(model.state_dict())
    o0 = copy.deepcopy(opt.state_dict())

    def restore():
        model.load_state_dict(m0)
        opt.load_state_dict(copy.deepcopy(o0))

    lasts = [int(x) for x in args.lasts.split(",") if x]
    vs = variants(cfg.num_layers, lasts)
    cfgs = {k: replace(cfg, **v) for k, v in vs.items()}
    step = args.warm  # the timed step's prompts (the same for every variant)
    times = {k: {"rollout": [], "update": [], "step": []} for k in vs}
    masked = {}
    names = list(vs)
    print(f"# {env_line()}; {Path(args.config).name}: {cfg.arch} {num_params(model):,} params ({cfg.num_layers} "
          f"blocks, d={cfg.hidden_size}, V={cfg.vocab_size}); {n} rollouts x {cfg.max_new_tokens} tokens, "
          f"{cfg.minibatches} mini-batches; AdamW after {args.warm} updates; {args.rounds} rounds + 1 warm-up, "
          f"rotated order; threads={torch.get_num_threads()}", flush=True)
    for r in range(args.rounds + 1):
        order = names[r % len(names):] + names[:r % len(names)]
        for k in order:
            restore()
            t0 = time.perf_counter()
            ro = rollout(step)
            t1 = time.perf_counter()
            ms = updates(ro, cfgs[k], step)
            t2 = time.perf_counter()
            if r == 0:
                masked[k] = (sum(float(m["masked_frac"]) for m in ms) / len(ms),
                             sum(float(m["num_out_of_region"]) for m in ms), int(ro.batch.response_mask.sum()))
                continue
            times[k]["rollout"].append(t1 - t0)
            times[k]["update"].append(t2 - t1)
            times[k]["step"].append(t2 - t0)
        if r:
            print(f"  round {r}/{args.rounds}: " + ", ".join(f"{k} {times[k]['step'][-1]:.2f}s" for k in names),
                  flush=True)
    base = {p: statistics.median(times["dppo-topk-kl"][p]) for p in ("rollout", "update", "step")}
    print(f"\n{'variant':<30}{'rollout s':>10}{'update s':>10}{'step s':>9}{'update x':>10}{'step x':>8}"
          f"{'masked':>9}{'|O|':>6}")
    rows = []
    for k in names:
        med = {p: statistics.median(times[k][p]) for p in ("rollout", "update", "step")}
        ratio = {p: statistics.median(a / b for a, b in zip(times[k][p], times["dppo-topk-kl"][p]))
                 for p in ("update", "step")}
        mf, nout, ntok = masked[k]
        print(f"{k:<30}{med['rollout']:10.3f}{med['update']:10.3f}{med['step']:9.3f}{ratio['update']:10.2f}"
              f"{ratio['step']:8.2f}{100 * mf:8.2f}%{nout:6.0f}", flush=True)
        rows.append({"variant": k, **{f"median_{p}_s": v for p, v in med.items()},
                     "update_ratio": ratio["update"], "step_ratio": ratio["step"],
                     "ratio_of_medians_step": med["step"] / base["step"],
                     "ratio_of_medians_update": med["update"] / base["update"], "masked_frac": mf,
                     "num_out_of_region": nout, "response_tokens": ntok, "rounds": args.rounds})
    print("(x: median over rounds of the per-round ratio to dppo-topk-kl; masked/|O|: the first round's updates)")
    if args.breakdown:
        restore()
        rows.append({"breakdown": breakdown(cfg, model, opt, rollout(step), mb, lasts, args.rounds, restore)})
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps({"config": args.config, "overrides": args.overrides, "env": env_line(),
                                "rows": rows}) + "\n")


# ------------------------------------------------------------------ phases of one update
class Phases:
    """Wall time per phase; nested calls are charged to the outermost timed phase only."""

    def __init__(self):
        self.t = defaultdict(float)
        self.depth = 0

    def wrap(self, name, fn):
        def w(*a, **k):
            if self.depth:
                return fn(*a, **k)
            self.depth += 1
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.t[name] += time.perf_counter() - t
                self.depth -= 1
        return w

    @contextlib.contextmanager
    def patched(self):
        import pdmask_lab.batchmask.mask as M

        saved = [(M.dirl, "response_logits"), (M, "token_stats"), (M.pre, "precondition_"),
                 (M.dirl, "jvp_logprob"), (M, "jvp_top_logprob"), (torch.autograd, "grad")]
        orig = [getattr(o, a) for o, a in saved]
        label = ["forward", "statistics", "P", "forward-mode pass", "forward-mode pass", "backward of Phi"]
        try:
            for (o, a), f, name in zip(saved, orig, label):
                setattr(o, a, self.wrap(name, f))
            yield self
        finally:
            for (o, a), f in zip(saved, orig):
                setattr(o, a, f)


def breakdown(cfg, model, opt, ro, mb, lasts, rounds, restore) -> dict:
    """Minimum over ``rounds`` of each phase of one mini-batch update, per variant."""
    import math

    from pdmask.engine.hf import response_logits
    from pdmask import Corrections, Sampling
    from pdmask.loss import policy_loss
    from pdmask.train.config import replace
    from pdmask_lab.batchmask.trainer import batch_masker
    b = ro.batch
    idx = list(range(mb))
    from pdmask.train.update import select
    sub = select(b, idx, b.attention_mask[:, :b.prompt_len].sum(1).tolist(), b.response_mask.sum(1).tolist())
    adv = ro.advantages[idx]
    if bool((adv == 0).all()):
        adv = torch.linspace(-1, 1, len(idx))
    kw = dict(corrections=cfg.loss.corrections, sampling=cfg.loss.sampling, validate=False)

    def loss_of(logits, mode, extra):
        return policy_loss(logits, sub.rollout, adv, mode=mode, **extra, **kw)

    def one(name, c):
        ph = Phases()
        restore()
        with ph.patched():
            if c.mode == "dppo-topk-kl":
                t = time.perf_counter()
                logits = response_logits(model, sub.sequences, sub.attention_mask, sub.prompt_len)
                ph.t["forward"] += time.perf_counter() - t
                extra = {}
            else:
                bm = batch_masker(model, opt, c)
                out = bm(sub.sequences, sub.attention_mask, sub.rollout, adv, validate=False, share_forward=True)
                logits, extra = out.logits, {"batch_ddot": out.ddot}
        t = time.perf_counter()
        loss = loss_of(logits, c.mode, extra)
        t1 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss.loss.backward()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
        opt.step()
        t3 = time.perf_counter()
        ph.t["loss (statistics + mask + surrogate)"] += t1 - t
        ph.t["loss backward"] += t2 - t1
        ph.t["clip + AdamW step"] += t3 - t2
        return dict(ph.t)

    cases = {"dppo-topk-kl": replace(cfg, mode="dppo-topk-kl"),
             "pdm-batch (all)": replace(cfg, mode="pdm-batch-topk-kl", batch_params="all")}
    for n in lasts:
        if 1 <= n <= cfg.num_layers:
            cases[f"pdm-batch (last {n})"] = replace(cfg, mode="pdm-batch-topk-kl", batch_params=str(n))
    res = {k: defaultdict(list) for k in cases}
    for r in range(rounds + 1):
        for k, c in cases.items():
            got = one(k, c)
            if r:
                for p, v in got.items():
                    res[k][p].append(v)
    phases = ["forward", "statistics", "backward of Phi", "P", "forward-mode pass",
              "loss (statistics + mask + surrogate)", "loss backward", "clip + AdamW step"]
    base = sum(min(v) for v in res["dppo-topk-kl"].values())
    print(f"\nphases of one mini-batch update ({int(sub.response_mask.sum())} tokens), ms, minimum over {rounds} rounds")
    print(f"{'phase':<40}" + "".join(f"{k:>18}" for k in cases))
    table = {}
    for p in phases + ["total"]:
        vals = []
        for k in cases:
            v = sum(min(x) for x in res[k].values()) if p == "total" else (min(res[k][p]) if res[k].get(p) else 0.0)
            vals.append(v)
            table.setdefault(k, {})[p] = v
        print(f"{p:<40}" + "".join(f"{1e3 * v:18.1f}" for v in vals))
    print(f"{'total / dppo':<40}" + "".join(f"{table[k]['total'] / base:18.2f}" for k in cases), flush=True)
    return table


if __name__ == "__main__":
    main()
