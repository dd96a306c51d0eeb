"""The stale-engine comparison's report (issue 45; docs/real_rl.md, "The stale engine").

Built from the records of one rung's runs only (``config.yaml``, ``metrics.jsonl``,
``summary.json`` and ``eval_answers.jsonl`` of each run directory), so it can be rebuilt from
the committed copy of them::

    python -m pdmask_lab.stale_report RUNG_DIR [--out DIR] [--versus none,dppo-topk-kl]
    # the committed page: the ladder's --report-dir copies the same records
    pdmask ladder --spec configs/real-stale.yaml --report-only --report-dir docs/results/real-stale
    python -m pdmask_lab.stale_report docs/results/real-stale/lr3e-4-sync8 --out docs/results/real-stale

Runs are grouped by **label**, the run directory's name minus ``-s<seed>``
(:func:`pdmask_lab.seed_summary.variant_label`): ``dppo-topk-kl@old`` is the mode
``dppo-topk-kl`` anchored on pi_old and is never merged with the mu-anchored runs of the same
seeds. Only finished runs (``summary.json`` and every step logged) enter; the others are named
in the notes. What it computes (:func:`stale_report`), per label:

- **per criterion** of :data:`pdmask_lab.regime.STALE_CRITERIA` (:func:`judge_stale`), each on
  its own, never as a union: the seeds that met it (with the first step), the count with its
  Clopper-Pearson interval, and against each ``versus`` label McNemar's exact test on the seeds
  both ran;
- **final held-out accuracy and its AUC** (:func:`pdmask_lab.seed_summary.run_scalars`): the
  mean over seeds with a seed-bootstrap interval, and against each ``versus`` label the mean
  paired difference, its seed-bootstrap interval, the exact sign-flip p and the power line
  (:func:`pdmask_lab.power.detectable_shift`);
- **where the region binds**, pooled over tokens and seeds with a seed-cluster bootstrap
  (:data:`ANCHOR_STATS`): masked and out-of-region shares by mini-batch, masked shares among
  ``A > 0`` / ``A < 0`` tokens, the share out of region before any update and out of a
  mu-centred region at the start, and the anchor's distance;
- **the anchor's distance by steps since the sync** (``start_divergence_q90`` and the engine
  mismatch by ``engine_lag``).

Rendered by :mod:`pdmask_lab.stale_render` (``stale.md``, ``answers.md``, ``stale_curves.png``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from pdmask.train.logging import read_jsonl
from .significance import DEFAULT_N_BOOT

#: the labels every other label is compared with: training without a trust region, and the
#: mu-anchored DPPO mask at the fp8 engine's q90
DEFAULT_VERSUS = ("none", "dppo-topk-kl")

#: where a region binds, pooled over the runs' steps and seeds: key -> (what it is, weight).
#: weight ``"num_tokens"``: a per-token share or mean, pooled as sum(value x the step's response
#: tokens) / sum(tokens) (the per-mini-batch and per-sign token counts are not logged, so the
#: shares by mini-batch and by sign of A are token-weighted over steps, an approximation of the
#: pooled share that is exact when those counts are proportional to the step's tokens); weight
#: None: a per-step statistic (a quantile), pooled as its mean over steps. Either way the
#: interval is a seed-cluster bootstrap (:func:`pdmask_lab.significance.pooled_ratio`).
ANCHOR_STATS = {
    "masked_frac": ("masked share (all mini-batches)", "num_tokens"),
    **{f"mb{j}_masked_frac": (f"masked share, mini-batch {j}", "num_tokens") for j in range(1, 9)},
    **{f"mb{j}_out_of_region_frac": (f"out-of-region share, mini-batch {j}", "num_tokens") for j in range(1, 9)},
    "masked_share_pos_adv": ("masked share among A > 0 tokens", "num_tokens"),
    "masked_share_neg_adv": ("masked share among A < 0 tokens", "num_tokens"),
    "out_before_update_frac": ("out of region before any update (mini-batch 1 at pi = pi_old)", "num_tokens"),
    "mu_region_out_frac_at_start": ("out of a region of the same delta centred on mu, at the start of the step",
                                    "num_tokens"),
    "anchor_out_of_region_frac": ("@old: out of a mu-centred region of the same delta at pi_old", "num_tokens"),
    "start_divergence_mean": ("anchor distance at the start: mean D(mu, pi_old) per token", "num_tokens"),
    "start_divergence_q50": ("anchor distance at the start: q50 of D(mu, pi_old), mean over steps", None),
    "start_divergence_q90": ("anchor distance at the start: q90 of D(mu, pi_old), mean over steps", None),
    "anchor_divergence_mean": ("@old: mean D(mu, pi_old) per token over the updates", "num_tokens"),
    "anchor_divergence_q90": ("@old: q90 of D(mu, pi_old) over the updates, mean over steps", None),
    "behaviour_weight_mean": ("@old: mean behaviour weight min(pi_old / mu, C) per token", "num_tokens"),
    **{f"mb{j}_divergence_q90": (f"q90 of the divergence to the anchor, mini-batch {j}, mean over steps", None)
       for j in range(1, 9)},
}

#: the by-lag table's metrics: key -> what it is
BY_LAG = {"start_divergence_q90": "q90 of D(mu, pi_old) at the start of the step",
          "mismatch_topk_kl": "engine mismatch: mean top-K KL(mu || pi_old) of the step's first mini-batch"}

SCALARS = {"eval_final": "final held-out greedy accuracy", "eval_auc": "area under the held-out accuracy curve "
           "(step-averaged accuracy from step 0 to the last eval; pdmask_lab.seed_summary)"}


def _seed_of(name: str) -> int | None:
    m = re.search(r"-s(\d+)$", name)
    return int(m.group(1)) if m else None


def load_runs(rung_dir: str | Path) -> tuple[list[dict], list[str]]:
    """The finished runs under ``rung_dir`` (each ``{"label", "seed", "dir", "records",
    "sync_every", "steps"}``, sorted by label then seed) and notes naming the directories left
    out (unfinished, or not a run)."""
    import yaml

    from .seed_summary import _stored_loss, variant_label

    d = Path(rung_dir)
    if not d.is_dir():
        raise ValueError(f"rung_dir: {str(d)!r} is not a directory of runs")
    runs, notes = [], []
    for r in sorted(p for p in d.iterdir() if p.is_dir()):
        if not (r / "config.yaml").is_file() or not (r / "metrics.jsonl").is_file():
            continue  # report/ and other folders that are not runs
        try:
            cfg = yaml.safe_load((r / "config.yaml").read_text()) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"{r / 'config.yaml'}: not readable YAML ({type(e).__name__})") from None
        seed, steps = cfg.get("seed"), int(cfg.get("steps") or 0)
        recs = read_jsonl(r / "metrics.jsonl")
        last = max((x.get("step", 0) for x in recs), default=-1)
        if seed is None or _seed_of(r.name) != int(seed):
            notes.append(f"{r.name}: its name does not end in -s<seed> of its config's seed; left out")
            continue
        if not (r / "summary.json").is_file() or last != steps:
            notes.append(f"{r.name}: unfinished (step {max(last, 0)} of {steps}); left out")
            continue
        label = variant_label(r, str(_stored_loss(r).get("mode", r.name)))
        runs.append({"label": label, "seed": int(seed), "dir": r, "records": recs, "steps": steps,
                     "sync_every": int(cfg.get("sync_every") or 1)})
    runs.sort(key=lambda x: (x["label"], x["seed"]))
    return runs, notes


def order_labels(labels, versus=DEFAULT_VERSUS) -> list[str]:
    """The ``versus`` labels first (in their order), then the others by mode, each variant
    right after its plain mode (``dppo-topk-kl``, ``dppo-topk-kl@old``, ...)."""
    labels = list(dict.fromkeys(labels))
    first = [v for v in versus if v in labels]
    rest = sorted((x for x in labels if x not in first), key=lambda x: (x.partition("@")[0], x))
    return first + rest


def _by_label(runs: list[dict]) -> dict[str, dict[int, dict]]:
    out: dict[str, dict[int, dict]] = {}
    for r in runs:
        out.setdefault(r["label"], {})[r["seed"]] = r
    return out


def _mcnemar(mine: dict[int, bool], ref: dict[int, bool]) -> dict:
    """McNemar's exact test of two labels' outcomes on the seeds both ran."""
    from .significance import mcnemar_exact

    common = sorted(set(mine) & set(ref))
    b = sum(mine[s] and not ref[s] for s in common)
    c = sum(ref[s] and not mine[s] for s in common)
    return {"n": len(common), "only_mode": b, "only_versus": c, "p": mcnemar_exact(b, c)}


def base_of(label: str, labels) -> str | None:
    """A variant's plain mode (``dppo-topk-kl@old`` -> ``dppo-topk-kl``) when it is among
    ``labels``, else None: the anchor comparison pairs each variant with it."""
    base = label.partition("@")[0]
    return base if "@" in label and base in labels else None


def criteria_table(by: dict[str, dict[int, dict]], labels: list[str], versus) -> dict:
    """Per :data:`~pdmask_lab.regime.STALE_CRITERIA` criterion and label: the seeds that met it
    (seed -> first step, or None), k / n with the Clopper-Pearson interval, and McNemar's test
    against each ``versus`` label present and (``vs_base``) a variant against its plain mode."""
    from .regime import STALE_CRITERIA, judge_stale
    from .significance import clopper_pearson

    met = {lab: {s: judge_stale(r["records"], sync_every=r["sync_every"]) for s, r in by[lab].items()}
           for lab in labels}
    out = {}
    for c in STALE_CRITERIA:
        rows = {}
        for lab in labels:
            hit = {s: c in m for s, m in met[lab].items()}
            k, n = sum(hit.values()), len(hit)
            lo, hi = clopper_pearson(k, n)
            rows[lab] = {"k": k, "n": n, "lo": lo, "hi": hi,
                         "per_seed": {str(s): met[lab][s].get(c) for s in sorted(hit)},
                         "vs": {v: _mcnemar(hit, {s: c in m for s, m in met[v].items()})
                                for v in versus if v in met and v != lab}, "vs_base": None}
            base = base_of(lab, met)
            if base:
                rows[lab]["vs_base"] = _mcnemar(hit, {s: c in m for s, m in met[base].items()}) | {"base": base}
        out[c] = rows
    return out


def _boot_mean(values: list[float]) -> dict:
    from .significance import pooled_ratio

    r = pooled_ratio(values, [1.0] * len(values), n_boot=DEFAULT_N_BOOT)
    return {"estimate": r.estimate, "lo": r.lo, "hi": r.hi, "n": r.n_clusters, "per_seed": list(values)}


def scalars_table(by: dict[str, dict[int, dict]], labels: list[str], versus) -> dict:
    """Per :data:`SCALARS` metric and label: the mean over seeds [seed-bootstrap interval] and,
    against each ``versus`` label (and, ``vs_base``, a variant against its plain mode) the
    paired difference on the seeds both ran (interval, exact sign-flip p, wins / losses) with
    the power line (``detectable``)."""
    from .seed_summary import run_scalars

    sc = {lab: {s: run_scalars(r["records"], sync_every=r["sync_every"]) for s, r in by[lab].items()}
          for lab in labels}
    out = {}
    for k in SCALARS:
        rows = {}
        for lab in labels:
            seeds = sorted(sc[lab])
            mine = {s: sc[lab][s][k] for s in seeds}
            row = {"mean": _boot_mean(list(mine.values())), "seeds": seeds, "vs_base": None,
                   "vs": {v: _paired(mine, {s: x[k] for s, x in sc[v].items()}) for v in versus
                          if v in sc and v != lab and set(seeds) & set(sc[v])}}
            base = base_of(lab, sc)
            if base and set(seeds) & set(sc[base]):
                row["vs_base"] = _paired(mine, {s: x[k] for s, x in sc[base].items()}) | {"base": base}
            rows[lab] = row
        out[k] = rows
    return out


def _paired(x: dict[int, float], y: dict[int, float]) -> dict:
    """``x - y`` paired on the seeds both have: :func:`pdmask_lab.significance.paired_difference`
    with the power line (``detectable``, None with fewer than 2 seeds) and the ``seeds``."""
    from .power import detectable_shift
    from .significance import paired_difference

    common = sorted(set(x) & set(y))
    a, b = [x[s] for s in common], [y[s] for s in common]
    d = paired_difference(a, b, n_boot=DEFAULT_N_BOOT).to_dict()
    d["detectable"] = detectable_shift([u - v for u, v in zip(a, b)]).to_dict() if len(common) >= 2 else None
    d["seeds"] = common
    return d


def _pooled(runs: dict[int, dict], key: str, weight: str | None) -> dict | None:
    """One :data:`ANCHOR_STATS` entry of a label, pooled over steps and seeds; None when no
    step of its runs logs ``key``."""
    from .significance import pooled_ratio

    nums, dens, steps = [], [], 0
    for r in runs.values():
        num = den = 0.0
        for x in r["records"]:
            if x.get("step", 0) <= 0 or x.get(key) is None or (weight and x.get(weight) is None):
                continue
            w = float(x[weight]) if weight else 1.0
            num, den, steps = num + float(x[key]) * w, den + w, steps + 1
        nums.append(num)
        dens.append(den)
    if steps == 0:
        return None
    p = pooled_ratio(nums, dens, n_boot=DEFAULT_N_BOOT).to_dict()
    return {"estimate": p["estimate"], "lo": p["lo"], "hi": p["hi"], "seeds": p["n_clusters"], "steps": steps,
            "tokens": p["den"] if weight else None}


def anchor_table(by: dict[str, dict[int, dict]], labels: list[str]) -> dict:
    """Per :data:`ANCHOR_STATS` key logged by any run: per label the pooled value with its
    seed-cluster bootstrap interval (None for a label whose runs do not log it)."""
    out = {}
    for key, (_, weight) in ANCHOR_STATS.items():
        rows = {lab: _pooled(by[lab], key, weight) for lab in labels}
        if any(v is not None for v in rows.values()):
            out[key] = rows
    return out


def by_lag_table(by: dict[str, dict[int, dict]], labels: list[str]) -> dict:
    """Per :data:`BY_LAG` metric and label: per ``engine_lag`` (steps since the engine's
    sync) the mean over seeds of each run's mean over its steps at that lag."""
    out = {}
    for key in BY_LAG:
        rows = {}
        for lab in labels:
            per_lag: dict[int, list[float]] = {}
            for r in by[lab].values():
                vals: dict[int, list[float]] = {}
                for x in r["records"]:
                    if x.get("step", 0) > 0 and x.get(key) is not None and x.get("engine_lag") is not None:
                        vals.setdefault(int(x["engine_lag"]), []).append(float(x[key]))
                for lag, v in vals.items():
                    per_lag.setdefault(lag, []).append(sum(v) / len(v))
            rows[lab] = {str(g): {"mean": sum(v) / len(v), "seeds": len(v)} for g, v in sorted(per_lag.items())}
        if any(rows.values()):
            out[key] = rows
    return out


def stale_report(rung_dir: str | Path, *, versus=DEFAULT_VERSUS, labels: list[str] | None = None,
                 command: str | None = None) -> dict:
    """The report's numbers (module docstring) from the finished runs under ``rung_dir``;
    ``labels`` orders (and selects) the labels, default :func:`order_labels`."""
    from .regime import FP8_FLOOR_TOPK_KL, MISMATCH_RUNAWAY_ABS, STALE_DEFINITIONS, STALE_OLD_DELTA_RULE
    from .seed_summary import SEED_DEFINITIONS, json_safe, resolution_note

    runs, notes = load_runs(rung_dir)
    if not runs:
        raise ValueError(f"rung_dir: no finished run under {str(rung_dir)!r}" + (f" ({notes[0]}; ...)" if notes else ""))
    by = _by_label(runs)
    if labels:
        unknown = [x for x in labels if x not in by]
        if unknown:
            raise ValueError(f"labels: {', '.join(unknown)} not among the finished runs' labels ({', '.join(by)})")
    labels = list(labels) if labels else order_labels(by, versus)
    for v in versus:
        if v not in labels:
            notes.append(f"no finished run of {v} among the reported labels: nothing is compared with it")
    versus = [v for v in versus if v in labels]
    if len({r["sync_every"] for r in runs}) > 1 or len({r["steps"] for r in runs}) > 1:
        notes.append("the runs differ in steps or sync_every: they are not one cell")
    sc = scalars_table(by, labels, versus)
    ns = sorted({d["n"] for row in sc["eval_final"].values() for d in row["vs"].values()})
    rep = {"name": "stale-engine comparison", "command": command, "versus": versus, "labels": labels,
           "runs": [{"label": r["label"], "seed": r["seed"], "run": r["dir"].name, "steps": r["steps"],
                     "sync_every": r["sync_every"]} for r in runs],
           "seeds": {lab: sorted(by[lab]) for lab in labels},
           "criteria": criteria_table(by, labels, versus), "scalars": sc,
           "anchor": anchor_table(by, labels), "by_lag": by_lag_table(by, labels),
           "resolution": [resolution_note(n) for n in ns], "notes": notes,
           "definitions": {"criteria": dict(STALE_DEFINITIONS), "old_delta_rule": STALE_OLD_DELTA_RULE,
                           "mismatch_bar": MISMATCH_RUNAWAY_ABS * FP8_FLOOR_TOPK_KL,
                           "eval_final": SEED_DEFINITIONS["eval_final"], "eval_auc": SEED_DEFINITIONS["eval_auc"],
                           "detectable": SEED_DEFINITIONS["detectable"],
                           "anchor": {k: v[0] for k, v in ANCHOR_STATS.items()}, "by_lag": BY_LAG}}
    return json_safe(rep)


def runs_of(rep: dict, rung_dir: str | Path) -> list[Path]:
    """The run directories the report read."""
    return [Path(rung_dir) / r["run"] for r in rep["runs"]]


def write_report(rung_dir: str | Path, out: str | Path, *, versus=DEFAULT_VERSUS, labels=None, command=None,
                 plot: bool = True, answers: int = 3, answers_seed: int | None = None) -> dict:
    """:func:`stale_report` written to ``out``: ``stale.json``, ``stale.md``, ``answers.md`` and
    (``plot``) ``stale_curves.png``. Returns the report."""
    from .stale_render import answers_markdown, plot_curves, stale_markdown

    rep = stale_report(rung_dir, versus=versus, labels=labels, command=command)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    runs = runs_of(rep, rung_dir)
    rep["environment_line"] = _environment_line(runs)
    (out / "answers.md").write_text(answers_markdown(rep, rung_dir, n=answers, seed=answers_seed))
    if plot:
        rep["plot"] = plot_curves(rep, rung_dir, out / "stale_curves.png").name
    (out / "stale.json").write_text(json.dumps(rep, indent=2, default=str))
    (out / "stale.md").write_text(stale_markdown(rep))
    return rep


def _environment_line(runs: list[Path]) -> str:
    """The runs' environment in one sentence (and a second when they are not one)."""
    from pdmask.train.environment import environments_line, one_line, runs_environments
    from .report import load_summaries

    groups = runs_environments(load_summaries(runs))
    env = groups[0]["environment"] if len(groups) == 1 else None
    return " ".join(x for x in (one_line(env) if env else "", environments_line(groups)) if x) or one_line(None)


def export_records(rung_dir: str | Path, dest: str | Path) -> int:
    """Copy the records of every run directory under ``rung_dir`` (finished or not;
    :data:`pdmask_lab.ladder_report.RECORD_FILES`, ``eval_answers.jsonl`` included) into
    ``dest/<run>/``, so the report is rebuilt from what is committed beside it; a record a run
    no longer has is removed from its copy. Returns the number of runs copied.
    Naive equivalent: ``rsync -a --include='*/' --include='{config.yaml,...}' --exclude='*'``."""
    import shutil

    from .ladder_report import RECORD_FILES

    src, dest = Path(rung_dir), Path(dest)
    if not src.is_dir():
        raise ValueError(f"rung_dir: {str(src)!r} is not a directory of runs")
    n = 0
    for r in sorted(p for p in src.iterdir() if p.is_dir() and (p / "metrics.jsonl").is_file()):
        n += 1
        for f in RECORD_FILES:
            target = dest / r.name / f
            if (r / f).is_file():
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(r / f, target)
            elif target.is_file():
                target.unlink()
    return n


def _portable(arg: str) -> str:
    """A command-line argument as the page may print it: an absolute path under the working
    directory made relative, any other absolute path cut to its last two parts."""
    import os

    if not os.path.isabs(arg):
        return arg
    p, cwd = Path(arg), Path.cwd()
    try:
        return str(p.relative_to(cwd)) or "."
    except ValueError:
        return str(Path("...", *p.parts[-2:]))


def main(argv: list[str]) -> int:
    """``python -m pdmask_lab.stale_report RUNG_DIR [--out DIR] [--versus A,B] [--labels ...]
    [--answers N] [--answers-seed S] [--no-plot]``; exit 2 with one line on bad input."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m pdmask_lab.stale_report",
                                 description="The stale-engine comparison's report, rebuilt from a rung's run records.")
    ap.add_argument("rung_dir", help="directory of the rung's runs (LABEL-s<seed>/ each)")
    ap.add_argument("--out", help="where to write stale.md, stale.json, answers.md, stale_curves.png "
                                  "(default: RUNG_DIR/stale)")
    ap.add_argument("--versus", default=",".join(DEFAULT_VERSUS), help="labels every label is compared with")
    ap.add_argument("--labels", help="the labels to report, in this order (default: all, versus first)")
    ap.add_argument("--answers", type=int, default=3, help="greedy answers shown per eval (first N prompts)")
    ap.add_argument("--answers-seed", type=int, help="the seed whose answers are shown (default: the lowest "
                                                     "seed every label has)")
    ap.add_argument("--records-to", help="first copy the runs' records (config.yaml, metrics.jsonl, summary.json, "
                                         "eval_answers.jsonl) into this directory and build the report from the copy")
    ap.add_argument("--no-plot", action="store_true")
    a = ap.parse_args(argv)
    if a.answers < 0:
        print(f"--answers: must be >= 0, got {a.answers}")
        return 2
    rung = a.rung_dir
    out = a.out or str(Path(a.records_to or rung) / "stale")
    cmd = "python -m pdmask_lab.stale_report " + " ".join(map(_portable, argv))
    try:
        if a.records_to:
            print(f"copied the records of {export_records(rung, a.records_to)} runs to {a.records_to}")
            rung = a.records_to
        rep = write_report(rung, out, versus=[v for v in a.versus.split(",") if v],
                           labels=[x for x in a.labels.split(",") if x] if a.labels else None, command=cmd,
                           plot=not a.no_plot, answers=a.answers, answers_seed=a.answers_seed)
    except ValueError as e:
        print(e)
        return 2
    print(f"{len(rep['runs'])} finished runs, {len(rep['labels'])} labels; wrote {Path(out) / 'stale.md'}")
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
