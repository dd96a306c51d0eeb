"""The ladder's paired comparison pooled over rungs, clustered by seed.

One rung's 8 paired seeds can resolve a large difference (p >= 2/2^8) but bound a small
one only loosely. Every rung of a ladder runs the same seed numbers, so for a mode and
the reference the seed is the unit the whole ladder shares: per seed ``s``,

    d_s = mean over the rungs R (where both modes ran) of  acc[r, mode, s] - acc[r, ref, s]

and the pooled comparison is the mean of ``d_s`` over seeds with a seed-bootstrap
interval and a two-sided sign-flip p (:func:`pdmask_lab.significance.paired_difference` on
the per-seed means). Flipping the sign of a whole seed (all its rungs at once) is the
valid null here: runs of one seed share the SFT base, the prompts and the sampling seeds
across rungs, so their differences need not be independent. Only seeds that ran both
modes on every rung in R enter (a balanced design); dropped seeds are counted.

Naive equivalent::

    d = (acc_mode[R][:, S] - acc_ref[R][:, S]).mean(axis=0)   # (n_seeds,)
    estimate, p = d.mean(), sign_flip(d)

This answers "does the mode differ from the reference anywhere on this ladder, on
average over its rungs"; it says nothing about which rung, and a difference confined to
one rung is diluted by the others (the per-rung rows say where).
"""

from __future__ import annotations

from .significance import DEFAULT_N_BOOT


def pooled_vs_reference(rep: dict, *, n_boot: int = DEFAULT_N_BOOT, seed: int = 0) -> list[dict]:
    """Per mode other than the reference: the final-accuracy difference pooled over the
    rungs where both ran (module docstring). ``rep`` is the ladder report
    (:func:`pdmask_lab.ladder_report.build_report`); each row is a dict with ``mode``,
    ``rungs`` (names), ``seeds`` (used), ``seeds_dropped``, ``per_seed`` (d_s) and the
    :class:`~pdmask_lab.significance.PairedDifference` fields under ``diff``."""
    from .significance import paired_difference

    ref = rep["reference"]
    modes: list[str] = []
    for r in rep["rungs"]:
        modes += [m["mode"] for m in r["modes"] if m["mode"] not in modes and m["mode"] != ref]
    rows = []
    for mode in modes:
        acc: dict[str, tuple[dict, dict]] = {}  # rung -> (mode's seed -> acc, reference's seed -> acc)
        for r in rep["rungs"]:
            by = {m["mode"]: dict(zip(m["seeds"], m["eval_final"]["per_seed"])) for m in r["modes"]}
            if mode in by and ref in by:
                acc[r["name"]] = (by[mode], by[ref])
        if not acc:
            continue
        every = set.intersection(*(set(a) & set(b) for a, b in acc.values()))
        anywhere = set.union(*(set(a) | set(b) for a, b in acc.values()))
        seeds = sorted(every)
        row = {"mode": mode, "reference": ref, "rungs": list(acc), "seeds": seeds,
               "seeds_dropped": sorted(anywhere - every), "per_seed": [], "diff": None}
        if seeds:
            x = [sum(a[s] for a, _ in acc.values()) / len(acc) for s in seeds]
            y = [sum(b[s] for _, b in acc.values()) / len(acc) for s in seeds]
            row["per_seed"] = [xi - yi for xi, yi in zip(x, y)]
            row["diff"] = paired_difference(x, y, n_boot=n_boot, seed=seed).to_dict()
        rows.append(row)
    return rows


def pooled_rows(rep: dict) -> tuple[list[str], list[list[str]]]:
    """(headers, rows) of the pooled table for the markdown and the console."""
    from .significance import format_interval, format_p

    h = ["mode", "rungs", "seeds", "Δ final acc vs " + rep["reference"] + " (mean over rungs)",
         "seeds up / down", "p (sign-flip over seeds)"]
    out = []
    for row in rep.get("pooled", []):
        d = row["diff"]
        if d is None:
            out.append([row["mode"], str(len(row["rungs"])), "0", "-", "-", "-"])
            continue
        out.append([row["mode"], str(len(row["rungs"])), str(d["n"]),
                    format_interval(d["estimate"], d["lo"], d["hi"], spec=".3f", sign=True),
                    f"{d['wins']} / {d['losses']}", format_p(d["p"])])
    return h, out
