"""Reports: overlay runs in PNG plots, print summary tables, summarise modes across seeds.

``pdmask report RUN_DIR...`` accepts run directories (holding ``metrics.jsonl``) and
directories of runs (a ``pdmask compare`` output). Runs are coloured by mask mode; with
several seeds of a mode the thin lines are the seeds and the thick line their mean;
``eval_accuracy_bands.png`` shows each mode's mean eval curve with its min-max band
across seeds; ``curves_bands.png`` the same for accuracy, reward, entropy, response length
and mismatch side by side.

The across-seed summary with paired tests is in :mod:`pdmask_lab.seed_summary`.
"""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from pathlib import Path

from pdmask.train.environment import environment, environments_line, one_line, runs_environments
from pdmask.train.logging import read_jsonl
from pdmask.train.run_table import COLUMNS, run_table  # noqa: F401  (run_table: the lab's name for it)
from pdmask.train.run_table import fmt as _fmt

from .seed_summary import run_label

#: (file name, title, [(metric key, label suffix)], y label, smoothing window)
PANELS = [
    ("eval_accuracy", "Held-out greedy accuracy", [("eval_accuracy", ""),
                                                   ("eval_last_number_accuracy", " (format-blind)")], "accuracy", 1),
    ("reward", "Training reward (mean over the rollout batch)", [("reward", "")], "reward", 5),
    ("mismatch", "Training-inference mismatch before each step's updates",
     [("mismatch_topk_kl", "")], "top-K KL(mu || pi)", 3),
    ("mask_fractions", "Mask fractions (mean over the step's updates)",
     [("masked_frac", " masked"), ("out_of_region_frac", " out-of-region")], "fraction of tokens", 5),
]

_COLORS = {"grpo": "tab:gray", "none": "tab:brown", "dppo-topk-kl": "tab:blue", "dppo-topk-tv": "tab:cyan",
           "dppo-binary-kl": "tab:purple", "dppo-binary-tv": "tab:pink", "pdm-topk-kl": "tab:red",
           "pdm-topk-tv": "tab:orange", "pdm-full-kl": "tab:green", "pdm-full-tv": "tab:olive",
           "drpo": "black", "spo": "goldenrod", "pdm-smooth-topk-kl": "darkred", "pdm-smooth-topk-tv": "darkorange"}
#: colours for modes outside :data:`_COLORS` (a mode registered by a user), none of them in it
_SPARE = ["navy", "teal", "magenta", "yellowgreen", "slateblue", "sienna", "deepskyblue", "crimson",
          "darkgreen", "orchid", "steelblue", "peru", "lightcoral", "darkcyan", "indigo", "khaki"]


def mode_colors(labels) -> dict[str, str]:
    """A colour per label (a mode, or a group label ``"<mode> δ=..."``), chosen by its mode: a
    known mode's fixed colour, the next spare colour for any other, so distinct modes in one
    figure never share a colour (spares repeat only past 16 unknown modes)."""
    spare, by_mode, out = itertools.cycle(_SPARE), {}, {}
    for label in dict.fromkeys(labels):
        mode = label.split(" ")[0]
        if mode not in by_mode:
            by_mode[mode] = _COLORS.get(mode) or next(spare)
        out[label] = by_mode[mode]
    return out


def has_delta(mode: str) -> bool:
    """Whether ``mode``'s loss reads a δ: not ``none`` (no direction: it masks nothing, its
    region only feeds the metrics) nor a ratio-clip mode (``grpo``: its region is epsilon).
    A mode the registry does not know keeps its δ."""
    from pdmask.masks import get_mode

    try:
        m = get_mode(mode)
    except (KeyError, ValueError):
        return True
    return m.direction is not None and "delta" in m.reads  # the mode's declaration: grpo reads eps


def legend_label(group: str) -> str:
    """A group label (``"<mode>[@variant] δ=..."``, :func:`pdmask_lab.seed_summary.run_label`) as
    a figure's legend shows it: without the δ of a mode that has none (``none``, ``grpo``).
    The group label itself is kept (it keys the summaries)."""
    label, sep, _ = group.partition(" δ=")
    return label if sep and not has_delta(label.partition("@")[0]) else group


def find_runs(paths: list[str | Path]) -> list[Path]:
    """Run directories under ``paths`` (a path may be a run or a directory of runs)."""
    out = []
    for p in map(Path, paths):
        if (p / "metrics.jsonl").exists():
            out.append(p)
        elif p.is_dir():
            out += sorted(d for d in p.iterdir() if (d / "metrics.jsonl").exists())
        else:
            raise ValueError(f"run_dirs: {str(p)!r} is neither a run directory nor a directory of runs")
    if not out:
        raise ValueError(f"run_dirs: no metrics.jsonl found under {', '.join(map(str, paths))}")
    return out


def _smooth(xs, w):
    if w <= 1:
        return xs
    out, acc = [], []
    for x in xs:
        acc.append(x)
        acc = acc[-w:]
        out.append(sum(acc) / len(acc))
    return out


def plot_runs(runs: list[Path], out_dir: str | Path) -> list[Path]:
    """Write one PNG per panel plus ``overview.png``; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {r: read_jsonl(r / "metrics.jsonl") for r in runs}
    groups = defaultdict(list)
    for r in runs:
        groups[run_label(r)[0]].append(r)
    written = []
    fig_all, axes = plt.subplots(2, 2, figsize=(13, 8.5))

    colors = mode_colors(groups)
    for (fname, title, series, ylabel, w), ax_all in zip(PANELS, axes.flat):
        fig, ax = plt.subplots(figsize=(7.5, 4.5))
        for a in (ax, ax_all):
            for group, rs in groups.items():
                color = colors[group]
                for si, (key, suffix) in enumerate(series):
                    style = "-" if si == 0 else "--"
                    curves = []
                    for r in rs:
                        pts = [(rec["step"], rec[key]) for rec in data[r] if rec.get(key) is not None]
                        if not pts:
                            continue
                        xs, ys = zip(*pts)
                        ys = _smooth(list(ys), w)
                        curves.append(dict(zip(xs, ys)))
                        if len(rs) > 1:
                            a.plot(xs, ys, style, color=color, alpha=0.3, lw=1)
                    if not curves:
                        continue
                    steps = sorted(set().union(*curves))
                    mean = [sum(c[s] for c in curves if s in c) / sum(s in c for c in curves) for s in steps]
                    n = f" (mean of {len(curves)})" if len(curves) > 1 else ""
                    a.plot(steps, mean, style, color=color, lw=2, label=f"{legend_label(group)}{suffix}{n}",
                           marker="o" if fname == "eval_accuracy" else None, ms=3)
            a.set_title(title + (f" (moving mean of {w})" if w > 1 else ""), fontsize=10)
            a.set_xlabel("RL step")
            a.set_ylabel(ylabel)
            a.grid(alpha=0.3)
            if fname == "mismatch":
                a.set_yscale("log")
            a.legend(fontsize=8)
        fig.tight_layout()
        p = out_dir / f"{fname}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)
    fig_all.tight_layout()
    p = out_dir / "overview.png"
    fig_all.savefig(p, dpi=100)
    plt.close(fig_all)
    written.append(p)
    written.append(plot_eval_bands(runs, out_dir))
    written.append(plot_curve_bands(runs, out_dir))
    return written


def eval_bands(runs: list[Path], key: str = "eval_accuracy", window: int = 1,
               records: dict[Path, list[dict]] | None = None) -> dict[str, dict]:
    """Per group: ``steps``, and over the seeds logged at each step ``mean``, ``lo``
    (min), ``hi`` (max) of ``key`` (each run's series smoothed by a trailing moving mean of
    ``window`` first), and ``n`` (seeds at that step). ``records``: the runs' metrics
    already read (run -> records), else each run's metrics.jsonl is read."""
    groups = defaultdict(list)
    for r in runs:
        groups[run_label(r)[0]].append(r)
    out = {}
    for g, rs in groups.items():
        by_step = defaultdict(list)
        for r in rs:
            recs = records[r] if records is not None else read_jsonl(r / "metrics.jsonl")
            pts = [(rec["step"], rec[key]) for rec in recs if rec.get(key) is not None]
            if pts:
                xs, ys = zip(*pts)
                for x, y in zip(xs, _smooth(list(ys), window)):
                    by_step[x].append(y)
        steps = sorted(by_step)
        out[g] = {"steps": steps, "mean": [sum(by_step[s]) / len(by_step[s]) for s in steps],
                  "lo": [min(by_step[s]) for s in steps], "hi": [max(by_step[s]) for s in steps],
                  "n": [len(by_step[s]) for s in steps], "seeds": len(rs)}
    return out


#: the panels of ``curves_bands.png``: (metric key, title, y label, smoothing window, log y)
BAND_PANELS = [
    ("eval_accuracy", "Held-out greedy accuracy", "accuracy", 1, False),
    ("reward", "Training reward", "reward", 3, False),
    ("entropy_mean", "Policy entropy", "nats", 3, False),
    ("response_length", "Response length", "tokens", 3, False),
    ("mismatch_topk_kl", "Engine-trainer mismatch", "top-K KL(mu || pi)", 3, True),
]
#: a panel added when the runs log it (since 2026-12-02; older records have no finish rate)
FINISH_PANEL = ("finish_rate", "Answers that end (finish rate)", "share of responses", 3, False)


def plot_curve_bands(runs: list[Path], out_dir: str | Path) -> Path:
    """``curves_bands.png``: one panel per :data:`BAND_PANELS` metric (and :data:`FINISH_PANEL`
    when the runs log it); per mode the mean
    over seeds with its min-max band over seeds (each seed smoothed first)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    records = {r: read_jsonl(r / "metrics.jsonl") for r in runs}  # read once for every panel
    panels = BAND_PANELS + ([FINISH_PANEL] if any(x.get("finish_rate") is not None for recs in records.values()
                                                  for x in recs) else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8))
    for ax, (key, title, ylabel, w, logy) in zip(axes, panels):
        bands = eval_bands(runs, key, w, records)
        colors = mode_colors(bands)
        for g, b in bands.items():
            if not b["steps"]:
                continue
            color = colors[g]
            ax.plot(b["steps"], b["mean"], "-", color=color, lw=1.8, label=f"{legend_label(g)} ({b['seeds']} seeds)")
            if b["seeds"] > 1:
                ax.fill_between(b["steps"], b["lo"], b["hi"], color=color, alpha=0.15, lw=0)
        ax.set_title(title + (f" (moving mean of {w})" if w > 1 else ""), fontsize=9)
        ax.set_xlabel("RL step")
        ax.set_ylabel(ylabel)
        if logy:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("Mean over seeds; band = min–max over seeds", fontsize=10)
    fig.tight_layout()
    p = out_dir / "curves_bands.png"
    fig.savefig(p, dpi=100)
    plt.close(fig)
    return p


def plot_eval_bands(runs: list[Path], out_dir: str | Path) -> Path:
    """``eval_accuracy_bands.png``: per mode the mean held-out accuracy over seeds, shaded
    between the min and the max over seeds (not a confidence band: with a few seeds the
    range is the honest picture of their spread)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    bands = eval_bands(runs)
    colors = mode_colors(bands)
    for g, b in bands.items():
        color = colors[g]
        if not b["steps"]:
            continue
        ax.plot(b["steps"], b["mean"], "-o", color=color, lw=2, ms=3,
                label=f"{legend_label(g)} (mean of {b['seeds']} seeds)")
        if b["seeds"] > 1:
            ax.fill_between(b["steps"], b["lo"], b["hi"], color=color, alpha=0.2, lw=0)
    ax.set_title("Held-out greedy accuracy: mean over seeds, band = min–max over seeds", fontsize=10)
    ax.set_xlabel("RL step")
    ax.set_ylabel("accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    p = out_dir / "eval_accuracy_bands.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


# ------------------------------------------------------------------ tables
def summary_table(summaries: list[dict], title: str = "runs"):
    """A rich Table of run summaries (see :func:`pdmask.train.grpo.summarize`)."""
    from rich.table import Table

    t = Table(title=title)
    for _, head, _ in COLUMNS:
        t.add_column(head, justify="right" if head not in ("mode",) else "left")
    for s in summaries:
        t.add_row(*[_fmt(s.get(k), f) for k, _, f in COLUMNS])
    return t


def markdown_table(summaries: list[dict]) -> str:
    heads = [h for _, h, _ in COLUMNS]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for s in summaries:
        lines.append("| " + " | ".join(_fmt(s.get(k), f) for k, _, f in COLUMNS) + " |")
    return "\n".join(lines)


def load_summaries(runs: list[Path]) -> list[dict]:
    """``summary.json`` of each run (recomputed from metrics.jsonl when missing)."""
    from pdmask.train.config import load_config
    from pdmask.train.grpo import summarize

    out = []
    for r in runs:
        p = r / "summary.json"
        if p.exists():
            try:
                s = json.loads(p.read_text())
            except (OSError, ValueError) as e:  # a damaged file is named, never a traceback wall
                raise ValueError(f"{p}: not a readable JSON summary ({type(e).__name__}: {e}); delete it to "
                                 "recompute it from metrics.jsonl") from None
            if not isinstance(s, dict):
                raise ValueError(f"{p}: holds a {type(s).__name__}, not a JSON object; delete it to recompute it "
                                 "from metrics.jsonl")
            out.append(s)
        else:
            cfg = load_config(r / "config.yaml") if (r / "config.yaml").exists() else None
            if cfg is not None:
                out.append(summarize(read_jsonl(r / "metrics.jsonl"), cfg))
    return out



# ------------------------------------------------------------------ summary files
def summary_markdown(res: dict) -> str:
    """``summary.md`` of a compare directory from its ``summary.json`` content (every part
    optional: a summary rebuilt by ``pdmask report`` has no timings)."""
    lines = []
    if res.get("environment") or res.get("runs_environments"):
        lines += [one_line(res.get("environment")), ""]
        if environments_line(res.get("runs_environments") or []):
            lines += [environments_line(res["runs_environments"]), ""]
    if res.get("sft"):
        lines += [f"SFT base greedy held-out accuracy: {res['sft'].get('eval_greedy_accuracy')}", ""]
    if res.get("runs"):
        lines += ["## Runs", "", markdown_table(res["runs"]), ""]
    for k, v in res.get("step_time_ratio_interleaved", {}).items():
        lines.append(f"- step-time ratio {k} (interleaved loss forward+backward, {v['reps']} reps): {v['ratio']:.3f}")
    for k, v in res.get("step_time_ratio_runs", {}).items():
        lines.append(f"- step-time ratio {k} (median update time per 1k tokens of the runs): "
                     f"{v['update_s_per_1k_tokens']:.3f}; per step: {v['time_step_s']:.3f}")
    if "total_wall_s" in res:
        lines.append(f"- total wall time {res['total_wall_s']:.0f} s; load average at start {res['load_avg_start']}")
    if res.get("across_seeds"):
        from .seed_summary import seed_markdown

        lines += ["", seed_markdown(res["across_seeds"])]
    return "\n".join(lines).rstrip("\n") + "\n"


def split_environments(summaries: list[dict]) -> tuple[list[dict], list[dict]]:
    """The run summaries without their ``environment`` and the distinct environments
    (:func:`pdmask.train.environment.runs_environments`): a summary of many runs holds each
    environment once."""
    return [{k: v for k, v in s.items() if k != "environment"} for s in summaries], runs_environments(summaries)


def write_summary(directory: str | Path, updates: dict) -> tuple[Path, Path]:
    """Merge ``updates`` into ``directory/summary.json`` (other keys kept) and rewrite
    ``summary.md`` from the result. Returns both paths.

    ``updates["runs"]`` (run summaries) have their environments moved into
    ``runs_environments``; the summary's ``environment`` is the one the runs share, or, when
    they differ or recorded none, the one an earlier writer (``pdmask compare``) recorded, else
    this process's (with ``source`` saying so)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    pj, pm = d / "summary.json", d / "summary.md"
    res = json.loads(pj.read_text()) if pj.exists() else {}
    updates = dict(updates)
    if "runs" in updates:
        updates["runs"], groups = split_environments(updates["runs"])
        updates["runs_environments"] = groups
        if "environment" not in updates:
            if len(groups) == 1 and groups[0]["environment"] is not None:
                updates["environment"] = groups[0]["environment"] | {"source": "the runs"}
            elif not res.get("environment"):
                updates["environment"] = environment() | {"source": "the process that wrote this summary"}
    res.update(updates)
    pj.write_text(json.dumps(res, indent=2, default=str))
    pm.write_text(summary_markdown(res))
    return pj, pm
