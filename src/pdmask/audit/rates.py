"""Classification counts, rates and bootstrap intervals (METHOD.md section 5).

Definitions (ours; the paper's exact definitions were not available):

- ``O``: response tokens with ``A != 0`` and ``D > delta`` (delta by the sign of A).
- realized change ``dD = D(mu, pi') - D(mu, pi)``, same divergence, same mu.
  *increase* iff ``dD > tie_tol``, *decrease* iff ``dD < -tie_tol``, else a tie.
- criterion c calls a token *outward* iff ``A c > 0``; ``kept_c`` = tokens of the set
  that c does not mask (not outward).
- unsafe-keep rate = ``|kept_c and increase| / |kept_c|``;
  corrective-update rate = ``|kept_c and decrease| / |kept_c|`` (the two sum to 1 minus
  the share of ties); sign accuracy = share of the set where ``sign(A c)`` equals the
  realized sign (``sign(0) = 0``, a tie); mask precision = ``|masked_c and increase| /
  |masked_c|``.
- disagreement set of a predictive criterion p: tokens of O where the ratio and p
  differ on "outward".

Across seeds a rate is the mean of the per-seed rates over the seeds where its
denominator is non-zero (each seed weighs the same, as a seed is the unit that is
resampled); the interval is a percentile bootstrap over seeds; the difference
"p minus ratio" is the mean of the paired per-seed differences with its own bootstrap
interval. The pooled rate (sum of numerators over sum of denominators) is reported too.
"""

from __future__ import annotations

import math

import torch

from .criteria import PREDICTIVE, RATIO, outward

COUNT_KEYS = ("n", "kept", "masked", "unsafe", "corrective", "ties_kept", "masked_increase", "sign_ok")
#: rate name -> (numerator count, denominator count)
RATES = {
    "unsafe_keep": ("unsafe", "kept"),
    "corrective": ("corrective", "kept"),
    "sign_accuracy": ("sign_ok", "n"),
    "mask_precision": ("masked_increase", "masked"),
    "kept_frac": ("kept", "n"),
}


def realized_sign(dD: torch.Tensor, tie_tol: float = 0.0) -> torch.Tensor:
    """+1 increase, -1 decrease, 0 tie (``|dD| <= tie_tol``), as int64."""
    return (dD > tie_tol).long() - (dD < -tie_tol).long()


def classify(dD: torch.Tensor, advantages: torch.Tensor, values: dict[str, torch.Tensor],
             token_set: torch.Tensor, *, tie_tol: float = 0.0) -> dict[str, dict[str, int]]:
    """Counts of one token set for every criterion in ``values`` (all tensors the same shape).

    Returns ``{criterion: {n, kept, masked, unsafe, corrective, ties_kept,
    masked_increase, sign_ok}}`` as Python ints (one host sync).
    """
    if dD.shape != advantages.shape or dD.shape != token_set.shape:
        raise ValueError(f"dD: shape {tuple(dD.shape)} must equal advantages {tuple(advantages.shape)}"
                         f" and token_set {tuple(token_set.shape)}")
    real = realized_sign(dD, tie_tol)
    inc, dec = real > 0, real < 0
    S = token_set.bool()
    rows = []
    for name, v in values.items():
        pred = torch.sign(advantages * v).long()
        out = pred > 0
        kept = S & ~out
        rows.append(torch.stack([
            S.sum(), kept.sum(), (S & out).sum(), (kept & inc).sum(), (kept & dec).sum(),
            (kept & (real == 0)).sum(), (S & out & inc).sum(), (S & (pred == real)).sum(),
        ]))
    table = torch.stack(rows).tolist() if rows else []
    return {name: dict(zip(COUNT_KEYS, map(int, row))) for name, row in zip(values, table)}


def disagreement_set(values: dict[str, torch.Tensor], advantages: torch.Tensor, region: torch.Tensor,
                     criterion: str) -> torch.Tensor:
    """Tokens of ``region`` where ``criterion`` and the ratio differ on "outward"."""
    return region & (outward(values[RATIO], advantages) != outward(values[criterion], advantages))


def classify_seed(dD: torch.Tensor, advantages: torch.Tensor, values: dict[str, torch.Tensor],
                  region: torch.Tensor, *, tie_tol: float = 0.0) -> dict[str, dict]:
    """Counts on O and on each predictive criterion's disagreement set with the ratio.

    Keys: ``"out_of_region"`` (every criterion) and ``"disagreement:<p>"`` (the ratio
    and p only) for every predictive criterion p present in ``values``.
    """
    res = {"out_of_region": classify(dD, advantages, values, region, tie_tol=tie_tol)}
    for p in PREDICTIVE:
        if p in values:
            dis = disagreement_set(values, advantages, region, p)
            res[f"disagreement:{p}"] = classify(dD, advantages, {RATIO: values[RATIO], p: values[p]}, dis,
                                                tie_tol=tie_tol)
    return res


def rate(counts: dict[str, int], name: str) -> float | None:
    """One rate from counts; None when its denominator is 0."""
    num, den = RATES[name]
    return counts[num] / counts[den] if counts[den] else None


def bootstrap_ci(values, *, n_boot: int = 10000, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values`` (resampling the values).

    Naive equivalent: ``np.percentile([mean(choice(v, len(v))) for _ in range(B)], [2.5, 97.5])``.
    Seeded, so the same values give the same interval. One value gives a zero-width interval.
    """
    v = torch.as_tensor(list(values), dtype=torch.float64)
    if v.numel() == 0:
        raise ValueError("values: need at least one value for a bootstrap interval")
    if not torch.isfinite(v).all():
        raise ValueError("values: contains NaN or inf")
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, v.numel(), (n_boot, v.numel()), generator=g)
    means = v[idx].mean(1)
    a = (1 - level) / 2
    lo, hi = torch.quantile(means, torch.tensor([a, 1 - a], dtype=torch.float64)).tolist()
    return lo, hi


def _stat(vals: list[float], n_boot: int, seed: int) -> dict:
    if not vals:
        return {"mean": None, "ci95": None, "n_seeds": 0}
    lo, hi = bootstrap_ci(vals, n_boot=n_boot, seed=seed)
    return {"mean": sum(vals) / len(vals), "ci95": [lo, hi], "n_seeds": len(vals)}


def summarize(per_seed: list[dict[str, dict[str, int]]], *, reference: str = RATIO, n_boot: int = 10000,
              seed: int = 0) -> dict:
    """Across-seed summary of one token set.

    Args:
        per_seed: one ``{criterion: counts}`` dict per seed (output of :func:`classify`).
        reference: the criterion the differences are taken against (the ratio).

    Returns ``{"criteria": {c: {rate: {mean, ci95, n_seeds, pooled}, "counts": totals}},
    "diff_vs_<reference>": {c: {rate: {mean, ci95, n_seeds}}}}``.
    """
    crits = list(per_seed[0]) if per_seed else []
    out: dict = {"criteria": {}, f"diff_vs_{reference}": {}}
    for c in crits:
        tot = {k: sum(s[c][k] for s in per_seed) for k in COUNT_KEYS}
        entry = {"counts": tot}
        for r in RATES:
            vals = [x for x in (rate(s[c], r) for s in per_seed) if x is not None]
            entry[r] = _stat(vals, n_boot, seed)
            entry[r]["pooled"] = rate(tot, r)
        out["criteria"][c] = entry
    if reference in crits:
        for c in crits:
            if c == reference:
                continue
            d = {}
            for r in RATES:
                diffs = []
                for s in per_seed:
                    a, b = rate(s[c], r), rate(s[reference], r)
                    if a is not None and b is not None:
                        diffs.append(a - b)
                d[r] = _stat(diffs, n_boot, seed)
            out[f"diff_vs_{reference}"][c] = d
    return out


def fmt_pct(x: float | None, digits: int = 1) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.{digits}f}%"
