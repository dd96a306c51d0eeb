"""PNG plots of an audit: rates with intervals per criterion, fidelity vs K, and the
scatter of predicted vs realized divergence change. matplotlib is imported lazily."""

from __future__ import annotations

from pathlib import Path

import torch

from ..directions import ESTIMATORS
from .criteria import CRITERIA, RATIO, predictive_name
from .paper import PAPER

_RATES = (("unsafe_keep", "unsafe-keep"), ("corrective", "corrective"), ("sign_accuracy", "sign accuracy"))


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_rates(path: Path, doc: dict) -> None:
    plt = _plt()
    rates = doc["summary"]["rates"]
    headline = predictive_name(doc["settings"]["audit"]["estimator"])
    kinds = [(k, t) for k, t in (("batch", "batch step"), ("isolated", "isolated step (all params)"),
                                 ("isolated_head", "isolated step (head only)"), ("logit", "logit-space step"))
             if k in rates]
    fig, axes = plt.subplots(1, len(kinds), figsize=(5 * len(kinds), 4.2), sharey=True, squeeze=False)
    axes = axes[0]
    for ax, (kind, title) in zip(axes, kinds):
        crit = rates[kind]["out_of_region"]["criteria"]
        for j, (r, label) in enumerate(_RATES):
            xs, ys, lo, hi = [], [], [], []
            for i, c in enumerate(CRITERIA):
                st = crit.get(c, {}).get(r)
                if st and st["mean"] is not None:
                    xs.append(i + (j - 1) * 0.22)
                    ys.append(st["mean"])
                    lo.append(st["mean"] - st["ci95"][0])
                    hi.append(st["ci95"][1] - st["mean"])
            ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o", capsize=3, label=label)
        if kind == "batch":
            for r, mk in (("unsafe_keep", "v"), ("corrective", "^")):
                ax.scatter([CRITERIA.index(RATIO) + (0 if r == "corrective" else -0.22) + (-0.0)],
                           [PAPER[r]["ratio"]], marker=mk, color="k", zorder=5)
                ax.scatter([CRITERIA.index(headline) + (0 if r == "corrective" else -0.22)],
                           [PAPER[r]["predictive"]], marker=mk, color="k", zorder=5,
                           label=f"paper ({r.replace('_', '-')})")
        ax.set_xticks(range(len(CRITERIA)), [c.replace("pred-", "p-") for c in CRITERIA], rotation=30)
        ax.set_title(title)
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("rate (mean over seeds, 95% bootstrap CI)")
    axes[0].legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_fidelity(path: Path, doc: dict) -> None:
    plt = _plt()
    F = doc["summary"]["fidelity"]
    has_o = "out_of_region" in F and any(st["pooled"] is not None for st in F["out_of_region"]["kl_share"].values())
    name = "out_of_region" if has_o else "response"
    e = F[name]
    ks = sorted(e["sign_agreement"], key=int)
    kx = [int(k) for k in ks]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    styles = {"exact": ("o", "-"), "aggregated": ("s", "--"), "uniform": ("^", "-."), "truncated": ("x", ":")}
    for est in ESTIMATORS:
        pts = [(x, e["sign_agreement"][k][est]) for x, k in zip(kx, ks) if e["sign_agreement"][k][est]["mean"] is not None]
        if not pts:
            continue
        ys = [st["mean"] for _, st in pts]
        lo = [st["mean"] - st["ci95"][0] for _, st in pts]
        hi = [st["ci95"][1] - st["mean"] for _, st in pts]
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
        pts = [(x, e[f"{div}_share"][k]["pooled"]) for x, k in zip(kx, ks) if e[f"{div}_share"][k]["pooled"] is not None]
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
    plt = _plt()
    headline = predictive_name(doc["settings"]["audit"]["estimator"])
    panels = [(k, t) for k, t in (("dD_batch", "batch step"), ("dD_isolated", "isolated step (all params)"),
                                  ("dD_isolated_head", "isolated step (head only)")) if k in results[0].tokens]
    cat = {k: torch.cat([r.tokens[k] for r in results])
           for k in ("A", f"c:{headline}", f"c:{RATIO}", *(k for k, _ in panels))}
    pred = cat["A"] * cat[f"c:{headline}"]
    agree = torch.sign(cat["A"] * cat[f"c:{RATIO}"]) == torch.sign(pred)
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2), squeeze=False)
    for ax, (key, title) in zip(axes[0], panels):
        y = cat[key]
        ok = torch.isfinite(y)
        for sel, col, lab in ((ok & agree, "tab:blue", "ratio agrees"), (ok & ~agree, "tab:red", "ratio disagrees")):
            ax.scatter(pred[sel].numpy(), y[sel].numpy(), s=6, alpha=0.5, color=col, label=f"{lab} ({int(sel.sum())})")
        lin_x = max(float(pred[ok].abs().median()) if ok.any() else 1e-6, 1e-12) * 0.1
        lin_y = max(float(y[ok].abs().median()) if ok.any() else 1e-6, 1e-12) * 0.1
        ax.set_xscale("symlog", linthresh=lin_x)
        ax.set_yscale("symlog", linthresh=lin_y)
        ax.axhline(0, color="k", lw=0.5)
        ax.axvline(0, color="k", lw=0.5)
        ax.set_xlabel(f"predicted: A * Ddot ({headline})")
        ax.set_ylabel("realized dD")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_all(outdir, doc: dict, results) -> None:
    out = Path(outdir)
    plot_rates(out / "rates.png", doc)
    plot_fidelity(out / "fidelity.png", doc)
    plot_scatter(out / "scatter.png", doc, results)
