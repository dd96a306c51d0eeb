"""The stale-engine comparison's report rendered: ``stale.md`` (:func:`stale_markdown`),
``answers.md`` (:func:`answers_markdown`: the greedy answers of the first prompts at each
eval) and ``stale_curves.png`` (:func:`plot_curves`: mean over seeds with the min-max band
over seeds per label). The numbers come from :func:`pdmask_lab.stale_report.stale_report`;
nothing here computes a statistic."""

from __future__ import annotations

import math
from pathlib import Path

from pdmask.train.logging import read_jsonl

#: the curves' panels: (metric key, title, y label, trailing moving mean, log y)
CURVE_PANELS = [
    ("eval_accuracy", "Held-out greedy accuracy", "accuracy", 1, False),
    ("eval_finished", "Greedy held-out answers that end", "share of answers", 1, False),
    ("finish_rate", "Sampled answers that end (finish rate)", "share of responses", 3, False),
    ("entropy_mean", "Policy entropy on the sampled tokens", "nats", 3, False),
    ("mismatch_topk_kl", "Engine mismatch before the updates", "top-K KL(mu || pi_old)", 1, True),
    ("response_length", "Sampled response length", "tokens", 3, False),
]


def _md(h: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(h) + " |", "|" + "---|" * len(h)] + ["| " + " | ".join(r) + " |" for r in rows])


def _iv(d: dict | None, spec: str, sign: bool = False) -> str:
    from .significance import format_interval

    if d is None or d.get("estimate") is None:
        return "-"
    nan = math.nan
    return format_interval(d["estimate"], nan if d.get("lo") is None else d["lo"],
                           nan if d.get("hi") is None else d["hi"], spec=spec, sign=sign)


def _p(p) -> str:
    from .significance import format_p

    return format_p(math.nan if p is None else p)


def _mcnemar_cell(t: dict | None) -> str:
    return "-" if t is None else f"{t['only_mode']} vs {t['only_versus']} of {t['n']}, {_p(t['p'])}"


def criteria_section(rep: dict) -> list[str]:
    """One table per criterion: per label the seeds that met it and McNemar against each versus label."""
    vs = rep["versus"]
    lines = ["## Broken runs, criterion by criterion", "",
             "Each criterion on its own, never as a union (definitions below, fixed before the first run). "
             "Met: seeds that met it / seeds [95% Clopper-Pearson interval]; per seed the RL step it was first "
             "met at. Against a label: McNemar's exact test on the seeds both ran, `b vs c of n` with b the seeds "
             "where only this label met it and c those where only the other did. The last column pairs a "
             "variant (`MODE@old`) with its plain mode: the anchors compared.", ""]
    h = ["label", "met", "first step per seed"] + [f"vs {v} (McNemar)" for v in vs] + ["vs its plain mode"]
    for c, rows in rep["criteria"].items():
        body = []
        for lab, r in rows.items():
            per = ", ".join(f"s{s} @{st}" for s, st in r["per_seed"].items() if st is not None) or "-"
            body.append([f"`{lab}`", f"{r['k']}/{r['n']} [{r['lo']:.2f}, {r['hi']:.2f}]", per]
                        + [_mcnemar_cell(r["vs"].get(v)) if v != lab else "-" for v in vs]
                        + [_mcnemar_cell(r.get("vs_base"))])
        lines += [f"### `{c}`: {rep['definitions']['criteria'][c]}", "", _md(h, body), ""]
    lines += ["- McNemar's exact test needs at least 6 discordant seeds, all one way (6 vs 0: p = 0.031), to "
              "reach p < 0.05: with 8 paired seeds only a difference of at least 6 of 8 can.", ""]
    return lines


def _det(d: dict | None) -> str:
    det = (d or {}).get("detectable")
    if not det:
        return "-"
    sh = det.get("shift")
    return "none" if sh is None or (isinstance(sh, float) and math.isinf(sh)) else f"±{sh:.3f}"


def scalars_section(rep: dict) -> list[str]:
    """Final accuracy and AUC: mean over seeds, and paired against each versus label with the power line."""
    vs = rep["versus"]
    lines = ["## Final held-out accuracy and AUC", "",
             "Mean over seeds [95% seed-bootstrap interval]. Against a label, on the seeds both ran: the mean "
             "per-seed difference [95% seed-bootstrap interval], seeds up / down, the exact two-sided sign-flip "
             "p, and the power line: the smallest mean difference these seeds detect with 80% power at "
             "alpha = 0.05 (`detectable`). The last two columns pair a variant (`MODE@old`) with its plain "
             "mode.", ""]
    h = ["label", "seeds", "mean"]
    for v in vs:
        h += [f"Δ vs {v}", "detectable"]
    h += ["Δ vs its plain mode", "detectable"]
    for k, rows in rep["scalars"].items():
        body = []
        for lab, r in rows.items():
            row = [f"`{lab}`", str(len(r["seeds"])), _iv(r["mean"], ".3f")]
            for d in [r["vs"].get(v) for v in vs] + [r.get("vs_base")]:
                row += (["-", "-"] if d is None else
                        [f"{_iv(d, '.3f', sign=True)}, {d['wins']} up / {d['losses']} down of {d['n']}, "
                         f"{_p(d['p'])}", _det(d)])
            body.append(row)
        lines += [f"### `{k}`: {rep['definitions'][k]}", "", _md(h, body), ""]
    lines += [f"- {x}" for x in rep["resolution"]] + [""]
    return lines


def _share(key: str) -> bool:
    """A token share (printed as a percentage), not a distance or a weight."""
    return "_frac" in key or key.startswith("masked_share")


def _anchor_cell(d: dict | None, key: str) -> str:
    if d is None:
        return "-"
    return _iv(d, ".2%" if _share(key) else ".3g")


#: the anchor tables: (title, key pattern or keys)
_ANCHOR_TABLES = [
    ("Masked share by mini-batch", ["masked_frac"] + [f"mb{j}_masked_frac" for j in range(1, 9)]),
    ("Out-of-region share by mini-batch", [f"mb{j}_out_of_region_frac" for j in range(1, 9)]),
    ("Masked by sign of A; out of region before any update", ["masked_share_pos_adv", "masked_share_neg_adv",
                                                              "out_before_update_frac", "mu_region_out_frac_at_start",
                                                              "anchor_out_of_region_frac"]),
    ("The anchor's distance", ["start_divergence_mean", "start_divergence_q50", "start_divergence_q90",
                               "anchor_divergence_mean", "anchor_divergence_q90", "behaviour_weight_mean"]
     + [f"mb{j}_divergence_q90" for j in range(1, 9)]),
]


def anchor_section(rep: dict) -> list[str]:
    """The where-it-binds tables, one column per logged key (its definition below the table)."""
    a = rep["anchor"]
    if not a:
        return ["## Where the region binds", "", "No run logged the anchor diagnostics.", ""]
    lines = ["## Where the region binds", "",
             "Pooled over the runs' steps and seeds [95% seed-cluster bootstrap interval]: token shares and "
             "per-token means weighted by each step's response tokens, per-step quantiles averaged over steps "
             "(definitions below). `-`: not logged by that label's runs (the `@old` keys exist only with "
             "`anchor: old`).", ""]
    for title, keys in _ANCHOR_TABLES:
        keys = [k for k in keys if k in a]
        if not keys:
            continue
        tok = {lab: next((a[k][lab]["tokens"] for k in keys if a[k].get(lab) and a[k][lab].get("tokens")), None)
               for lab in rep["labels"]}
        body = [[f"`{lab}`"] + [_anchor_cell(a[k].get(lab), k) for k in keys]
                + ["-" if tok[lab] is None else f"{int(round(tok[lab])):,}"] for lab in rep["labels"]]
        lines += [f"### {title}", "", _md(["label"] + [f"`{k}`" for k in keys] + ["tokens (first column)"], body), ""]
    return lines


def by_lag_section(rep: dict) -> list[str]:
    """Per metric, a table label x steps since the engine's sync."""
    lines = []
    for key, rows in rep["by_lag"].items():
        lags = sorted({int(g) for r in rows.values() for g in r})
        body = [[f"`{lab}`"] + [f"{rows[lab][str(g)]['mean']:.3g}" if str(g) in rows[lab] else "-" for g in lags]
                for lab in rep["labels"]]
        lines += [f"### `{key}` by steps since the sync: {rep['definitions']['by_lag'][key]}", "",
                  "Per run the mean over its steps at that lag, then the mean over seeds.", "",
                  _md(["label"] + [f"lag {g}" for g in lags], body), ""]
    return (["## The anchor's distance by steps since the sync", ""] + lines) if lines else []


def stale_markdown(rep: dict) -> str:
    """``stale.md``: the report's sections, then the definitions and the notes."""
    lines = ["# The stale-engine comparison", ""]
    if rep.get("command"):
        lines += [f"Written by `{rep['command']}`.", ""]
    if rep.get("environment_line"):
        lines += [rep["environment_line"], ""]
    cells = sorted({(r["steps"], r["sync_every"]) for r in rep["runs"]})
    lines += [f"{len(rep['runs'])} finished runs, " + ", ".join(f"`{lab}` {len(s)} seeds ({_seeds(s)})"
                                                                 for lab, s in rep["seeds"].items())
              + "; " + "; ".join(f"{a} steps, engine synced every {b}" for a, b in cells)
              + ". Runs are grouped by label (the run's name without `-s<seed>`): `MODE@old` is MODE anchored "
                "on pi_old.", ""]
    lines += criteria_section(rep) + scalars_section(rep) + anchor_section(rep) + by_lag_section(rep)
    lines += ["## Greedy answers and curves", "",
              "The greedy answers of the first held-out prompts at each eval: [answers.md](answers.md) (every "
              "run's own in its `eval_answers.jsonl`)."]
    if rep.get("plot"):
        lines += ["", f"![curves]({rep['plot']})", "",
                  "Mean over seeds per label; the band is the min-max over seeds (not a confidence band). "
                  "Dashed: the pi_old-anchored variants. The dotted line in the mismatch panel is the "
                  "`mismatch` criterion's bar."]
    d = rep["definitions"]
    lines += ["", "## Definitions", ""] + [f"- `{k}`: {v}" for k, v in d["criteria"].items()]
    lines += [f"- the `mismatch` bar: {d['mismatch_bar']:.4g} nats",
              f"- the pi_old-anchored modes' delta: {d['old_delta_rule']}",
              f"- `eval_final`: {d['eval_final']}", f"- `eval_auc`: {d['eval_auc']}",
              f"- `detectable`: {d['detectable']}"]
    lines += [f"- `{k}`: {v}" for k, v in d["anchor"].items() if k in rep["anchor"]]
    if rep["notes"]:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in rep["notes"]]
    return "\n".join(lines) + "\n"


def _seeds(s: list[int]) -> str:
    return ", ".join(map(str, s)) if len(s) < 3 or s != list(range(s[0], s[-1] + 1)) else f"{s[0]}-{s[-1]}"


def _cell_text(t: str) -> str:
    """An answer as one markdown table cell: pipes escaped, line breaks shown as ⏎."""
    return "`" + t.replace("`", "'").replace("|", "\\|").replace("\r", "").replace("\n", "⏎") + "`" if t else "(empty)"


def answers_markdown(rep: dict, rung_dir: str | Path, *, n: int = 3, seed: int | None = None) -> str:
    """``answers.md``: per label, one seed's greedy answers to the first ``n`` held-out prompts
    at each eval, beside that eval's accuracy and share of answers that end (all held-out
    prompts). ``seed`` defaults to the lowest seed every label has."""
    common = set.intersection(*(set(s) for s in rep["seeds"].values())) if rep["seeds"] else set()
    lines = ["# Greedy answers at each eval", "",
             f"The greedy answers to the first {n} held-out prompts (the same prompts for every run), with the "
             "eval's accuracy and share of answers that end over all held-out prompts. From each run's "
             "`eval_answers.jsonl`.", ""]
    by_run = {(r["label"], r["seed"]): r["run"] for r in rep["runs"]}
    for lab in rep["labels"]:
        s = seed if seed is not None else (min(common) if common else min(rep["seeds"][lab]))
        if (lab, s) not in by_run:
            lines += [f"## `{lab}`", "", f"No finished run of seed {s}.", ""]
            continue
        d = Path(rung_dir) / by_run[(lab, s)]
        answers = {int(x["step"]): x.get("answers") or [] for x in read_jsonl(d / "eval_answers.jsonl")
                   if x.get("step") is not None}
        evals = {int(x["step"]): x for x in read_jsonl(d / "metrics.jsonl") if x.get("eval_accuracy") is not None}
        lines += [f"## `{lab}`, seed {s}", ""]
        if not answers:
            lines += ["No answers saved (`eval_answers: 0`).", ""]
            continue
        body = []
        for st in sorted(answers):
            e = evals.get(st, {})
            acc = "-" if e.get("eval_accuracy") is None else f"{e['eval_accuracy']:.3f}"
            fin = "-" if e.get("eval_finished") is None else f"{e['eval_finished']:.2f}"
            body.append([str(st), acc, fin] + [_cell_text(a) for a in answers[st][:n]])
        lines += [_md(["step", "accuracy", "answers that end"] + [f"prompt {i + 1}" for i in range(n)], body), ""]
    return "\n".join(lines)


def _bands(rep: dict, rung_dir: Path, key: str, window: int) -> dict[str, dict]:
    """Per label: steps, mean, min and max over seeds of ``key`` (each seed's series smoothed by a
    trailing moving mean of ``window`` first)."""
    from .report import _smooth

    by: dict[str, dict[int, list[float]]] = {}
    for r in rep["runs"]:
        pts = [(x["step"], float(x[key])) for x in read_jsonl(rung_dir / r["run"] / "metrics.jsonl")
               if x.get(key) is not None]
        if not pts:
            continue
        xs, ys = zip(*pts)
        for x, y in zip(xs, _smooth(list(ys), window)):
            by.setdefault(r["label"], {}).setdefault(x, []).append(y)
    return {lab: {"steps": sorted(v), "mean": [sum(v[s]) / len(v[s]) for s in sorted(v)],
                  "lo": [min(v[s]) for s in sorted(v)], "hi": [max(v[s]) for s in sorted(v)]}
            for lab, v in by.items()}


def plot_curves(rep: dict, rung_dir: str | Path, path: str | Path) -> Path:
    """``stale_curves.png``: the :data:`CURVE_PANELS`, per label the mean over seeds and the
    min-max band over seeds; colour by mode, dashed for a variant (``MODE@...``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .regime import FP8_FLOOR_TOPK_KL, MISMATCH_RUNAWAY_ABS
    from .report import mode_colors

    rung_dir, path = Path(rung_dir), Path(path)
    colors = mode_colors([lab.partition("@")[0] for lab in rep["labels"]])
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (key, title, ylabel, w, logy) in zip(axes.flat, CURVE_PANELS):
        bands = _bands(rep, rung_dir, key, w)
        for lab in rep["labels"]:
            b = bands.get(lab)
            if not b:
                continue
            c, ls = colors[lab.partition("@")[0]], "--" if "@" in lab else "-"
            ax.plot(b["steps"], b["mean"], ls, color=c, lw=1.8, marker="o" if key.startswith("eval") else None,
                    ms=3, label=f"{lab} ({len(rep['seeds'][lab])} seeds)")
            if len(rep["seeds"][lab]) > 1:
                ax.fill_between(b["steps"], b["lo"], b["hi"], color=c, alpha=0.12, lw=0)
        if key == "mismatch_topk_kl":
            ax.axhline(MISMATCH_RUNAWAY_ABS * FP8_FLOOR_TOPK_KL, color="gray", ls=":", lw=1)
        ax.set_title(title + (f" (moving mean of {w})" if w > 1 else ""), fontsize=9)
        ax.set_xlabel("RL step")
        ax.set_ylabel(ylabel)
        if logy:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("Mean over seeds; band = min-max over seeds", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
