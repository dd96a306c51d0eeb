"""Training evidence for the batch-aware mask: paired per-seed differences of one mode
against several references, read from finished runs (nothing is trained here).

A directory of runs (a ``pdmask compare`` output, or one rung of the mismatch ladder) holds
runs of several modes on the same seeds and data. For ``--mode`` against every
``--references`` mode, on the seeds both finished:

- final held-out accuracy, mean of the last 5 evals, eval AUC, worst drop: mean paired
  difference (mode - reference) with a seed-bootstrap 95% interval and the exact two-sided
  sign-flip p (:func:`pdmask_lab.seed_summary.seed_summary`, which calls
  :func:`pdmask_lab.significance.paired_difference`);
- collapse (the ladder's rule: held-out accuracy fell >= ``--collapse-drop`` below its
  running best, or the final accuracy is below the run's step-0 SFT accuracy): k/n per
  mode and McNemar's exact test on the seeds where exactly one of the two collapsed;
- the masked fraction pooled over the seeds' tokens (sum/sum, seed-cluster bootstrap).

Only runs with a ``summary.json`` (finished) count; unfinished ones are listed in the notes.
Writes ``--out``.json and ``--out``.md.

    python benchmarks/bench_batch_paired.py RUN_DIR --mode pdm-batch-topk-kl \\
        --references dppo-topk-kl,pdm-topk-kl --label "stress" --out docs/results/batch/stress/paired
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from pdmask_lab.significance import format_interval, format_p, mcnemar_exact, min_sign_flip_p, pooled_ratio
from pdmask.train.logging import read_jsonl
from pdmask.train.portable import portable_path
from pdmask_lab.report import find_runs
from pdmask_lab.seed_summary import seed_summary

#: (key in the across-seed summary, label, format)
METRICS = [("eval_final", "final acc", ".3f"), ("eval_last5", "last-5 evals", ".3f"),
           ("eval_auc", "eval AUC", ".3f"), ("worst_drop", "worst drop", ".3f")]


def collapsed(run: dict, step0: float | None, drop: float) -> bool:
    """The mismatch ladder's collapse rule (pdmask_lab.ladder_report on the ladder branch)."""
    return run["worst_drop"] >= drop - 1e-12 or (step0 is not None and run["eval_final"] < step0 - 1e-12)


def step0_accuracy(run: Path) -> float | None:
    for r in read_jsonl(run / "metrics.jsonl"):
        if r.get("step") == 0 and r.get("eval_accuracy") is not None:
            return float(r["eval_accuracy"])
    return None


def mismatch_mean(run: Path) -> float | None:
    """Mean over the RL steps of mismatch_topk_kl (engine vs trainer before each step's updates)."""
    v = [r["mismatch_topk_kl"] for r in read_jsonl(run / "metrics.jsonl")
         if r.get("step", 0) > 0 and r.get("mismatch_topk_kl") is not None]
    return sum(v) / len(v) if v else None


def direction_counts(run: Path) -> dict | None:
    """Out-of-region tokens where the batch direction agrees with the ratio's / the per-token
    predictive direction's, and where it calls the token outward, summed over the run's steps.
    The trainer logs these fractions as the mean over a step's updates and num_out_of_region as
    their sum, so fraction x count is exact when the updates hold equal |O| and a count-weighted
    approximation otherwise. None for a run without them."""
    keys = ("batch_agree_ratio_frac", "batch_agree_pdm_frac", "batch_outward_frac_out_of_region")
    tot = {k: 0.0 for k in keys}
    n = 0.0
    for r in read_jsonl(run / "metrics.jsonl"):
        if r.get("step", 0) > 0 and r.get("num_out_of_region") and all(r.get(k) is not None for k in keys):
            n += r["num_out_of_region"]
            for k in keys:
                tot[k] += r[k] * r["num_out_of_region"]
    return {"n": n, **tot} if n > 0 else None


def _group(summary: dict, mode: str) -> dict:
    g = [e for e in summary["groups"] if e["mode"] == mode]
    if len(g) != 1:
        raise SystemExit(f"--mode/--references: expected one group of mode {mode!r}, found {len(g)}")
    return g[0]


def paired(run_dir: Path, mode: str, references: list[str], drop: float) -> dict:
    wanted = {mode, *references}
    all_runs = [r for r in find_runs([run_dir])]
    notes = []
    runs = []
    for r in all_runs:
        import yaml

        m = (yaml.safe_load((r / "config.yaml").read_text()) or {}).get("mode")
        if m not in wanted:
            continue
        if not (r / "summary.json").exists():
            notes.append(f"{r.name}: unfinished (no summary.json); left out")
            continue
        runs.append(r)
    step0 = {r.name: step0_accuracy(r) for r in runs}
    mism = {r.name: mismatch_mean(r) for r in runs}
    out = {"run_dir": portable_path(run_dir), "mode": mode, "references": references, "collapse_drop": drop,
           "notes": notes, "per_mode": {}, "vs": {}}
    for ref in references:
        s = seed_summary(runs, reference=ref, require_reference=True)
        g, rg = _group(s, mode), _group(s, ref)
        for e in (g, rg):
            if e["mode"] not in out["per_mode"]:
                coll = {sd: collapsed(r, step0[r["run"]], drop) for sd, r in e["runs"].items()}
                m = e["metrics"]
                out["per_mode"][e["mode"]] = {
                    "n_seeds": e["n_seeds"], "seeds": e["seeds"],
                    **{k: m[k]["mean"] for k, _, _ in METRICS},
                    "per_seed_final": m["eval_final"]["per_seed"],
                    "mismatch_mean": _mean([mism[r["run"]] for r in e["runs"].values()]),
                    "collapsed": sum(coll.values()), "collapsed_seeds": sorted(int(k) for k, v in coll.items() if v),
                    "masked_pooled": e["pooled"]["masked_frac"]}
        vs = g["vs_reference"]
        common = [str(sd) for sd in vs["seeds"]]
        cm = {sd: collapsed(g["runs"][sd], step0[g["runs"][sd]["run"]], drop) for sd in common}
        cr = {sd: collapsed(rg["runs"][sd], step0[rg["runs"][sd]["run"]], drop) for sd in common}
        b = sum(cm[sd] and not cr[sd] for sd in common)
        c = sum(cr[sd] and not cm[sd] for sd in common)
        out["vs"][ref] = {"n": vs["n"], "seeds": vs["seeds"], **{k: vs[k] for k, _, _ in METRICS},
                          "masked_frac": vs["masked_frac"],
                          "collapse": {"only_mode": b, "only_reference": c, "p": mcnemar_exact(b, c)}}
        out["notes"] += [n for n in s["notes"] if n not in out["notes"]]
    mine = [r for r in runs if r.name in {x["run"] for x in _group(s, mode)["runs"].values()}]
    cnt = [c for c in map(direction_counts, mine) if c is not None]
    if cnt:  # the batch direction vs the per-token ones on O, pooled over steps and seeds
        den = [c["n"] for c in cnt]
        out["direction_on_O"] = {"n_tokens": sum(den), "n_seeds": len(cnt), **{
            k: pooled_ratio([c[k] for c in cnt], den).to_dict()
            for k in ("batch_agree_ratio_frac", "batch_agree_pdm_frac", "batch_outward_frac_out_of_region")}}
    return out


def _mean(v: list) -> float | None:
    v = [x for x in v if x is not None]
    return sum(v) / len(v) if v else None


def _d(x: dict, spec: str) -> str:
    lo = math.nan if x["lo"] is None else x["lo"]
    hi = math.nan if x["hi"] is None else x["hi"]
    return f"{format_interval(x['estimate'], lo, hi, spec=spec, sign=True)}, {format_p(x['p'])}"


def markdown(res: dict, label: str) -> str:
    mode = res["mode"]
    lines = [f"### {label}: `{mode}` vs {', '.join(f'`{r}`' for r in res['references'])}", "",
             f"Runs: `{res['run_dir']}`. Per mode: mean over seeds; collapse: worst drop >= "
             f"{res['collapse_drop']:g} or final < SFT accuracy; mismatch: mean over steps of mismatch_topk_kl.", "",
             "| mode | seeds | final acc | last-5 evals | eval AUC | worst drop | collapsed | masked (pooled, tokens) "
             "| mismatch (top-K KL) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for m, v in res["per_mode"].items():
        mp = v["masked_pooled"]
        lines.append(f"| {m} | {v['n_seeds']} | {v['eval_final']:.3f} | {v['eval_last5']:.3f} | {v['eval_auc']:.3f} "
                     f"| {v['worst_drop']:.3f} | {v['collapsed']}/{v['n_seeds']} "
                     f"| {mp['estimate']:.2%} ({mp['den']:.0f} tokens) | {v['mismatch_mean']:.2e} |")
    lines += ["", f"Paired, `{mode}` minus reference, mean over seeds [95% seed-bootstrap interval], "
                  "two-sided sign-flip p; collapse: McNemar exact on the discordant seeds:", "",
              "| reference | n seeds | Δ final acc | Δ last-5 evals | Δ eval AUC | Δ worst drop | collapsed only mode / only ref |",
              "|---|---|---|---|---|---|---|"]
    for ref, v in res["vs"].items():
        c = v["collapse"]
        lines.append(f"| {ref} | {v['n']} | " + " | ".join(_d(v[k], f) for k, _, f in METRICS)
                     + f" | {c['only_mode']} / {c['only_reference']}, {format_p(c['p'])} |")
    if res.get("direction_on_O"):
        d = res["direction_on_O"]

        def pr(x):
            return f"{x['estimate']:.1%} [{x['lo']:.1%}, {x['hi']:.1%}]"
        lines += ["", f"On the out-of-region tokens of `{mode}`'s own runs ({d['n_tokens']:.0f} token-updates, "
                      f"{d['n_seeds']} seeds; pooled over steps, 95% seed-cluster interval): the batch direction agrees "
                      f"with the ratio's on {pr(d['batch_agree_ratio_frac'])}, with the per-token predictive "
                      f"direction's on {pr(d['batch_agree_pdm_frac'])}, and calls "
                      f"{pr(d['batch_outward_frac_out_of_region'])} of them outward (masked)."]
    ns = sorted({v["n"] for v in res["vs"].values()})
    lines += ["", "; ".join(f"with {n} paired seeds the smallest attainable sign-flip p is {min_sign_flip_p(n):.3g}"
                            for n in ns) + ". p-values are per comparison, not corrected for the number of "
              "references x metrics. Percentile intervals over a handful of seeds describe these seeds."]
    if res["notes"]:
        lines += [""] + [f"- {n}" for n in res["notes"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--mode", default="pdm-batch-topk-kl")
    ap.add_argument("--references", default="dppo-topk-kl,pdm-topk-kl")
    ap.add_argument("--collapse-drop", type=float, default=0.15)
    ap.add_argument("--label", default=None)
    ap.add_argument("--out", type=Path, required=True, help="output path without suffix (.json and .md written)")
    a = ap.parse_args(argv)
    if not a.run_dir.is_dir():
        print(f"run_dir: {str(a.run_dir)!r} is not a directory", file=sys.stderr)
        return 2
    try:
        res = paired(a.run_dir, a.mode, [r for r in a.references.split(",") if r], a.collapse_drop)
    except (ValueError, SystemExit) as e:
        print(str(e), file=sys.stderr)
        return 2
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    md = markdown(res, a.label or a.run_dir.name)
    a.out.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
