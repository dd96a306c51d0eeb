"""``pdmask audit-grid``: does the audit's verdict generalise across model shapes?

One audit (:func:`pdmask_lab.audit.cli.run_cli`, the same settings everywhere) per cell of
tied / untied embeddings x vocabulary size x hidden size (``intermediate_size = 3 x
hidden``, SFT learning rate x ``128 / hidden``; every cell has its own SFT base, trained
and cached on first use). Per cell
and per step kind, on the headline disagreement set: the pooled sign accuracy of the
predictive criterion and of the ratio, the count where the predictive one is right and
its exact binomial p; on the uniform sample of O: the output layer's share of the
first-order change. Writes ``grid.json``, ``grid.md`` and ``grid.png`` (heatmap) into
``--out``, each cell's full report into ``--out/<cell>/``. Resumable: a finished cell
(its ``audit.json`` with the same settings) is reused, an unfinished one resumes per seed.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import List, Optional

import typer

GRID_HELP = ("Direction audit over model shapes (tied/untied x vocab x hidden): per cell the sign accuracy of "
             "predictive vs ratio on the disagreement set under every step kind, and the output layer's share. "
             "Writes grid.json, grid.md, grid.png.")
#: step kinds shown in the grid, in order
GRID_KINDS = ("logit", "param", "precond", "own", "batch")


def cell_name(tied: bool, vocab: int, hidden: int) -> str:
    return f"{'tied' if tied else 'untied'}-V{vocab}-H{hidden}"


def _ints(name: str, text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{name}: expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise ValueError(f"{name}: expected positive integers, got {text!r}")
    return vals


def _ties(text: str) -> list[bool]:
    vals = [x.strip() for x in text.split(",") if x.strip()]
    bad = [v for v in vals if v not in ("tied", "untied")]
    if not vals or bad:
        raise ValueError(f"ties: expected a comma-separated list of tied, untied; got {text!r}")
    return [v == "tied" for v in vals]


def grid_command(
    out: Path = typer.Option(Path("audit-grid"), "--out", "-o", help="output directory (one sub-directory per cell)"),
    config: Optional[Path] = typer.Option(None, "--config", help="trainer YAML preset shared by every cell"),
    set_: List[str] = typer.Option([], "--set", help="trainer config override key=value (every cell)"),
    ties: str = typer.Option("tied,untied", "--ties", help="tied, untied (comma-separated)"),
    vocab: str = typer.Option("1024,4096", "--vocab", help="vocabulary sizes (comma-separated)"),
    hidden: str = typer.Option("128,256", "--hidden", help="hidden sizes (comma-separated; MLP width = 3 x hidden)"),
    cells: str = typer.Option("", "--cells", help="only these cells of the grid, e.g. tied-V1024-H128,untied-V4096-H128 "
                                                  "(comma-separated; default: every cell)"),
    seeds: int = typer.Option(8, "--seeds", help="rollout batches (seeds) per cell"),
    seed_offset: int = typer.Option(0, "--seed-offset", help="first seed"),
    precision: Optional[str] = typer.Option(None, "--precision", help="engine precision"),
    lag: int = typer.Option(0, "--lag", help="policy steps ahead of the engine"),
    delta: Optional[float] = typer.Option(None, "--delta", help="the audit's delta, for A > 0 and A < 0 (default 0.05)"),
    lr: Optional[float] = typer.Option(None, "--lr", help="batch-step learning rate (default: the trainer's)"),
    sample_tokens: int = typer.Option(16, "--sample-tokens", help="uniform sample of O per seed (instruments)"),
    disagreement_tokens: int = typer.Option(-1, "--disagreement-tokens", help="disagreement tokens per seed (-1: all)"),
    instruments: str = typer.Option("param,precond,own", "--instruments", help="per-token instruments"),
    bootstrap: int = typer.Option(2000, "--bootstrap", help="seed-cluster bootstrap resamples"),
    jobs: int = typer.Option(1, "--jobs", help="worker processes per cell"),
    fresh: bool = typer.Option(False, "--fresh", help="discard finished cells and seeds"),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="progress bars"),
) -> None:
    """Direction audit over model shapes."""
    run_grid(**dict(locals()))  # user errors: one line via pdmask.cli.user_errors


def cell_sft_lr(base_lr: float, hidden: int) -> float:
    """The cell's SFT learning rate: the preset's, times ``128 / hidden`` (Adam's rate for
    hidden matrices scales as 1 / width). Measured: at the preset's 3e-3 the hidden-256
    bases did not learn the task (greedy accuracy 0.5-2%, every rollout reward 0, so no
    advantage and no token out of the region)."""
    return base_lr * 128 / hidden


def _cell_args(a: dict, tied: bool, V: int, H: int) -> dict:
    """The keyword arguments of :func:`pdmask_lab.audit.command.run_cli` for one cell."""
    from pdmask.train.config import load_config

    base = load_config(a["config"], list(a["set_"])).sft_lr
    over = list(a["set_"]) + [f"tie_embeddings={'true' if tied else 'false'}", f"vocab_size={V}",
                              f"hidden_size={H}", f"intermediate_size={3 * H}"]
    if H != 128:  # hidden 128 keeps the preset's rate (and its cached SFT base) as it is
        over.append(f"sft_lr={cell_sft_lr(base, H)!r}")
    return dict(out=Path(a["out"]) / cell_name(tied, V, H), model="", config=a["config"], set_=over,
                seeds=a["seeds"], seed_offset=a["seed_offset"], precision=a["precision"], temperature=None,
                top_k=None, lag=a["lag"], divergence="topk_kl", delta=a["delta"],
                estimator="exact", step_mode="none", optimizer="adamw", lr=a["lr"],
                sample_tokens=a["sample_tokens"], disagreement_tokens=a["disagreement_tokens"],
                instruments=a["instruments"], isolated_step=1e-5, logit_step=1e-7, tie_tol=0.0,
                bootstrap=a["bootstrap"], jobs=a["jobs"], fresh=a["fresh"], plots=False, progress=a["progress"])


def cell_summary(doc: dict) -> dict:
    """The grid's numbers of one cell from its ``audit.json``."""
    S = doc["summary"]
    headline = f"pred-{doc['settings']['audit']['estimator']}"
    row = {"n_seeds": len(S["per_seed"]), "n_out_of_region": sum(s["n_out_of_region"] for s in S["per_seed"]),
           "n_disagreement": sum(s["n_disagreement"][headline] for s in S["per_seed"]), "kinds": {}}
    for kind in GRID_KINDS:
        t = S["rates"].get(kind, {}).get(f"disagreement:{headline}")
        if not t:
            continue
        st = t[f"vs_ratio"][headline]["sign_test"]
        row["kinds"][kind] = {"predictive": t["criteria"][headline]["sign_accuracy"]["estimate"],
                              "ratio": t["criteria"]["ratio"]["sign_accuracy"]["estimate"],
                              "diff": t["vs_ratio"][headline]["sign_accuracy"],
                              "n_tokens": t["n_tokens"], "n_seeds": t["n_seeds"], "sign_test": st}
    g = S.get("group_shares", {}).get("out_of_region") or {}
    row["head_share"] = g.get("share_head")
    row["head_share_disagreement"] = (S.get("group_shares", {}).get(f"disagreement:{headline}") or {}).get("share_head")
    row["wall_s"] = doc["settings"]["run"].get("wall_s")
    row["num_params"] = doc["settings"]["run"].get("num_params")
    row["vocab_size"] = doc["settings"]["run"].get("vocab_size")
    row["sft_wall_s"] = (doc["settings"]["run"].get("sft") or {}).get("wall_s")
    seeds = S["per_seed"]
    row["seconds_per_seed"] = (sum(s.get("time_total_s", 0.0) + s.get("time_rollout_s", 0.0) for s in seeds)
                               / len(seeds)) if seeds else None
    return row


def select_cells(ties: str, vocab: str, hidden: str, cells: str = "") -> list[tuple[bool, int, int]]:
    """The grid's cells (tied, V, H) in run order: the product of ``ties x vocab x hidden``,
    restricted to the names in ``cells`` when given (each must be a cell of the product)."""
    grid = [(t, V, H) for t in _ties(ties) for V in _ints("vocab", vocab) for H in _ints("hidden", hidden)]
    want = [x.strip() for x in cells.split(",") if x.strip()]
    if not want:
        return grid
    names = {cell_name(*c): c for c in grid}
    bad = [w for w in want if w not in names]
    if bad:
        raise ValueError(f"cells: {', '.join(bad)} not in the grid of --ties/--vocab/--hidden "
                         f"(valid: {', '.join(names)})")
    return [c for c in grid if cell_name(*c) in want]


def run_grid(*, out, config, set_, ties, vocab, hidden, seeds, seed_offset, precision, lag, delta, lr, sample_tokens,
             disagreement_tokens, instruments, bootstrap, jobs, fresh, progress, cells="") -> dict:
    a = dict(locals())
    from rich.console import Console

    from .command import run_cli

    cells = select_cells(ties, vocab, hidden, cells)
    console = Console(stderr=True)
    Path(out).mkdir(parents=True, exist_ok=True)
    rows = {}
    for i, (t, V, H) in enumerate(cells):
        name = cell_name(t, V, H)
        console.print(f"audit-grid: cell {i + 1}/{len(cells)} {name}")
        t0 = time.time()
        kw = _cell_args(a, t, V, H)
        _ensure_base(kw, jobs, console)
        doc = run_cli(**kw)
        rows[name] = {"tied": t, "vocab": V, "hidden": H, **cell_summary(doc), "cell_wall_s": round(time.time() - t0, 1)}
        _write(Path(out), a, rows)  # after every cell: a killed grid keeps what it has
    return _write(Path(out), a, rows)


def _ensure_base(kw: dict, jobs: int, console) -> None:
    """The cell's SFT base, trained (or found) before its audit starts, with ``jobs`` threads."""
    from .command import _configs, ensure_base

    tcfg, _ = _configs(kw)
    ensure_base(kw, tcfg, jobs, console)


def _write(out: Path, a: dict, rows: dict) -> dict:
    doc = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in a.items()}, "cells": rows}
    (out / "grid.json").write_text(json.dumps(doc, indent=1, default=str))
    (out / "grid.md").write_text(grid_markdown(doc))
    if rows:
        plot_grid(out / "grid.png", doc)
    return doc


def _f(x, spec=".1%") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _pp(d: dict) -> str:
    """A pooled difference with its seed-cluster interval, in percentage points."""
    if not d or d.get("estimate") is None or (isinstance(d["estimate"], float) and math.isnan(d["estimate"])):
        return "n/a"
    return f"{100 * d['estimate']:+.0f} pp [{100 * d['lo']:+.0f}, {100 * d['hi']:+.0f}]"


def grid_markdown(doc: dict) -> str:
    L = ["# Direction audit grid", "",
         "Per cell (embeddings x vocabulary x hidden size) and step kind, on the disagreement set of the exact "
         "predictive criterion and the ratio: sign accuracy predictive / ratio (pooled over tokens), their "
         "difference with the 95% seed-cluster bootstrap interval, the count of tokens where the predictive "
         "criterion is right of the untied ones and the exact binomial p (tokens taken as independent; the "
         "interval resamples seeds). *O*: out-of-region tokens; *dis.*: disagreement tokens. *head share*: "
         "the output layer's pooled share of `sum |term|` of `<grad D, grad A log pi>` on the uniform sample of O.",
         "", "| cell | params | seeds | O | dis. | head share | " + " | ".join(GRID_KINDS) + " |",
         "|---|---|---|---|---|---|" + "---|" * len(GRID_KINDS)]
    for name, r in doc["cells"].items():
        cols = []
        for k in GRID_KINDS:
            e = r["kinds"].get(k)
            if not e:
                cols.append("n/a")
                continue
            st = e["sign_test"]
            cols.append(f"{_f(e['predictive'])} / {_f(e['ratio'])}, {_pp(e['diff'])} ({st['predictive_right']}/"
                        f"{st['n_untied']}, p={st['p']:.2g})")
        L.append(f"| {name} | {r.get('num_params') or 'n/a'} | {r['n_seeds']} | {r['n_out_of_region']} | "
                 f"{r['n_disagreement']} | {_f(r.get('head_share'), '.2%')} | " + " | ".join(cols) + " |")
    L += ["", "Cost per cell: the SFT base's training time (once; cached after), and the audit's seconds per seed "
          "(rollout + every stage, one worker; the lag steps and model set-up come on top once per worker).", "",
          "| cell | SFT s | audit s per seed |", "|---|---|---|"]
    for name, r in doc["cells"].items():
        L.append(f"| {name} | {_f(r.get('sft_wall_s'), '.0f')} | {_f(r.get('seconds_per_seed'), '.1f')} |")
    s = doc["settings"]
    L += ["", "Reproduce:", "", "```", "pdmask audit-grid " + " ".join(
        f"--{k.rstrip('_').replace('_', '-')} {v}" for k, v in s.items()
        if k not in ("out", "progress", "fresh", "set_", "config") and v not in (None, "")) +
        (f" --config {s['config']}" if s.get("config") else "") +
        "".join(f" --set {x}" for x in s.get("set_", [])) + f" --out {s['out']}", "```", ""]
    return "\n".join(L)


def plot_grid(path: Path, doc: dict) -> None:
    """Heatmap: predictive - ratio sign accuracy on the disagreement set (cells x kinds),
    annotated with the predictive one's count and the binomial p; and the output layer's share."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = list(doc["cells"])
    M = np.full((len(names), len(GRID_KINDS)), np.nan)
    ann = [["" for _ in GRID_KINDS] for _ in names]
    for i, n in enumerate(names):
        for j, k in enumerate(GRID_KINDS):
            e = doc["cells"][n]["kinds"].get(k)
            if e and e["predictive"] is not None and e["ratio"] is not None:
                M[i, j] = 100 * (e["predictive"] - e["ratio"])
                st = e["sign_test"]
                ann[i][j] = (f"{_pp(e['diff'])}\n{st['predictive_right']}/{st['n_untied']} right, "
                             f"p={st['p']:.2g}")
    share = np.array([[100 * (doc["cells"][n].get("head_share") or np.nan)] for n in names])
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(2.0 * len(GRID_KINDS) + 3.5, 0.75 * len(names) + 2.2),
                                 gridspec_kw={"width_ratios": [len(GRID_KINDS), 1.3]})
    im = a1.imshow(M, cmap="RdBu", vmin=-100, vmax=100, aspect="auto")
    for i in range(len(names)):
        for j in range(len(GRID_KINDS)):
            dark = np.isfinite(M[i, j]) and abs(M[i, j]) > 60  # white text on the dark ends of the map
            a1.text(j, i, ann[i][j] or "n/a", ha="center", va="center", fontsize=7, color="w" if dark else "k")
    a1.set_xticks(range(len(GRID_KINDS)), GRID_KINDS)
    a1.set_yticks(range(len(names)), names)
    a1.set_title("disagreement set: sign accuracy predictive - ratio\n(blue: predictive right more often)")
    fig.colorbar(im, ax=a1, fraction=0.04, label="pp")
    smax = max(1.0, float(np.nanmax(share)) if np.isfinite(share).any() else 1)
    im2 = a2.imshow(share, cmap="viridis", vmin=0, vmax=smax, aspect="auto")
    for i in range(len(names)):
        light = np.isfinite(share[i, 0]) and share[i, 0] > 0.6 * smax  # viridis is light at the top
        a2.text(0, i, "n/a" if np.isnan(share[i, 0]) else f"{share[i, 0]:.2f}%", ha="center", va="center",
                fontsize=8, color="k" if light else "w")
    a2.set_xticks([0], ["output layer\nshare (%)"])
    a2.set_yticks([])
    fig.colorbar(im2, ax=a2, fraction=0.2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
