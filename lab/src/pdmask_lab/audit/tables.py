"""Every rate table of the audit, computed from the per-token records alone.

The records (``audit_tokens.npz``, schema in docs/audit.md) hold one row per
out-of-region token: its seed, ``A``, ``D``, every criterion value ``c_<criterion>`` and
the realized (or predicted-exactly) change of every *step kind* (``dD_batch``,
``dD_logit``, ``ip``, ``pip``, ``own``, ...; NaN where that kind was not measured).
:func:`tables` turns them into the report's numbers, so a report can be recomputed from
the records with nothing else (tested).

Statistics (:mod:`pdmask_lab.significance`):

- a rate is **pooled** over tokens: sum of the numerators over sum of the
  denominators across seeds, with a seed-cluster percentile bootstrap interval (seeds
  are resampled, never tokens); the mean of the per-seed rates is kept as a secondary
  column;
- "predictive - ratio" is the difference of the two pooled rates with the paired
  cluster bootstrap (one resample of seeds for both);
- sign accuracy on a set: McNemar's exact test on the discordant tokens (only the
  predictive criterion right vs only the ratio right);
- on a disagreement set exactly one of the two criteria is right on every token whose
  value is not tied: the count of tokens where the predictive criterion is right and an
  exact two-sided binomial (sign) test against 1/2.

Every table carries ``n_tokens`` and ``n_seeds``.
"""

from __future__ import annotations

import numpy as np

from ..significance import DEFAULT_N_BOOT, binomial_test, mcnemar_exact, paired_ratio_difference, pooled_ratio
from .criteria import CRITERIA, PREDICTIVE, RATIO
from .rates import RATES

#: step kind -> (record column, per-token instrument?, title). "Per-token instruments"
#: are measured on a sample (a uniform sample of O plus the headline disagreement set):
#: their O-level table uses the uniform sample only.
KINDS = {
    "batch": ("dD_batch", False, "batch step (one optimizer step on the whole batch, as training does)"),
    "logit": ("dD_logit", False, "logit step (the token's own step on its position's logits alone)"),
    "param": ("ip", True, "step-free, parameter space: <grad D_t, grad A log pi_t>"),
    "param_head": ("ip_head", True, "step-free, output layer's role only"),
    "precond": ("pip", True, "step-free, AdamW-preconditioned: <grad D_t, P grad A log pi_t>"),
    "own": ("own", True, "own effect inside the batch: dD_t(batch) - dD_t(batch without t)"),
    "isolated": ("dD_isolated", True, "isolated parameter step (all parameters, fixed small length)"),
    "isolated_head": ("dD_isolated_head", True, "isolated parameter step (output embedding only)"),
}
#: kinds whose values are realized changes of D (``tie_tol`` applies; not to the logit
#: step, which is first order by construction, nor to the exact inner products)
TIE_KINDS = ("batch", "own", "isolated", "isolated_head")
#: the instrument's group terms (output layer share)
GROUP_COLUMNS = ("ip_head", "ip_embed", "ip_body", "ip_cross")


def _sign(x: np.ndarray, tol: float = 0.0) -> np.ndarray:
    return (x > tol).astype(np.int64) - (x < -tol).astype(np.int64)


def criterion_column(name: str) -> str:
    return f"c_{name}"


def disagreement(rec: dict, p: str) -> np.ndarray:
    """Tokens where the ratio and the predictive criterion p differ on "outward"."""
    A = rec["A"]
    return (A * rec[criterion_column(RATIO)] > 0) != (A * rec[criterion_column(p)] > 0)


def token_sets(rec: dict, kind: str, headline: str) -> dict[str, np.ndarray]:
    """The token sets of a step kind: ``out_of_region`` (all of O, or the uniform sample
    for a per-token instrument) and ``disagreement:<p>`` (for a per-token instrument only
    the headline's, the set it was measured on)."""
    col, per_token, _ = KINDS[kind]
    ok = np.isfinite(rec[col])
    sets = {"out_of_region": ok & rec["in_sample"] if per_token else ok}
    for p in PREDICTIVE:
        if criterion_column(p) in rec and (not per_token or p == headline):
            sets[f"disagreement:{p}"] = ok & disagreement(rec, p)
    return sets


def counts(rec: dict, value: np.ndarray, token_set: np.ndarray, criteria, seeds: np.ndarray,
           tie_tol: float = 0.0) -> dict[str, dict[str, np.ndarray]]:
    """Per-seed counts ``{criterion: {count key: (n_seeds,) int64}}`` of one set.

    ``seeds``: every audited seed (a seed without tokens is a cluster with zero counts)."""
    seed_ix = np.searchsorted(seeds, rec["seed"])
    real = _sign(np.nan_to_num(value), tie_tol)
    inc, dec = real > 0, real < 0
    S = token_set.astype(bool)
    out = {}
    for c in criteria:
        pred = _sign(rec["A"] * rec[criterion_column(c)])
        outw = pred > 0
        kept = S & ~outw
        parts = {"n": S, "kept": kept, "masked": S & outw, "unsafe": kept & inc, "corrective": kept & dec,
                 "ties_kept": kept & (real == 0), "masked_increase": S & outw & inc, "sign_ok": S & (pred == real)}
        out[c] = {k: np.bincount(seed_ix[m], minlength=seeds.size).astype(np.int64) for k, m in parts.items()}
    return out


def _discordant(rec, value, token_set, p, tie_tol):
    real = _sign(np.nan_to_num(value), tie_tol)
    right = {c: token_set & (_sign(rec["A"] * rec[criterion_column(c)]) == real) for c in (p, RATIO)}
    return int((right[p] & ~right[RATIO]).sum()), int((right[RATIO] & ~right[p]).sum())


def set_table(rec: dict, value: np.ndarray, token_set: np.ndarray, criteria, seeds: np.ndarray, *,
              tie_tol: float = 0.0, n_boot: int = DEFAULT_N_BOOT, boot_seed: int = 0, is_disagreement: bool = False) -> dict:
    """Pooled rates (with cluster bootstrap and the per-seed mean) of every criterion on
    one set, and each predictive criterion against the ratio (pooled difference with the
    paired bootstrap, McNemar; on a disagreement set the binomial sign test)."""
    cnt = counts(rec, value, token_set, criteria, seeds, tie_tol)
    n_tok = int(token_set.sum())
    n_seeds = int(np.unique(rec["seed"][token_set.astype(bool)]).size)
    out = {"n_tokens": n_tok, "n_seeds": n_seeds, "n_seeds_audited": int(seeds.size), "criteria": {},
           f"vs_{RATIO}": {}}
    for c in criteria:
        e = {"counts": {k: int(v.sum()) for k, v in cnt[c].items()}}
        for r, (num, den) in RATES.items():
            e[r] = pooled_ratio(cnt[c][num], cnt[c][den], n_boot=n_boot, seed=boot_seed).to_dict()
        out["criteria"][c] = e
    if RATIO in criteria:
        for p in criteria:
            if p == RATIO:
                continue
            d = {}
            for r, (num, den) in RATES.items():
                d[r] = paired_ratio_difference(cnt[p][num], cnt[p][den], cnt[RATIO][num], cnt[RATIO][den],
                                               n_boot=n_boot, seed=boot_seed).to_dict()
            b, c_ = _discordant(rec, value, token_set.astype(bool), p, tie_tol)
            d["mcnemar"] = {"only_predictive_right": b, "only_ratio_right": c_, "p": mcnemar_exact(b, c_)}
            if is_disagreement:
                k = int(cnt[p]["sign_ok"].sum())
                n = k + int(cnt[RATIO]["sign_ok"].sum())
                d["sign_test"] = {"predictive_right": k, "ratio_right": n - k, "n_untied": n,
                                  "n_tied": n_tok - n, "p": binomial_test(k, n)}
            out[f"vs_{RATIO}"][p] = d
    return out


def group_shares(rec: dict, token_set: np.ndarray) -> dict:
    """Pooled share of each group in the first-order change: ``sum |s_group| / sum_groups
    sum |s_group|`` over the set, plus the share of tokens where the output layer's term
    alone has the sign of the total."""
    if "ip_head" not in rec:
        return {}
    S = token_set & np.isfinite(rec["ip"])
    mags = {g: float(np.abs(rec[g][S]).sum()) for g in GROUP_COLUMNS}
    tot = sum(mags.values())
    same = np.sign(rec["ip_head"][S]) == np.sign(rec["ip"][S])
    return {"n_tokens": int(S.sum()), **{f"share_{g[3:]}": (mags[g] / tot if tot > 0 else None) for g in GROUP_COLUMNS},
            "head_sign_equals_total": float(same.mean()) if S.any() else None}


def tables(rec: dict, seeds, *, headline: str = "pred-exact", tie_tol: float = 0.0, n_boot: int = DEFAULT_N_BOOT,
           boot_seed: int = 0) -> dict:
    """Every rate table from the records: ``{kind: {set: set_table}}`` for the kinds whose
    column is present and measured on at least one token, plus ``group_shares``.

    Args:
        rec: the per-token records (numpy arrays, one row per out-of-region token).
        seeds: every audited seed (clusters; a seed with no token counts as one).
        headline: the predictive criterion the instruments' disagreement sets are taken for.
    """
    seeds = np.unique(np.asarray(seeds, dtype=np.int64))
    crit = [c for c in CRITERIA if criterion_column(c) in rec]
    out: dict = {}
    for kind, (col, _, _) in KINDS.items():
        if col not in rec or not np.isfinite(rec[col]).any():
            continue
        kt = {}
        for sname, S in token_sets(rec, kind, headline).items():
            cs = crit if sname == "out_of_region" else [RATIO, sname.split(":", 1)[1]]
            kt[sname] = set_table(rec, rec[col], S, cs, seeds, tie_tol=tie_tol if kind in TIE_KINDS else 0.0,
                                  n_boot=n_boot, boot_seed=boot_seed, is_disagreement=sname != "out_of_region")
        out[kind] = kt
    shares = {}
    if "ip" in rec and np.isfinite(rec["ip"]).any():
        shares = {"out_of_region": group_shares(rec, rec["in_sample"]),
                  f"disagreement:{headline}": group_shares(rec, disagreement(rec, headline))}
    return {"rates": out, "group_shares": shares}


def restrict(rec: dict, keep: np.ndarray) -> dict:
    """The records of the tokens where ``keep`` is True."""
    return {k: v[keep] for k, v in rec.items()}


def delta_sweep(rec: dict, seeds, deltas, *, headline: str = "pred-exact", tie_tol: float = 0.0,
                n_boot: int = 2_000, boot_seed: int = 0) -> dict:
    """The headline tables at larger thresholds, from the records of one audit.

    For ``delta' >= `` the audited delta, ``O(delta') = {t in O : D_t > delta'}`` is a
    subset of the audited O, so restricting the records gives exactly the batch and
    logit tables an audit at ``delta'`` would compute (the batch step does not depend on
    delta when its own mode is ``none``), and the instruments' tables on a uniform sample
    of ``O(delta')`` and on all of its (measured) disagreement tokens. A ``delta'`` below
    the audited one is refused: its tokens were never recorded.

    Returns ``{delta': {"n_out_of_region", "n_disagreement", "rates": {kind: {set: table}}}}``
    with the ratio and the headline criterion only."""
    seeds = np.unique(np.asarray(seeds, dtype=np.int64))
    lowest = float(np.min(rec["delta"])) if rec["delta"].size else 0.0
    out = {}
    for d in deltas:
        if rec["delta"].size and d < lowest - 1e-15:
            raise ValueError(f"delta_sweep: {d} is below the audited delta {lowest}; its tokens were not recorded")
        sub = restrict(rec, rec["D"] > d)
        rates = {}
        for kind, (col, _, _) in KINDS.items():
            if col not in sub or not np.isfinite(sub[col]).any():
                continue
            rates[kind] = {}
            for sname, S in token_sets(sub, kind, headline).items():
                if sname not in ("out_of_region", f"disagreement:{headline}"):
                    continue
                rates[kind][sname] = set_table(sub, sub[col], S, [RATIO, headline], seeds,
                                               tie_tol=tie_tol if kind in TIE_KINDS else 0.0, n_boot=n_boot,
                                               boot_seed=boot_seed, is_disagreement=sname != "out_of_region")
        out[float(d)] = {"n_out_of_region": int(sub["A"].size), "n_disagreement": int(disagreement(sub, headline).sum()),
                         "rates": rates}
    return out
