"""The ladder's report: per rung the measured mismatch, per (rung, mode) accuracy and
collapse rate over seeds, paired differences against the reference mode, and a plot.

Built from the finished cells of ``OUT/<rung>/`` (an unfinished cell is left out and
named in the notes). Writes ``OUT/ladder.json``, ``OUT/ladder.md``, ``OUT/ladder.png``
and, per rung, the across-seed ``summary.json`` / ``summary.md`` of
:mod:`pdmask_lab.seed_summary` plus ``report/eval_accuracy_bands.png``.

The report reads only the records :data:`RECORD_FILES` of each run and
``OUT/ladder_log.jsonl``, never a checkpoint: :func:`export_records` copies them into a
results folder (``pdmask ladder --report-dir``) so that the page there is rebuilt from
what is committed next to it (``pdmask ladder --out DIR --report-only``).

Definitions (also written into ``ladder.json``):

- **measured mismatch of a rung**: per run, the mean over its RL steps of
  ``mismatch_topk_kl`` (top-K KL(mu || pi) between engine and trainer on each step's first
  mini-batch, before the step's updates); the rung's value is the mean over the seeds of
  the **reference** mode's runs (a mask keeps the trainer near the engine, so the rung
  is measured under the mask every mode is compared with; ``none`` drifts further and
  its own mismatch is listed per mode), with a seed-bootstrap interval.
- **collapse**: a run collapsed if its held-out accuracy fell by ``collapse_drop`` or more
  from its running best (``worst_drop``), or ended below its step-0 accuracy (the SFT
  base). The rate over seeds gets an exact Clopper-Pearson interval; two modes are
  compared on the same seeds with McNemar's exact test.
- **final accuracy**: held-out greedy accuracy at the last eval, mean over seeds with a
  seed-bootstrap percentile interval; paired differences against the reference with the
  sign-flip p-value (:func:`pdmask_lab.significance.paired_difference`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from .significance import DEFAULT_N_BOOT
from pdmask.train.environment import environment, environments_line, one_line, runs_environments
from .ladder import LADDER_LOG
from pdmask.train.logging import read_jsonl
from pdmask.train.portable import portable_path
from .seed_summary import DETECTABLE_DEFINITION, DETECTABLE_HEADER, detectable_cell, json_safe
from .seed_summary import mean_present as _mean

N_BOOT = DEFAULT_N_BOOT


#: The files of a run the report reads (config, per-step metrics, the run's summary) and the
#: greedy answers saved at each eval (``eval_answers > 0``; read by the stale-engine report,
#: :mod:`pdmask_lab.stale_report`): the records :func:`export_records` copies. Checkpoints and
#: logs are not among them.
RECORD_FILES = ("config.yaml", "metrics.jsonl", "summary.json", "eval_answers.jsonl")


def export_records(spec, out: str | Path, dest: str | Path) -> int:
    """Copy what :func:`build_report` reads from ``out`` into ``dest``, mirroring its layout:
    for every rung of ``spec``, each run directory's :data:`RECORD_FILES` (a finished,
    unfinished or foreign run alike, so that the report built from ``dest`` names the same
    runs the same way), the rung's ``summary.json`` (an earlier writer's keys survive a
    rebuild), and :data:`pdmask_lab.ladder.LADDER_LOG`. A record a run no longer has is
    removed from its copy; other files in ``dest`` are left alone. Returns the number of
    runs copied.
    Naive equivalent: ``rsync -a --include='*/' --include='{config.yaml,metrics.jsonl,summary.json}'
    --exclude='*' out/ dest/``."""
    import shutil

    out, dest = Path(out), Path(dest)
    if not out.is_dir():
        raise ValueError(f"out: {str(out)!r} is not a directory; there are no runs to report")
    n = 0
    for rung in spec.rungs:
        src = out / rung.name
        if not src.is_dir():
            continue
        files = [(src / "summary.json", dest / rung.name / "summary.json")]
        for d in sorted(p for p in src.iterdir() if p.is_dir()):
            have = [f for f in RECORD_FILES if (d / f).is_file()]
            if "config.yaml" not in have and "metrics.jsonl" not in have:
                continue  # not a run (the rung's report/ folder)
            n += 1
            for f in RECORD_FILES:
                target = dest / rung.name / d.name / f
                if f in have:
                    files.append((d / f, target))
                elif target.is_file():
                    target.unlink()
        for a, b in files:
            if a.is_file():
                b.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(a, b)
    if (out / LADDER_LOG).is_file():
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out / LADDER_LOG, dest / LADDER_LOG)
    return n


def run_extras(run: Path) -> dict:
    """Per-run numbers the across-seed summary does not hold: mean mismatch over all RL
    steps, mean rollout tail mass outside the top-K, step-0 (SFT base) accuracy."""
    recs = read_jsonl(run / "metrics.jsonl")
    steps = [r for r in recs if r.get("step", 0) > 0]
    step0 = [r["eval_accuracy"] for r in recs if r.get("step") == 0 and r.get("eval_accuracy") is not None]
    return {"mismatch_mean": _mean([r.get("mismatch_topk_kl") for r in steps]),
            "tail_mass_mean": _mean([r.get("rollout_tail_mass_mean") for r in steps]),
            "eval_step0": step0[0] if step0 else None,
            "eval_last_number_final": next((r["eval_last_number_accuracy"] for r in reversed(recs)
                                            if r.get("eval_last_number_accuracy") is not None), None)}


def collapsed(worst_drop: float, final: float, step0: float | None, drop: float) -> bool:
    """The collapse rule (module docstring)."""
    return worst_drop >= drop - 1e-12 or (step0 is not None and final < step0 - 1e-12)


def _boot_mean(values: list[float], seed: int = 0) -> dict:
    """Mean over seeds with its seed-bootstrap percentile interval (``pooled_ratio`` with unit weights)."""
    from .significance import pooled_ratio

    r = pooled_ratio(values, [1.0] * len(values), n_boot=N_BOOT, seed=seed)
    return {"estimate": r.estimate, "lo": r.lo, "hi": r.hi, "n": r.n_clusters, "per_seed": list(values)}


def _ranges(xs: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2, 5, 7-8"``."""
    xs, parts, i = sorted(set(xs)), [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        parts.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ", ".join(parts)


def _not_run_note(rung: str, todo: list, planned: list) -> str:
    """One note per rung for its cells not run yet (a ladder run with fewer seeds than the
    spec's leaves whole seeds out: named as seeds, not as one line per cell)."""
    modes = sorted({c.mode for c in planned})
    by_seed: dict[int, set] = {}
    for c in todo:
        by_seed.setdefault(c.seed, set()).add(c.mode)
    whole = [s for s, ms in by_seed.items() if ms == set(modes)]
    parts = [f"seed{'s' if len(whole) > 1 else ''} {_ranges(whole)} (every mode)"] if whole else []
    parts += [f"{c.mode}-s{c.seed}" for c in todo if c.seed not in whole]
    return f"{rung}: {len(todo)} of {len(planned)} planned cells not run yet: {', '.join(parts)}; left out"


def _finished_runs(spec, rung, out: Path, planned: dict) -> tuple[list[Path], list[str]]:
    """Finished runs of a rung: the planned cells that are done, plus finished runs of other
    modes/seeds found on disk whose settings match the rung (added with --modes/--seeds)."""
    from pdmask.train.config import stored_loss
    from .ladder import Cell, cell_config, cell_status

    runs, notes = [], []
    rd = out / rung.name
    seen = set()
    todo = []
    for c in planned.get(rung.name, []):
        seen.add(c.cfg.run_name)
        st = cell_status(c)
        if st == "done":
            runs.append(c.cfg.run_dir)
        elif st == "partial":
            notes.append(f"{c.key}: unfinished; left out")
        else:
            todo.append(c)
    if todo:
        notes.append(_not_run_note(rung.name, todo, planned.get(rung.name, [])))
    if rd.is_dir():
        import yaml

        for d in sorted(rd.iterdir()):
            if d.name in seen or not (d / "config.yaml").exists():
                continue
            cfg = yaml.safe_load((d / "config.yaml").read_text()) or {}
            try:
                mode = stored_loss(cfg)["mode"]  # either version of config.yaml
                cell = Cell(rung, mode, int(cfg["seed"]), cell_config(spec, rung, mode, int(cfg["seed"]), out))
                ok = cell.cfg.run_name == d.name and cell_status(cell) == "done"
            except (ValueError, KeyError):
                ok = False
            if ok:
                runs.append(d)
            else:
                notes.append(f"{rung.name}/{d.name}: not a finished run of this rung's settings; left out")
    return runs, notes


def _mode_row(m: str, g: dict, extras: dict, ref_coll: dict, spec) -> dict:
    """One mode's row of a rung: final accuracy, collapse (Clopper-Pearson), mismatch,
    masked and disagreement shares and, against the reference, the paired differences and McNemar's test of
    the collapses (``g``: the mode's group of the across-seed summary)."""
    from .significance import clopper_pearson, mcnemar_exact

    seeds = [int(s) for s in g["runs"]]
    rr = [g["runs"][str(s)] for s in seeds]
    ex = [extras[(m, s)] for s in seeds]
    coll = {s: collapsed(r["worst_drop"], r["eval_final"], e["eval_step0"], spec.collapse_drop)
            for s, r, e in zip(seeds, rr, ex)}
    k = sum(coll.values())
    lo, hi = clopper_pearson(k, len(seeds))
    row = {"mode": m, "n": len(seeds), "seeds": seeds,
           "eval_final": _boot_mean([r["eval_final"] for r in rr]),
           "eval_last_number_final": _mean([e["eval_last_number_final"] for e in ex]),
           "worst_drop": _mean([r["worst_drop"] for r in rr]),
           "collapse": {"k": k, "n": len(seeds), "rate": k / len(seeds), "lo": lo, "hi": hi,
                        "per_seed": [coll[s] for s in seeds]},
           "mismatch_mean": _mean([e["mismatch_mean"] for e in ex]),
           "masked_frac": g["pooled"]["masked_frac"]["estimate"],
           "disagreement_frac": g["pooled"]["disagreement_frac"]["estimate"], "vs_reference": None}
    vs = g.get("vs_reference")
    if vs:
        common = [s for s in seeds if s in ref_coll]
        b = sum(coll[s] and not ref_coll[s] for s in common)
        c = sum(ref_coll[s] and not coll[s] for s in common)
        row["vs_reference"] = {"reference": vs["reference_group"], "n": vs["n"],
                               "eval_final": vs["eval_final"], "eval_auc": vs["eval_auc"],
                               "worst_drop": vs["worst_drop"],
                               "collapse": {"only_mode": b, "only_reference": c, "n": len(common),
                                            "p": mcnemar_exact(b, c)}}
    return row


def build_report(spec, out: str | Path, *, console=None, plot: bool = True, command: str | None = None) -> dict:
    """Assemble (and write) the ladder report from the finished cells under ``out``;
    ``command``, the command line that writes it, is named at the page's top."""
    from .ladder import plan_cells
    from .ladder_pooled import pooled_vs_reference
    from .regime import DEFINITIONS as BREAK_DEFINITIONS
    from .regime import GUARD, UNGUARDED, rung_breaks
    from .report import load_summaries, plot_curve_bands, plot_eval_bands, write_summary
    from .seed_summary import seed_summary

    out = Path(out)
    planned: dict[str, list] = {}
    for c in plan_cells(spec, out):
        planned.setdefault(c.rung.name, []).append(c)
    rungs, notes, all_runs = [], [], []
    for rung in spec.rungs:
        runs, n = _finished_runs(spec, rung, out, planned)
        notes += n
        mine = {c.cfg.run_dir for c in planned.get(rung.name, [])}
        extra = sum(r not in mine for r in runs)  # finished runs of seeds/modes beyond the plan
        entry = {"name": rung.name, "label": rung.label, "family": rung.family, "set": rung.set,
                 "config": portable_path(rung.config), "cells_planned": len(mine) + extra, "cells_extra": extra,
                 "cells_done": len(runs), "modes": [], "mismatch": None, "tail_mass_mean": None,
                 "sft_accuracy": None, "across_seeds": None}
        rungs.append(entry)
        if not runs:
            continue
        across = seed_summary(runs, reference=spec.reference, n_boot=N_BOOT)
        summaries = load_summaries(runs)
        all_runs += [s | {"run": f"{rung.name}/{s.get('run')}"} for s in summaries]
        write_summary(out / rung.name, {"runs": summaries, "across_seeds": across})
        if plot:
            plot_eval_bands(runs, out / rung.name / "report")
            plot_curve_bands(runs, out / rung.name / "report")
        extras = {(g["mode"], int(s)): run_extras(out / rung.name / r["run"])
                  for g in across["groups"] for s, r in g["runs"].items()}
        entry["across_seeds"] = across
        entry["tail_mass_mean"] = _mean([e["tail_mass_mean"] for e in extras.values()])
        entry["sft_accuracy"] = _mean([e["eval_step0"] for e in extras.values()])
        ref_mm = [e["mismatch_mean"] for (m, _), e in sorted(extras.items()) if m == spec.reference
                  and e["mismatch_mean"] is not None]
        src = spec.reference
        if not ref_mm:
            ref_mm = [e["mismatch_mean"] for e in extras.values() if e["mismatch_mean"] is not None]
            src = "all modes (no reference runs)"
        if ref_mm:
            entry["mismatch"] = _boot_mean(ref_mm) | {"source": src}
        by_mode = {g["mode"]: g for g in across["groups"]}
        order = [m for m in spec.modes_of(rung) if m in by_mode] + sorted(set(by_mode) - set(spec.modes_of(rung)))
        ref = by_mode.get(spec.reference)
        ref_coll = ({int(s): collapsed(r["worst_drop"], r["eval_final"], extras[(spec.reference, int(s))]["eval_step0"],
                                       spec.collapse_drop) for s, r in ref["runs"].items()} if ref else {})
        entry["modes"] += [_mode_row(m, by_mode[m], extras, ref_coll, spec) for m in order]
        breaks = rung_breaks(runs, spec.reference)
        if breaks is not None:  # runs that log the finish rate (since 2026-12-02)
            entry["breaks"] = breaks
    rep = json_safe({"name": spec.name, "command": command, "reference": spec.reference,
                     "collapse_drop": spec.collapse_drop,
                     "seeds_planned": spec.seeds, "modes": spec.modes, "rungs": rungs, "notes": notes,
                     "definitions": DEFINITIONS | {"collapse": DEFINITIONS["collapse"].format(d=spec.collapse_drop)},
                     "wall": wall_times(out),
                     # the report's process; the runs' own environments (distinct ones, with their runs) follow
                     "environment": environment(),
                     "runs_environments": runs_environments(all_runs)})
    if any(r.get("breaks") for r in rungs):
        rep["definitions"]["break"] = ("a run breaks on any of: " + "; ".join(f"{k}: {v}" for k, v in
                                                                          BREAK_DEFINITIONS.items())
                                       + f". A rung breaks when {UNGUARDED} breaks on a seed and {GUARD} on none")
    rep["pooled"] = json_safe(pooled_vs_reference(rep, n_boot=N_BOOT))
    (out / "ladder.json").write_text(json.dumps(rep, indent=2, default=str))
    (out / "ladder.md").write_text(ladder_markdown(rep))
    if plot and any(r["modes"] for r in rungs):
        from .ladder_plot import plot_ladder

        rep["plot"] = str(plot_ladder(rep, out / "ladder.png"))
    if console is not None:
        for t in ladder_tables(rep):
            console.print(t)
        for line in resolution_lines(rep) + notes[:20] + ([f"... {len(notes) - 20} more notes in ladder.json"]
                                                          if len(notes) > 20 else []):
            console.print(line)
        console.print(f"wrote {out / 'ladder.md'}, {out / 'ladder.json'}" + (f", {rep['plot']}" if "plot" in rep else ""))
    return rep


DEFINITIONS = {
    "mismatch": "per run: mean over RL steps of mismatch_topk_kl (top-K KL(mu || pi), engine vs trainer, "
                "on each step's first mini-batch before its updates); per rung: mean over the reference "
                "mode's seeds [95% seed-bootstrap interval]",
    "eval_final": "held-out greedy accuracy at the last eval; mean over seeds [95% seed-bootstrap interval]",
    "collapse": "worst drop of held-out accuracy from its running best >= {d:g}, or final accuracy below the "
                "run's step-0 (SFT base) accuracy; rate over seeds [95% Clopper-Pearson interval]",
    "paired": "against the reference mode on the same seeds: mean per-seed difference [95% seed-bootstrap "
              "interval] and two-sided sign-flip p; collapse: McNemar's exact test on the seeds where "
              "exactly one of the two collapsed",
    "detectable": DETECTABLE_DEFINITION,
    "tail_mass": "mean over tokens and steps of the engine's probability mass outside its reported top-K",
}


def wall_times(out: Path) -> dict:
    """From ``ladder_log.jsonl``: invocations, cells run (fresh / resumed) and the machine
    time they took (an invocation killed before its end counts up to its last event); cells
    taken as prefixes of longer runs (``--prefix-of``) apart, with the source runs' wall
    time for those steps (spent by the other ladder, not by this one's invocations)."""
    recs = read_jsonl(Path(out) / LADDER_LOG)
    total, inv, cur = 0.0, 0, None
    fresh = resumed = prefix = 0
    cell_s = prefix_s = 0.0
    for r in recs:
        if r.get("event") == "start":
            if cur is not None:
                total += cur[1] - cur[0]
            cur, inv = [r["time"], r["time"]], inv + 1
        elif cur is not None:
            cur[1] = r["time"]
        if r.get("event") == "cell":
            fresh += r.get("how") == "fresh"
            resumed += r.get("how") == "resume"
            cell_s += r.get("wall_s", 0.0)
        if r.get("event") == "prefix":  # taken from a longer run: its machine time for these steps
            prefix += 1
            prefix_s += r.get("source_wall_s") or 0.0
    if cur is not None:
        total += cur[1] - cur[0]
    return {"invocations": inv, "cells_fresh": fresh, "cells_resumed": resumed, "wall_s": total,
            "cell_wall_s_sum": cell_s, "cells_prefix": prefix, "prefix_source_wall_s": prefix_s}



# ------------------------------------------------------------------ tables
def _iv(d: dict | None, spec: str = ".3f", sign: bool = False) -> str:
    from .significance import format_interval

    if d is None or d.get("estimate") is None:
        return "-"
    return format_interval(d["estimate"], d["lo"] if d["lo"] is not None else math.nan,
                           d["hi"] if d["hi"] is not None else math.nan, spec=spec, sign=sign)


def _p(p) -> str:
    from .significance import format_p

    return format_p(p if p is not None else math.nan)


def ladder_rows(rep: dict) -> dict[str, tuple[list[str], list[list[str]]]]:
    """(headers, rows) of the rung table, the per-(rung, mode) table and the wide table."""
    h_r = ["rung", "settings", "family", "cells", "mismatch (top-K KL)", "tail mass", "SFT base acc"]
    r_r = [[r["name"], ", ".join(f"{k}={v}" for k, v in r["set"].items()) or "-", r["family"],
            f"{r['cells_done']}/{r['cells_planned']}", _iv(r["mismatch"], ".2e"),
            "-" if r["tail_mass_mean"] is None else f"{r['tail_mass_mean']:.2e}",
            "-" if r["sft_accuracy"] is None else f"{r['sft_accuracy']:.3f}"] for r in rep["rungs"]]
    ref = rep["reference"]
    h_m = ["rung", "mode", "seeds", "final acc", "worst drop", "collapsed", "own mismatch", "masked",
           "disagreement", f"Δ final acc vs {ref}", DETECTABLE_HEADER, "Δ collapsed (McNemar)"]
    r_m = []
    for r in rep["rungs"]:
        for m in r["modes"]:
            c = m["collapse"]
            vs = m["vs_reference"]
            d_acc = d_col = d_det = "-"
            if vs:
                e = vs["eval_final"]
                d_acc = f"{_iv(e, '.3f', sign=True)} {_p(e['p'])}" if e else "-"
                d_det = detectable_cell(e)
                cc = vs["collapse"]
                d_col = f"{cc['only_mode']} vs {cc['only_reference']} {_p(cc['p'])}"
            r_m.append([r["name"], m["mode"], str(m["n"]), _iv(m["eval_final"]), f"{m['worst_drop']:.3f}",
                        f"{c['k']}/{c['n']} [{c['lo']:.2f}, {c['hi']:.2f}]",
                        "-" if m["mismatch_mean"] is None else f"{m['mismatch_mean']:.2e}",
                        "-" if m["masked_frac"] is None else f"{m['masked_frac']:.2%}",
                        "-" if m["disagreement_frac"] is None else f"{m['disagreement_frac']:.2%}",
                        d_acc, d_det, d_col])
    modes = []
    for r in rep["rungs"]:
        modes += [m["mode"] for m in r["modes"] if m["mode"] not in modes]
    h_w = ["rung", "mismatch"] + modes
    r_w = []
    for r in rep["rungs"]:
        by = {m["mode"]: m for m in r["modes"]}
        r_w.append([r["name"], "-" if not r["mismatch"] else f"{r['mismatch']['estimate']:.1e}"]
                   + [f"{by[m]['eval_final']['estimate']:.3f} ({by[m]['collapse']['k']}/{by[m]['collapse']['n']})"
                      if m in by else "-" for m in modes])
    from .ladder_pooled import pooled_rows

    return {"rungs": (h_r, r_r), "modes": (h_m, r_m), "wide": (h_w, r_w), "pooled": pooled_rows(rep)}


def resolution_lines(rep: dict) -> list[str]:
    from .seed_summary import resolution_note

    ns = sorted({m["vs_reference"]["n"] for r in rep["rungs"] for m in r["modes"] if m["vs_reference"]})
    out = [resolution_note(n) for n in ns]
    nc = sorted({m["vs_reference"]["collapse"]["n"] for r in rep["rungs"] for m in r["modes"] if m["vs_reference"]})
    if nc:
        n = nc[-1]
        out.append(f"Collapse rates are compared with McNemar's exact test, which needs at least 6 seeds where "
                   f"exactly one of the two modes collapsed, all in the same direction (6 vs 0: p = 0.031), to reach "
                   f"p < 0.05" + (f"; with {n} paired seed{'s' if n != 1 else ''} no collapse-rate difference can reach it." if n < 6 else
                                  f"; with {n} paired seeds only a difference of at least 6/{n} in collapse rate can."))
    return out


def ladder_tables(rep: dict) -> list:
    from rich.markup import escape
    from rich.table import Table

    rows = ladder_rows(rep)
    titles = {"rungs": "Ladder rungs: measured mismatch [95% seed-bootstrap interval]",
              "modes": f"Per rung and mode: mean over seeds [95% interval]; collapsed k/n [Clopper-Pearson]; "
                       f"paired vs {rep['reference']} (sign-flip p; McNemar p)",
              "wide": "Final held-out accuracy, mean over seeds (collapsed runs / seeds)",
              "pooled": f"Paired vs {rep['reference']} pooled over rungs: per seed the mean difference over "
                        f"the rungs where both ran [95% seed-bootstrap interval]"}
    out = []
    for k, (h, rs) in rows.items():
        t = Table(title=escape(titles[k]))
        for c in h:
            t.add_column(escape(c), justify="left" if c in ("rung", "mode", "settings", "family") else "right")
        for r in rs:
            t.add_row(*map(escape, r))
        out.append(t)
    return out


def _md(h, rows) -> str:
    return "\n".join(["| " + " | ".join(h) + " |", "|" + "---|" * len(h)] + ["| " + " | ".join(r) + " |" for r in rows])


def ladder_markdown(rep: dict) -> str:
    rows = ladder_rows(rep)
    w = rep["wall"]
    groups = rep.get("runs_environments") or []
    env = groups[0]["environment"] if len(groups) == 1 and groups[0]["environment"] else rep.get("environment")
    lines = [f"# Mismatch ladder `{rep['name']}`", ""]
    if rep.get("command"):
        lines += [f"Written by `{rep['command']}`.", ""]
    lines += [one_line(env), ""]
    if environments_line(groups):
        lines += [environments_line(groups).replace("summary.json", "ladder.json"), ""]
    lines += [f"Reference mode: {rep['reference']}; {rep['seeds_planned']} seeds planned per cell"
              + ("; finished runs of further seeds or modes found on disk are included."
                 if any(r.get("cells_extra") for r in rep["rungs"]) else "."), "",
              "## Rungs", "", _md(*rows["rungs"]), "",
              "## Final held-out accuracy (collapsed runs / seeds)", "", _md(*rows["wide"]), "",
              "## Per rung and mode", "", _md(*rows["modes"]), ""]
    lines += [f"- {x}" for x in resolution_lines(rep)]
    if any(r.get("breaks") for r in rep["rungs"]):
        from .regime import breaks_rows

        lines += ["", "## Where runs break", "", "Each run's curves against the signs a practitioner would stop a "
                  "run for (definition `break` below; `pdmask_lab.regime`): per seed, the criteria met and the "
                  "RL step each was first met.", "", _md(*breaks_rows(rep))]
    if rep.get("pooled"):
        lines += ["", "## Pooled over rungs, clustered by seed", "",
                  f"Per seed, the mean over the rungs where both ran of (mode - {rep['reference']}) final "
                  "accuracy; its mean over seeds [95% seed-bootstrap interval] and a two-sided sign-flip p that "
                  "flips each seed's rungs together (runs of one seed share data across rungs). Only seeds "
                  "that ran both modes on every such rung enter. A difference confined to one rung is diluted "
                  "by the others: the per-rung rows say where.", "", _md(*rows["pooled"])]
    lines += ["", f"Machine time: {w['wall_s'] / 60:.1f} min over {w['invocations']} invocation(s); "
                  f"{w['cells_fresh']} cells started fresh, {w['cells_resumed']} resumed"
                  + (f"; {w['cells_prefix']} cells are the first steps of longer runs (`--prefix-of`), which "
                     f"spent {w['prefix_source_wall_s'] / 60:.1f} min of run wall time on those steps."
                     if w.get("cells_prefix") else "."), "",
              "Definitions:", ""] + [f"- {k}: {v}" for k, v in rep["definitions"].items()]
    if rep["notes"]:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in rep["notes"]]
    return "\n".join(lines) + "\n"
