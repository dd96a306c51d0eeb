"""Constructed compare directories for the across-seed summary and report tests.

Four seeds (0..3) of three modes, 8 RL steps, an eval at every step, sync_every = 2:

- dppo-topk-kl (the reference): eval curve REF (+0.01 * seed after step 0), monotone;
  masked_frac 0.01 * (seed + 1) on 1000 * (seed + 1) tokens per step (num_masked not logged).
- pdm-topk-kl: REF + PDM_OFFSET[seed] at every step >= 1; num_masked = 30 of 1000 tokens per
  step (and a wrong masked_frac 0.5, which must be ignored: counts win); 100 tokens out of
  region per step, 10 * (seed + 1) of them disagreeing (the ratio's direction vs the predictive).
- dppo-topk-kl logs out_of_region_frac 0.2 without its count, and disagreement_frac without
  num_out_of_region (its denominator): the first pools as 0.2 * tokens, the second not at all.
- none: rises to 0.60 + 0.01 * seed at step 4, then collapses to 0.20 + 0.01 * seed.
"""

import json

import yaml

from pdmask.train.config import load_config, replace

REF = [0.10, 0.40, 0.50, 0.55, 0.60, 0.60, 0.62, 0.64, 0.65]  # steps 0..8
NONE = [0.10, 0.40, 0.50, 0.55, 0.60, 0.40, 0.30, 0.25, 0.20]
PDM_OFFSET = [0.10, 0.05, -0.02, 0.07]
SEEDS = range(4)
MODES = ("dppo-topk-kl", "pdm-topk-kl", "none")


def curve(mode, seed):
    base = NONE if mode == "none" else REF
    off = PDM_OFFSET[seed] if mode == "pdm-topk-kl" else 0.0
    return [base[0]] + [v + 0.01 * seed + off for v in base[1:]]


def write_run(root, mode, seed, *, sync_every=2, steps=8):
    """One run directory (config.yaml written by the real TrainConfig, synthetic metrics.jsonl)."""
    cfg = replace(load_config(None, []), mode=mode, seed=seed, sync_every=sync_every, name=f"{mode}-s{seed}",
                  out_dir=str(root))
    d = root / cfg.run_name
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    acc = curve(mode, seed)
    recs = [{"step": 0, "eval_accuracy": acc[0]}]
    for t in range(1, steps + 1):
        r = {"step": t, "eval_accuracy": acc[t], "reward": 0.5,
             "mismatch_topk_kl": (1e-2 if mode == "none" else 1e-3) * t}
        if mode == "dppo-topk-kl":
            r.update(masked_frac=0.01 * (seed + 1), num_tokens=1000.0 * (seed + 1), out_of_region_frac=0.2,
                     disagreement_frac=0.05)
        elif mode == "pdm-topk-kl":
            r.update(masked_frac=0.5, num_masked=30.0, num_tokens=1000.0, num_out_of_region=100.0,
                     num_disagreement=10.0 * (seed + 1))
        else:
            r.update(masked_frac=0.0, num_tokens=1000.0)
        recs.append(r)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return d


def make_compare_dir(root):
    for mode in MODES:
        for s in SEEDS:
            write_run(root, mode, s)
    return root


def runs_of(root):
    return sorted(d for d in root.iterdir() if (d / "metrics.jsonl").exists())
