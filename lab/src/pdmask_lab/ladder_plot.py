"""The ladder's figure: held-out accuracy and collapse rate against each rung's measured
mismatch, per mode (:func:`plot_ladder`, written as ``ladder.png`` by
:func:`pdmask_lab.ladder_report.build_report`)."""

from __future__ import annotations

import math
from pathlib import Path


def plot_data(rep: dict) -> dict:
    """Per (family, mode): x (rung mismatch), accuracy mean/lo/hi, collapse rate/lo/hi, rung names.
    Rungs without a measured mismatch are left out."""
    out: dict = {}
    for r in rep["rungs"]:
        if not r["mismatch"]:
            continue
        for m in r["modes"]:
            d = out.setdefault((r["family"], m["mode"]), {k: [] for k in
                                                          ("x", "acc", "acc_lo", "acc_hi", "coll", "coll_lo",
                                                           "coll_hi", "rung", "n")})
            e = m["eval_final"]
            d["x"].append(r["mismatch"]["estimate"])
            d["acc"].append(e["estimate"])
            d["acc_lo"].append(e["lo"] if e["lo"] is not None else e["estimate"])
            d["acc_hi"].append(e["hi"] if e["hi"] is not None else e["estimate"])
            c = m["collapse"]
            d["coll"].append(c["rate"])
            d["coll_lo"].append(c["lo"])
            d["coll_hi"].append(c["hi"])
            d["rung"].append(r["name"])
            d["n"].append(m["n"])
    for d in out.values():  # left to right by mismatch
        order = sorted(range(len(d["x"])), key=lambda i: d["x"][i])
        for k in d:
            d[k] = [d[k][i] for i in order]
    return out


def _label_positions(rung_x: dict[str, float], *, width: float | None = None, step: float = 0.3) -> dict:
    """Rung name -> (x, y in axes fraction, ha) for the vertical rung labels. A label sits
    left of its x (``ha="right"``); one that would overlap a label already placed goes to
    the right of its x, then a level lower: rungs of similar mismatch would print on top
    of each other. ``width``: a label's width in decades of the log axis (default: 1.8% of
    the axis span, about one 7-point line on the 13-inch figure)."""
    import math

    lxs = {n: math.log10(x) if x > 0 else -12.0 for n, x in rung_x.items()}
    if width is None:
        span = (max(lxs.values()) - min(lxs.values()) + 1.0) if lxs else 1.0
        width = 0.018 * span
    placed: list[list[tuple[float, float]]] = []  # per level: the (lo, hi) extents taken
    out = {}
    for name, x in sorted(rung_x.items(), key=lambda kv: kv[1]):
        lx = lxs[name]
        for level in range(len(placed) + 1):
            if level == len(placed):
                placed.append([])
            taken = placed[level]
            ext = next((e for e in ((lx - width, lx), (lx, lx + width))
                        if all(e[1] <= a or e[0] >= b for a, b in taken)), None)
            if ext is not None:
                taken.append(ext)
                out[name] = (x, 1.0 - step * (level % 3), "right" if ext[1] == lx else "left")
                break
    return out


def plot_ladder(rep: dict, path: str | Path) -> Path:
    """``ladder.png``: final held-out accuracy (left) and collapse rate (right) against the
    rung's measured mismatch (log scale), one line per mode (and line style per family),
    error bars = 95% seed-bootstrap (accuracy) / Clopper-Pearson (collapse) intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .report import mode_colors

    data = plot_data(rep)
    modes = list(dict.fromkeys(m for _, m in data))
    colors = mode_colors(modes)
    fams = list(dict.fromkeys(f for f, _ in data))
    styles = ["-", "--", ":", "-."]
    markers = ["o", "s", "^", "D"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for (fam, mode), d in data.items():
        mi, fi = modes.index(mode), fams.index(fam)
        color = colors[mode]
        jit = 1.12 ** (mi - (len(modes) - 1) / 2)  # spread modes apart on the log axis
        xs = [x * jit for x in d["x"]]
        lab = mode + (f" [{fam}]" if len(fams) > 1 else "") + f" (n = {min(d['n'])}" + \
            (f"-{max(d['n'])}" if max(d["n"]) != min(d["n"]) else "") + " seeds)"
        for ax, y, lo, hi in ((axes[0], d["acc"], d["acc_lo"], d["acc_hi"]),
                              (axes[1], d["coll"], d["coll_lo"], d["coll_hi"])):
            ax.errorbar(xs, y, yerr=[[max(0.0, a - b) for a, b in zip(y, lo)], [max(0.0, b - a) for a, b in zip(y, hi)]],
                        fmt=styles[fi % 4] + markers[fi % 4], color=color, capsize=3, lw=1.5, ms=5,
                        label=lab, mfc=color if fi == 0 else "white")
    rung_x = {}
    for r in rep["rungs"]:
        if r["mismatch"] and r["modes"]:
            rung_x[r["name"]] = r["mismatch"]["estimate"]
    for ax in axes:
        ax.set_xscale("log")
        ax.grid(alpha=0.3, which="both")
        ax.set_xlabel(f"measured mismatch: mean top-K KL(engine || trainer), {rep['reference']} runs")
        for name, (x, y, ha) in _label_positions(rung_x).items():
            ax.annotate(name, (x, y), xycoords=("data", "axes fraction"), rotation=90, fontsize=7,
                        va="top", ha=ha, color="0.4")
    sft = [r["sft_accuracy"] for r in rep["rungs"] if r["sft_accuracy"] is not None and r["family"] == fams[0]] \
        if fams else []
    if sft:
        axes[0].axhline(sum(sft) / len(sft), color="0.5", ls=":", lw=1, label="SFT base (step 0)")
    axes[0].set_ylabel("final held-out greedy accuracy")
    axes[0].set_title("Final held-out accuracy: mean over seeds, 95% seed-bootstrap interval", fontsize=10)
    axes[1].set_ylabel("collapse rate (fraction of seeds)")
    axes[1].set_ylim(-0.05, 1.05)
    axes[1].set_title(f"Collapse (worst drop >= {rep['collapse_drop']:g} or below step 0): "
                      "95% Clopper-Pearson", fontsize=10)
    axes[0].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p
