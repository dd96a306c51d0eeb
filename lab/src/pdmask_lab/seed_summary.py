"""Across-seed summary of a compare: per-mode scalars and paired tests against a reference.

Every run is reduced to a few scalars (:func:`run_scalars`: final and last-5 held-out
accuracy, area under the eval curve, worst drop from the running best, final mismatch,
masked fraction). The runs of a ``pdmask compare`` share data and seeds, so a mode is
compared with the reference mode **seed by seed** (:func:`seed_summary`): the mean of
the per-seed differences with a seed-bootstrap interval and an exact sign-flip p-value
(:mod:`pdmask_lab.significance`). Rendered by :func:`seed_tables` (rich) and
:func:`seed_markdown`; written by ``pdmask compare`` and ``pdmask report`` into
``summary.json`` (key ``across_seeds``) and ``summary.md``.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from .significance import DEFAULT_N_BOOT
from pdmask.train.logging import read_jsonl


def _stored_loss(run: Path) -> dict:
    """The loss fields a run's ``config.yaml`` holds, as given (nested; either version of
    the file: :func:`pdmask.train.config.stored_loss`); empty when it has none."""
    import yaml

    from pdmask.train.config import stored_loss

    cfg = yaml.safe_load((run / "config.yaml").read_text()) if (run / "config.yaml").exists() else {}
    return stored_loss(cfg or {})


def labelled_delta(loss: dict):
    """A run's ``delta_high`` as its group label states it: None where it is the mode's default
    (a record since issue 42 writes the default out as a number, an older one wrote null, read as
    the default at the time: :data:`pdmask.train.loss_spec.RECORDED_BEFORE_42`), so that both
    group together, and apart from runs at another delta once a default changes."""
    from pdmask import MODES
    from pdmask.train.loss_spec import RECORDED_BEFORE_42

    mode, d = loss.get("mode"), loss.get("thresholds", {}).get("delta_high")
    old = RECORDED_BEFORE_42.get(mode) if isinstance(mode, str) else None
    if d is None and old is not None:
        d = old[2]
    default = MODES[mode].default_delta if mode in MODES else (old[2] if old is not None else None)
    return None if d is None or d == default else d


def variant_label(run: Path, mode: str) -> str:
    """The label a run is grouped under: ``MODE@VARIANT`` when its directory is named
    ``MODE@VARIANT-s<seed>`` with ``MODE`` its stored mode (a ladder cell of a variant,
    :func:`pdmask_lab.ladder.mode_of`, e.g. ``dppo-topk-kl@old`` run with ``anchor: old``),
    else the mode itself. A variant is the same mode with other settings, so its stored
    ``loss.mode`` alone would merge it with the plain mode's runs of the same seeds."""
    label = re.sub(r"-s\d+$", "", run.name)
    return label if "@" in label and label.partition("@")[0] == mode else mode


def run_label(run: Path) -> tuple[str, str]:
    """(group label, run name): runs of the same mode (or variant label, :func:`variant_label`)
    and thresholds share a group."""
    loss = _stored_loss(run)
    mode = variant_label(run, loss.get("mode", run.name))
    d = labelled_delta(loss)
    group = mode if d is None else f"{mode} δ={d:g}"
    return group, run.name


#: the per-run scalars of the across-seed summary: (key, column label, format spec)
SEED_METRICS = [
    ("eval_final", "final eval acc", ".3f"),
    ("eval_last5", "last-5 evals", ".3f"),
    ("eval_auc", "eval AUC", ".3f"),
    ("worst_drop", "worst drop", ".3f"),
    ("mismatch_final", "final mismatch", ".2e"),
    ("masked_frac", "masked", ".3%"),
    ("out_of_region_frac", "out of region", ".2%"),
    ("disagreement_frac", "disagreement", ".2%"),
    ("corrective_frac", "corrective", ".2%"),
]

#: the shares pooled over tokens (sum over a run's steps, then over seeds with a seed-cluster
#: bootstrap): key -> (numerator count, denominator count, the denominator's unit). A step
#: that logs the fraction (the key) but not the numerator count adds ``fraction * denominator``.
POOLED_SHARES = {
    "masked_frac": ("num_masked", "num_tokens", "tokens"),
    "out_of_region_frac": ("num_out_of_region", "num_tokens", "tokens"),
    "disagreement_frac": ("num_disagreement", "num_out_of_region", "out-of-region tokens"),
    "corrective_frac": ("num_corrective", "num_tokens", "tokens"),
}

#: what each scalar is (written into summary.json / summary.md)
SEED_DEFINITIONS = {
    "eval_final": "held-out greedy accuracy (eval_accuracy) at the last eval of the run",
    "eval_last5": "mean eval_accuracy of the run's last 5 evals (fewer if the run has fewer)",
    "eval_auc": "area under the eval curve divided by its step span: trapezoid rule over "
                "(step, eval_accuracy) from step 0 (the SFT base, shared by every run) to the last eval, "
                "/ (last step - first step); i.e. the step-averaged accuracy, in accuracy units",
    "worst_drop": "collapse indicator: max over evals of (best eval_accuracy so far - eval_accuracy); 0 for a "
                  "curve that never falls",
    "mismatch_final": "mean mismatch_topk_kl (engine vs trainer before each step's updates) over the last "
                      "ceil(5 / sync_every) * sync_every steps (whole sync cycles, at least 5 steps)",
    "masked_frac": "masked tokens / response tokens, pooled over the run's steps (sum / sum); per mode pooled "
                   "over seeds with a seed-cluster bootstrap. Masked counts per step are num_masked when "
                   "logged, else masked_frac * num_tokens (exact when a step's mini-batches hold equal "
                   "token counts, else a token-weighted approximation)",
    "out_of_region_frac": "tokens outside the trust region (the mode's divergence above its delta) / response "
                          "tokens, pooled as masked_frac (counts: num_out_of_region)",
    "disagreement_frac": "out-of-region tokens where the ratio's direction and the predictive direction of the "
                         "mode's divergence disagree on 'outward' / out-of-region tokens, pooled as masked_frac "
                         "(counts: num_disagreement over num_out_of_region)",
    "corrective_frac": "the smooth weights (drpo, pdm-smooth-*): tokens whose weight is negative (the step "
                       "pushes the token's log-probability back toward the engine) / response tokens, pooled as "
                       "masked_frac; '-' for a mode without a smooth weight",
}

#: the power column of paired tables (compare's and the ladder's)
DETECTABLE_HEADER = "detectable Δ final acc (80% power)"
#: the scalars that get the power line in the paired table: (key, column header)
POWER_METRICS = (("eval_final", DETECTABLE_HEADER), ("eval_auc", "detectable Δ AUC (80% power)"))
DETECTABLE_DEFINITION = ("the smallest mean paired difference (either sign) of final accuracy (of the AUC in "
                         "its own column) that a two-sided sign-flip test on these n seeds rejects at alpha = 0.05 with 80% power, the "
                         "noise resampled from the observed per-seed differences (pdmask_lab.power.detectable_shift); "
                         "'none' when n seeds cannot reach p <= 0.05 at all")
SEED_DEFINITIONS["detectable"] = DETECTABLE_DEFINITION

DEFAULT_REFERENCE = "dppo-topk-kl"


def _pooled_counts(steps: list[dict], key: str) -> dict:
    """(numerator, denominator) of one :data:`POOLED_SHARES` share summed over the steps that
    log both, and ``how`` the numerator was counted (the count, fraction * denominator, both
    joined by " + ", or None when no step logs it)."""
    num_key, den_key, _ = POOLED_SHARES[key]
    num = den = 0.0
    how = set()
    for r in steps:
        if r.get(den_key) is None:
            continue
        if r.get(num_key) is not None:
            num += r[num_key]
            how.add(num_key)
        elif r.get(key) is not None:
            num += r[key] * r[den_key]
            how.add(f"{key}*{den_key}")
        else:
            continue
        den += r[den_key]
    return {"num": num, "den": den, "how": " + ".join(sorted(how)) or None}


def run_scalars(records: list[dict], *, sync_every: int = 1) -> dict:
    """Headline scalars of one run (see :data:`SEED_DEFINITIONS`) from its metrics records.

    Also returns ``counts``: per :data:`POOLED_SHARES` share its pooled ``num`` / ``den``
    over the run's steps and ``how`` the numerator was counted; ``steps`` and ``evals``.
    """
    import numpy as np

    evals = sorted((r["step"], r["eval_accuracy"]) for r in records if r.get("eval_accuracy") is not None)
    if not evals:
        raise ValueError("metrics.jsonl: no eval_accuracy records")
    s, a = (np.array(v, dtype=np.float64) for v in zip(*evals))
    span = s[-1] - s[0]
    auc = float(np.sum((a[1:] + a[:-1]) / 2 * np.diff(s)) / span) if span > 0 else float(a[-1])
    steps = sorted((r for r in records if r.get("step", 0) > 0), key=lambda r: r["step"])
    window = max(1, sync_every) * math.ceil(5 / max(1, sync_every))
    mm = [r["mismatch_topk_kl"] for r in steps[-window:] if r.get("mismatch_topk_kl") is not None]
    counts = {k: _pooled_counts(steps, k) for k in POOLED_SHARES}
    shares = {k: c["num"] / c["den"] if c["den"] > 0 else None for k, c in counts.items()}
    return {
        "eval_final": float(a[-1]), "eval_last5": float(a[-5:].mean()), "eval_auc": auc,
        "worst_drop": float((np.maximum.accumulate(a) - a).max()),
        "mismatch_final": float(np.mean(mm)) if mm else None, **shares, "counts": counts,
        "steps": int(steps[-1]["step"]) if steps else 0, "evals": len(evals),
    }


def _counts(runs: list[dict], key: str) -> tuple[list[float], list[float]]:
    """Per-run (numerators, denominators) of one pooled share, for the cluster bootstrap."""
    return [r["counts"][key]["num"] for r in runs], [r["counts"][key]["den"] for r in runs]


def _run_info(run: Path) -> dict:
    import yaml

    p = run / "config.yaml"
    if not p.exists():
        raise ValueError(f"config.yaml: missing in run directory {str(run)!r} (needed for its mode and seed)")
    cfg = yaml.safe_load(p.read_text()) or {}
    group, _ = run_label(run)
    loss = _stored_loss(run)
    # "mode" is the variant label: a MODE@VARIANT run pairs with, and is reported as, its own label
    mode = variant_label(run, loss.get("mode", run.name))
    return {"run": run.name, "group": group, "mode": mode, "seed": cfg.get("seed"),
            "delta_high": labelled_delta(loss), "sync_every": int(cfg.get("sync_every") or 1)}


def _reference_group(groups: dict, reference: str, delta) -> str | None:
    """The reference mode's group at the same delta, else its only group, else None."""
    cands = [g for g, v in groups.items() if v["mode"] == reference]
    same = [g for g in cands if groups[g]["delta_high"] == delta]
    if same:
        return same[0]
    return cands[0] if len(cands) == 1 else None


def resolution_note(n: int) -> str:
    """What ``n`` paired seeds can resolve, in one honest line."""
    from .significance import min_sign_flip_p

    if n < 1:
        return "No paired seeds: nothing can be compared."
    pmin = min_sign_flip_p(n)
    s = (f"With {n} paired seed{'s' if n != 1 else ''} the smallest attainable two-sided sign-flip p is "
         f"2/2^{n} = {pmin:.3g}")
    if pmin >= 0.05:
        s += ": no difference can reach p < 0.05 (that takes at least 6 seeds)"
    s += (". Bootstrap intervals over few seeds are too narrow: read them as the spread of these seeds. "
          "p-values are per comparison, not corrected for the number of modes x metrics.")
    return s


def seed_summary(runs: list[Path], *, reference: str = DEFAULT_REFERENCE, require_reference: bool = False,
                 n_boot: int = DEFAULT_N_BOOT, level: float = 0.95, seed: int = 0) -> dict:
    """Across-seed summary of the runs: per mode, and paired against ``reference`` by seed.

    Per group (mode, or mode + delta): the mean and min-max over seeds of every
    :data:`SEED_METRICS` scalar, and the :data:`POOLED_SHARES` pooled over seeds (sum/sum,
    with a seed-cluster bootstrap interval). Against the reference group (same delta when
    there is one), on the seeds both have: the mean paired difference with a seed
    bootstrap interval and the two-sided sign-flip p-value
    (:func:`pdmask_lab.significance.paired_difference`); for the pooled shares, the
    difference of the pooled fractions with a paired cluster bootstrap and the sign-flip
    p-value of the per-seed fraction differences.

    ``require_reference``: raise if no run has mode ``reference`` (else the paired part
    is left out with a note).
    """
    from .power import detectable_shift
    from .significance import paired_difference, paired_ratio_difference, pooled_ratio, sign_flip_test

    boot = dict(n_boot=n_boot, level=level, seed=seed)
    groups: dict[str, dict] = {}
    for r in runs:
        info = _run_info(r)
        g = groups.setdefault(info["group"], {"mode": info["mode"], "delta_high": info["delta_high"], "runs": {}})
        if info["seed"] in g["runs"]:
            raise ValueError(f"run_dirs: two runs of {info['group']} with seed {info['seed']} "
                             f"({g['runs'][info['seed']]['run']}, {info['run']}); give one compare directory at a time")
        g["runs"][info["seed"]] = info | run_scalars(read_jsonl(r / "metrics.jsonl"), sync_every=info["sync_every"])
    modes = sorted({g["mode"] for g in groups.values()})
    notes = []
    if reference not in modes:
        if require_reference:
            raise ValueError(f"reference: mode {reference!r} is not among the runs' modes ({', '.join(modes)})")
        notes.append(f"No paired differences: the reference mode {reference} is not among the runs.")
    out_groups = []
    for name, g in groups.items():
        seeds = sorted(g["runs"], key=lambda x: (x is None, x))
        rs = [g["runs"][s] for s in seeds]
        stats = {}
        for k, _, _ in SEED_METRICS:
            vals = [r[k] for r in rs if r[k] is not None]
            stats[k] = ({"mean": sum(vals) / len(vals), "min": min(vals), "max": max(vals)} if vals else None)
            if stats[k] is not None:
                stats[k]["per_seed"] = [r[k] for r in rs]
        pooled = {k: pooled_ratio(*_counts(rs, k), **boot).to_dict() for k in POOLED_SHARES}
        entry = {"group": name, "mode": g["mode"], "delta_high": g["delta_high"], "seeds": seeds,
                 "n_seeds": len(seeds), "steps": sorted({r["steps"] for r in rs}), "metrics": stats,
                 "pooled": pooled, "runs": {str(s): g["runs"][s] for s in seeds}, "vs_reference": None}
        ref = _reference_group(groups, reference, g["delta_high"]) if reference in modes else None
        if reference in modes and ref is None:
            notes.append(f"{name}: no unambiguous {reference} group to pair with (several deltas).")
        if ref is not None and ref != name:
            rr = groups[ref]["runs"]
            common = [s for s in seeds if s in rr]
            vs: dict = {"reference_group": ref, "seeds": common, "n": len(common)}
            if len(common) < len(seeds) or len(common) < len(rr):
                notes.append(f"{name} vs {ref}: paired on the {len(common)} seeds both have.")
            for k, _, _ in SEED_METRICS:
                xs = [(g["runs"][s][k], rr[s][k]) for s in common]
                xs = [(x, y) for x, y in xs if x is not None and y is not None]
                if not xs:
                    vs[k] = None
                elif k in POOLED_SHARES:
                    d = paired_ratio_difference(*_counts([g["runs"][s] for s in common], k),
                                                *_counts([rr[s] for s in common], k), **boot)
                    sf = sign_flip_test([x - y for x, y in xs], seed=seed)
                    vs[k] = {"estimate": d.estimate, "lo": d.lo, "hi": d.hi, "p": sf.p, "p_method": sf.method,
                             "min_p": sf.min_p, "n": d.n_clusters, "a": d.a, "b": d.b,
                             "how": "difference of pooled fractions, paired cluster bootstrap; "
                                    "sign-flip p on per-seed fraction differences"}
                else:
                    vs[k] = paired_difference([x for x, _ in xs], [y for _, y in xs], **boot).to_dict()
                if any(k == pk for pk, _ in POWER_METRICS) and len(xs) >= 2:  # the power line: what these seeds could have found
                    vs[k]["detectable"] = detectable_shift([x - y for x, y in xs], seed=seed).to_dict()
            entry["vs_reference"] = vs
        out_groups.append(entry)
    out_groups.sort(key=lambda e: e["mode"] != reference)  # stable: the reference first, then run order
    steps = {s for e in out_groups for s in e["steps"]}
    if len(steps) > 1:
        notes.append(f"Runs have different lengths ({', '.join(map(str, sorted(steps)))} steps): "
                     "some are unfinished; their scalars are not comparable.")
    ns = sorted({e["vs_reference"]["n"] for e in out_groups if e["vs_reference"]})
    return json_safe({"reference": reference, "level": level, "n_boot": n_boot, "bootstrap_seed": seed,
           "n_seeds": max((e["n_seeds"] for e in out_groups), default=0),
           "definitions": SEED_DEFINITIONS, "groups": out_groups,
           "resolution": [resolution_note(n) for n in ns], "notes": notes})


def mean_present(xs):
    """The mean of the values that are not None; None when none is."""
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def json_safe(v):
    """nan/inf (no interval, no rate) become None, so summary.json is strict JSON."""
    if isinstance(v, dict):
        return {k: json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_safe(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def _cell(stat: dict | None, spec: str) -> str:
    """``mean (min–max)``: a range in parentheses, so it is not read as an interval."""
    if stat is None:
        return "-"
    if math.isclose(stat["min"], stat["max"], rel_tol=1e-9, abs_tol=1e-12):
        return format(stat["mean"], spec)
    return f"{stat['mean']:{spec}} ({stat['min']:{spec}}–{stat['max']:{spec}})"


def _diff_cell(d: dict | None, spec: str) -> str:
    from .significance import format_interval, format_p

    if d is None:
        return "-"
    return f"{format_interval(d['estimate'], d['lo'], d['hi'], spec=spec, sign=True)} {format_p(d['p'])}"


def detectable_cell(d: dict | None) -> str:
    """``±0.071``: the power line's number (see :data:`DETECTABLE_DEFINITION`)."""
    det = (d or {}).get("detectable")
    if not det:
        return "-"
    sh = det["shift"]  # inf (no shift detectable) is None once json_safe has run
    return "none" if sh is None or math.isinf(sh) else f"±{sh:.3f}"


def _pooled_cell(p: dict, key: str, spec: str) -> str:
    from .significance import format_rate

    if p["estimate"] is None:  # no step logged the share's counts
        return "-"
    return format_rate(p["estimate"], p["lo"], p["hi"], n_units=p["den"], unit=POOLED_SHARES[key][2], spec=spec)


def seed_rows(summary: dict) -> tuple[list[str], list[list[str]], list[str], list[list[str]]]:
    """(headers, rows) of the per-mode table and of the paired-difference table."""
    h1 = ["mode", "seeds", "steps"] + [lab if k not in POOLED_SHARES else f"{lab} (pooled over seeds)"
                                       for k, lab, _ in SEED_METRICS]
    r1 = [[e["group"], str(e["n_seeds"]), "/".join(map(str, e["steps"]))]
          + [_cell(e["metrics"][k], f) if k not in POOLED_SHARES else _pooled_cell(e["pooled"][k], k, f)
             for k, _, f in SEED_METRICS] for e in summary["groups"]]
    h2 = ["mode", "vs", "paired seeds"] + [lab for _, lab, _ in SEED_METRICS] + [h for _, h in POWER_METRICS]
    r2 = [[e["group"], e["vs_reference"]["reference_group"], str(e["vs_reference"]["n"])]
          + [_diff_cell(e["vs_reference"][k], f) for k, _, f in SEED_METRICS]
          + [detectable_cell(e["vs_reference"][k]) for k, _ in POWER_METRICS]
          for e in summary["groups"] if e["vs_reference"]]
    return h1, r1, h2, r2


def seed_tables(summary: dict) -> list:
    """Rich tables of :func:`seed_summary`: per mode, then paired differences vs the reference."""
    from rich.markup import escape
    from rich.table import Table

    h1, r1, h2, r2 = seed_rows(summary)
    lv = f"{summary['level']:.0%}"
    t1 = Table(title=escape("Across seeds: mean (min–max) over seeds; shares: pooled over tokens and seeds "
                            f"[{lv} seed-bootstrap interval]"))
    t2 = Table(title=escape(f"Paired difference vs {summary['reference']} (mean of per-seed differences "
                            f"[{lv} seed-bootstrap interval], two-sided sign-flip p)"))
    for t, h, rows in ((t1, h1, r1), (t2, h2, r2)):
        for c in h:
            t.add_column(escape(c), justify="left" if c in ("mode", "vs") else "right")
        for row in rows:  # the p-value under its interval keeps the columns narrow
            t.add_row(*(escape(c).replace("] p = ", "]\np = ") for c in row))
    return [t1, t2] if r2 else [t1]


def seed_markdown(summary: dict) -> str:
    """The across-seed summary as markdown (tables, definitions, resolution, notes)."""
    h1, r1, h2, r2 = seed_rows(summary)
    lv = f"{summary['level']:.0%}"

    def table(h, rows):
        return "\n".join(["| " + " | ".join(h) + " |", "|" + "---|" * len(h)]
                         + ["| " + " | ".join(r) + " |" for r in rows])

    out = [f"## Across seeds ({summary['n_seeds']} seeds per mode at most)", "",
           f"Mean over seeds (min–max); the shares (masked, out of region, disagreement) pooled over tokens and "
           f"seeds [{lv} seed-bootstrap interval] (their denominators' token counts).", "", table(h1, r1), ""]
    if r2:
        out += [f"Paired by seed against {summary['reference']}: mean of per-seed differences "
                f"[{lv} seed-bootstrap percentile interval], two-sided sign-flip p "
                f"(exact over all 2^n sign assignments for n <= 16).", "", table(h2, r2), ""]
    out += [f"- {line}" for line in summary["resolution"] + summary["notes"]]
    out += ["", "Definitions:", ""] + [f"- `{k}`: {v}" for k, v in summary["definitions"].items()]
    return "\n".join(out) + "\n"
