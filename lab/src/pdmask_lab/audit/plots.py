"""PNG plots of an audit: rates with intervals per criterion, fidelity vs K, and the
scatter of predicted vs realized divergence change. matplotlib is imported lazily."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from pdmask.keys import ESTIMATORS
from .criteria import CRITERIA, RATIO, predictive_name
from .paper import PAPER
from .tables import KINDS

_RATES = (("unsafe_keep", "unsafe-keep"), ("corrective", "corrective"), ("sign_accuracy", "sign accuracy"))


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_rates(path: Path, doc: dict) -> None:
    """Sign accuracy, unsafe-keep and corrective rates per criterion, one panel per step
    kind (on O, or the uniform sample of O for the per-token instruments), pooled with
    their seed-cluster bootstrap intervals."""
    plt = _plt()
    rates = doc["summary"]["rates"]
    headline = predictive_name(doc["settings"]["audit"]["estimator"])
    kinds = [k for k in KINDS if k in rates and "out_of_region" in rates[k]]
    if not kinds:
        fig, ax = plt.subplots(figsize=(5, 3))
        ax.text(0.5, 0.5, "no out-of-region tokens", ha="center", transform=ax.transAxes)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return
    fig, axes = plt.subplots(1, len(kinds), figsize=(4.2 * len(kinds), 4.2), sharey=True, squeeze=False)
    axes = axes[0]
    for ax, kind in zip(axes, kinds):
        crit = rates[kind]["out_of_region"]["criteria"]
        for j, (r, label) in enumerate(_RATES):
            xs, ys, lo, hi = [], [], [], []
            for i, c in enumerate(CRITERIA):
                st = crit.get(c, {}).get(r)
                if st and _finite(st.get("estimate")):
                    e = st["estimate"]
                    a, b = st.get("lo"), st.get("hi")
                    ok = _finite(a) and _finite(b)
                    xs.append(i + (j - 1) * 0.22)
                    ys.append(e)
                    lo.append(e - a if ok else 0.0)
                    hi.append(b - e if ok else 0.0)
            ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o", capsize=3, label=label)
        if kind == "batch":
            for r, mk in (("unsafe_keep", "v"), ("corrective", "^")):
                ax.scatter([CRITERIA.index(RATIO) + (0 if r == "corrective" else -0.22)],
                           [PAPER[r]["ratio"]], marker=mk, color="k", zorder=5)
                ax.scatter([CRITERIA.index(headline) + (0 if r == "corrective" else -0.22)],
                           [PAPER[r]["predictive"]], marker=mk, color="k", zorder=5,
                           label=f"paper ({r.replace('_', '-')})")
        ax.set_xticks(range(len(CRITERIA)), [c.replace("pred-", "p-") for c in CRITERIA], rotation=30)
        n = rates[kind]["out_of_region"]["n_tokens"]
        ax.set_title(f"{kind} ({n} tokens)")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("rate (pooled, 95% seed-cluster bootstrap CI)")
    axes[0].legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_fidelity(path: Path, doc: dict) -> None:
    plt = _plt()
    F = doc["summary"]["fidelity"]
    has_o = "out_of_region" in F and any(_finite(st["estimate"]) for st in F["out_of_region"]["kl_share"].values())
    name = "out_of_region" if has_o else "response"
    e = F[name]
    ks = sorted(e["sign_agreement"], key=int)
    kx = [int(k) for k in ks]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    styles = {"exact": ("o", "-"), "aggregated": ("s", "--"), "uniform": ("^", "-."), "truncated": ("x", ":")}
    for est in ESTIMATORS:
        pts = [(x, e["sign_agreement"][k][est]) for x, k in zip(kx, ks) if _finite(e["sign_agreement"][k][est]["estimate"])]
        if not pts:
            continue
        ys = [st["estimate"] for _, st in pts]
        lo = [st["estimate"] - st["lo"] if _finite(st["lo"]) else 0.0 for _, st in pts]
        hi = [st["hi"] - st["estimate"] if _finite(st["hi"]) else 0.0 for _, st in pts]
        mk, ls = styles.get(est, ("o", "-"))
        a1.errorbar([x for x, _ in pts], ys, yerr=[lo, hi], marker=mk, ls=ls, capsize=2, label=est)
    if not a1.lines:
        a1.text(0.5, 0.5, "no tokens in this set", ha="center", transform=a1.transAxes)
    else:
        a1.set_xscale("log")
        a1.legend()
    a1.set_xlabel("K")
    a1.set_ylabel("sign agreement with full-vocabulary Ddot")
    a1.set_title(f"estimator fidelity ({name.replace('_', '-')} tokens)")
    a1.grid(alpha=0.3)
    for div in ("kl", "tv"):
        pts = [(x, e[f"{div}_share"][k]["estimate"]) for x, k in zip(kx, ks) if _finite(e[f"{div}_share"][k]["estimate"])]
        a2.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=f"top-K {div.upper()} / full")
    a2.axhline(0.99, color="k", ls=":", label="paper: top-20 > 99% of KL")
    if any(len(line.get_xdata()) for line in a2.lines[:-1]):
        a2.set_xscale("log")
    a2.set_xlabel("K")
    a2.set_ylabel("share captured (pooled)")
    a2.legend()
    a2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_scatter(path: Path, doc: dict, results) -> None:
    """Predicted ``A * Ddot`` (headline) against each step kind's value, per token of O."""
    from .runner import concat_tokens

    plt = _plt()
    headline = predictive_name(doc["settings"]["audit"]["estimator"])
    rec = concat_tokens(results)
    panels = [(KINDS[k][0], k) for k in ("batch", "param", "precond", "own", "isolated")
              if KINDS[k][0] in rec and np.isfinite(rec[KINDS[k][0]]).any()]
    if not panels:
        panels = [("dD_batch", "batch")]
    A = rec.get("A", np.zeros(0))
    pred = A * rec.get(f"c_{headline}", np.zeros(0))
    agree = np.sign(A * rec.get(f"c_{RATIO}", np.zeros(0))) == np.sign(pred)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4.2), squeeze=False)
    for ax, (key, title) in zip(axes[0], panels):
        y = rec.get(key, np.zeros(0))
        ok = np.isfinite(y)
        for sel, col, lab in ((ok & agree, "tab:blue", "ratio agrees"), (ok & ~agree, "tab:red", "ratio disagrees")):
            ax.scatter(pred[sel], y[sel], s=6, alpha=0.5, color=col, label=f"{lab} ({int(sel.sum())})")
        lin_x = max(float(np.median(np.abs(pred[ok]))) if ok.any() else 1e-6, 1e-15) * 0.1
        lin_y = max(float(np.median(np.abs(y[ok]))) if ok.any() else 1e-6, 1e-15) * 0.1
        ax.set_xscale("symlog", linthresh=lin_x)
        ax.set_yscale("symlog", linthresh=lin_y)
        ax.axhline(0, color="k", lw=0.5)
        ax.axvline(0, color="k", lw=0.5)
        ax.set_xlabel(f"predicted: A * Ddot ({headline})")
        ax.set_ylabel(key)
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def plot_all(outdir, doc: dict, results) -> None:
    out = Path(outdir)
    plot_rates(out / "rates.png", doc)
    plot_fidelity(out / "fidelity.png", doc)
    plot_scatter(out / "scatter.png", doc, results)
