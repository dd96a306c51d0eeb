"""The report of the batch-mask evaluation by Phi (:mod:`pdmask_lab.audit.phi`): the pooled
sign accuracies against leave-one-out, the matched-fraction dPhi with paired per-seed
tests, each criterion's own mask, and the page ``phi.md``."""

from __future__ import annotations


# ------------------------------------------------------------------ across seeds
def sign_counts(rec: dict, criterion: str, in_O: bool) -> tuple[int, int, int]:
    """``(correct, n, ties)`` of one seed: tokens of the LOO sample in O (or outside) with
    ``score * LOO > 0``, tokens with ``LOO != 0``, tokens with ``LOO == 0``."""
    lo = rec.get("loo") or {}
    if not lo:
        return 0, 0, 0
    k = n = ties = 0
    for s, l, o in zip(lo["scores"][criterion], lo["loo"], lo["in_O"]):
        if o != in_O:
            continue
        if l == 0:
            ties += 1
            continue
        n += 1
        k += s * l > 0
    return k, n, ties


def summarize(records: list[dict], settings) -> dict:
    """Pooled sign accuracies (cluster bootstrap, exact binomial vs 1/2, McNemar between
    criteria) and the matched-fraction dPhi per criterion (pooled per token of O, paired
    per-seed differences with sign-flip tests). ``settings``: the run's
    :class:`pdmask_lab.audit.phi.PhiSettings`."""
    from .. import significance as sig

    nb, bs = settings.bootstrap, settings.bootstrap_seed
    recs = [r for r in records if r["n_out_of_region"] > 0]
    out: dict = {"n_seeds": len(records), "n_seeds_with_O": len(recs),
                 "n_out_of_region": sum(r["n_out_of_region"] for r in records),
                 "n_tokens": sum(r["n_tokens"] for r in records)}
    crit = [c for c in settings.criteria if c != "random"]
    if not recs:
        return out | {"note": "no seed had an out-of-region token: nothing to judge"}
    signs = {}
    for where, in_O in (("O", True), ("outside", False)):
        block = {}
        for c in crit:
            cnt = [sign_counts(r, c, in_O) for r in recs]
            k, n, ties = (sum(x[i] for x in cnt) for i in range(3))
            if n == 0:
                continue
            pr = sig.pooled_ratio([x[0] for x in cnt], [x[1] for x in cnt], n_boot=nb, seed=bs)
            block[c] = {**pr.to_dict(), "correct": k, "n": n, "ties": ties,
                        "p_binomial_half": sig.binomial_test(k, n, 0.5)}
        for c in crit:
            if c == "pdm-batch" or c not in block or "pdm-batch" not in block:
                continue
            b = cc = 0  # discordant: only pdm-batch right / only c right
            for r in recs:
                lo = r["loo"]
                for sb, so, l, o in zip(lo["scores"]["pdm-batch"], lo["scores"][c], lo["loo"], lo["in_O"]):
                    if o != in_O or l == 0:
                        continue
                    rb_, rc_ = sb * l > 0, so * l > 0
                    b += rb_ and not rc_
                    cc += rc_ and not rb_
            block[f"pdm-batch vs {c}"] = {"only_batch_right": b, "only_other_right": cc,
                                          "p_mcnemar": sig.mcnemar_exact(b, cc)}
        signs[where] = block
    out["sign_accuracy"] = signs
    # first-order calibration: LOO / (a c) on the O sample
    q = [l / p for r in recs for l, p, o in zip(r["loo"]["loo"], r["loo"]["pred"], r["loo"]["in_O"])
         if o and p != 0] if recs else []
    if q:
        qs = sorted(q)
        out["loo_over_first_order"] = {"median": qs[len(qs) // 2], "q25": qs[len(qs) // 4],
                                       "q75": qs[(3 * len(qs)) // 4], "n": len(qs)}
    sweep = {}
    for f in settings.fractions:
        key = f"{f:g}"
        rows = [r for r in recs if key in r["sweep"]]
        nO = [r["n_out_of_region"] for r in rows]
        block = {"m_total": sum(r["sweep"][key]["m"] for r in rows), "n_out_of_region": sum(nO)}
        for c in ["none"] + list(settings.criteria):
            vals = [(r["phi_full"] - r["phi0"]) if c == "none" else r["sweep"][key][c] for r in rows]
            block[c] = sig.pooled_ratio(vals, nO, n_boot=nb, seed=bs).to_dict()
        # pdm-batch against every other criterion, and the per-token predictive direction against
        # the ratio (the comparison the paper's mask makes without the batch)
        pairs = [("pdm-batch", c) for c in settings.criteria if c != "pdm-batch"] + [("pdm-exact", "ratio")]
        for a, c in pairs:
            x = [r["sweep"][key][a] / r["n_out_of_region"] for r in rows]
            y = [r["sweep"][key][c] / r["n_out_of_region"] for r in rows]
            block[f"{a} - {c}"] = sig.paired_difference(x, y, n_boot=nb, seed=bs).to_dict()
        sweep[key] = block
    out["matched_fraction"] = sweep
    own = {}
    for c in crit:
        nO = [r["n_out_of_region"] for r in recs]
        own[c] = {"masked": sum(r["own_mask"][c]["m"] for r in recs),
                  "dphi_per_O_token": sig.pooled_ratio([r["own_mask"][c]["dphi"] for r in recs], nO,
                                                       n_boot=nb, seed=bs).to_dict()}
    out["own_mask"] = own
    return out


# ------------------------------------------------------------------ report
def _fmt(pr: dict, spec: str = ".2e") -> str:
    from ..significance import format_interval
    return format_interval(pr["estimate"], pr["lo"], pr["hi"], spec=spec)


def markdown(doc: dict) -> str:
    """The report page (``phi.md``)."""
    from ..significance import format_p

    s, st = doc["summary"], doc["settings"]
    delta = (st["thresholds"] if "thresholds" in st else st)["delta_high"]  # flat in phi.json before 2026-12-02
    lines = ["# Batch-aware mask: the audit of Phi", "",
             f"Command: `{doc['run'].get('command', '')}`", "",
             f"{s['n_seeds']} seeds ({s['n_seeds_with_O']} with out-of-region tokens), {s['n_tokens']:,} response "
             f"tokens, {s['n_out_of_region']:,} out of region ({st['divergence']} > {delta:g}). "
             f"Source: {doc['run'].get('kind', '')} {doc['run'].get('run_dir', doc['run'].get('checkpoint', ''))}; "
             f"optimizer state: {doc['run'].get('optimizer_state', '')}.", ""]
    env = doc["run"].get("environment")
    if env:
        from pdmask.train.environment import one_line

        lines += [one_line(env), ""]
    times = sorted(r["time_s"] for r in doc.get("records", []) if r.get("time_s") is not None)
    if times:
        lines += [f"Wall time: {sum(times) / 60:.1f} min over the {len(times)} seeds computed by this run's "
                  f"invocations (median {times[len(times) // 2]:.0f} s per seed), the source's lag steps not "
                  "included.", ""]
    if "note" in s:
        return "\n".join(lines + [s["note"]]) + "\n"
    if not any(s["sign_accuracy"].values()):
        lines += ["Leave-one-out not measured (no token sampled: --loo-tokens 0 --loo-outside 0); "
                  "the matched-fraction and own-mask tables below are the measure.", ""]
    else:
        lines += ["## Sign accuracy against the leave-one-out effect on Phi", "",
                  "`score_t * LOO_t > 0`, LOO_t = Phi(step) - Phi(step without t); pooled over tokens, 95% seed-cluster "
                  "bootstrap interval, exact binomial test against 1/2; McNemar against pdm-batch on the same tokens.",
                  ""]
        for where, title in (("O", "tokens of O (uniform sample)"), ("outside", "active tokens outside O")):
            block = s["sign_accuracy"].get(where, {})
            if not block:
                continue
            lines += [f"**{title}**", "", "| criterion | accuracy [95% CI] | correct / n (ties) | p vs 1/2 | "
                      "McNemar vs pdm-batch |", "|---|---|---|---|---|"]
            for c, v in block.items():
                if " vs " in c:
                    continue
                mc = block.get(f"pdm-batch vs {c}")
                mcs = (f"{mc['only_batch_right']} / {mc['only_other_right']}, {format_p(mc['p_mcnemar'])}" if mc else "")
                lines.append(f"| {c} | {_fmt(v, '.3f')} | {v['correct']} / {v['n']} ({v['ties']}) | "
                             f"{format_p(v['p_binomial_half'])} | {mcs} |")
            lines.append("")
    if "loo_over_first_order" in s:
        q = s["loo_over_first_order"]
        lines += [f"LOO / (a_t c_t) on O: median {q['median']:.3g} (quartiles {q['q25']:.3g}, {q['q75']:.3g}; "
                  f"n = {q['n']}); 1 would be the first-order prediction exactly.", ""]
    lines += ["## Realized change of Phi at matched masked fraction", "",
              "dPhi = Phi(step without the masked set) - Phi(theta), per token of O, pooled (sum dPhi / sum |O|) "
              "with 95% seed-cluster bootstrap intervals; the top-m tokens of O by each criterion are masked. "
              "Lower is better (the drifted tokens drift less).", ""]
    crits = ["none"] + list(st["criteria"])
    lines += ["| f (m masked) | " + " | ".join(crits) + " |", "|---" * (len(crits) + 1) + "|"]
    for f, b in s["matched_fraction"].items():
        lines.append(f"| {f} ({b['m_total']}) | " + " | ".join(_fmt(b[c]) for c in crits) + " |")
    lines += ["", "Paired per-seed differences A - B of dPhi per O token (mean [95% CI], two-sided sign-flip p, "
              "seeds where A is lower; p not corrected for the number of pairs):", ""]
    for f, b in s["matched_fraction"].items():
        parts = [f"{k}: {_fmt(v)}, {format_p(v['p'])}, {v['losses']}/{v['n']}"
                 for k, v in b.items() if " - " in k]
        lines.append(f"- f = {f}: " + "; ".join(parts))
    lines += ["", "## Each criterion's own mask (every token of O it calls outward)", "",
              "| criterion | masked tokens | dPhi per O token |", "|---|---|---|"]
    for c, v in s["own_mask"].items():
        lines.append(f"| {c} | {v['masked']} | {_fmt(v['dphi_per_O_token'])} |")
    lines.append(f"| none | 0 | {_fmt(next(iter(s['matched_fraction'].values()))['none'])} |")
    return "\n".join(lines) + "\n"
