"""Writing the audit: ``audit.json`` (every number and setting), ``audit.md`` (tables,
the paper's figures side by side, our definitions), ``audit_tokens.npz`` (per-token
raw values of the out-of-region tokens) and the PNG plots (:mod:`.plots`)."""

from __future__ import annotations

import json
import math
import platform
from pathlib import Path

import torch

from .config import AuditConfig
from .criteria import CRITERIA, PREDICTIVE, RATIO, predictive_name
from .paper import PAPER
from .rates import fmt_pct

#: run settings kept out of the markdown settings table (they are in audit.json)
_LONG_RUN_KEYS = ("command", "trainer_config", "sft", "lag_steps")

DEFINITIONS = """\
- **O (out-of-region set)**: response tokens with `A != 0` and `D > delta` (`delta_high` if A > 0, `delta_low` if A < 0), D the proximity divergence at theta.
- **realized change** `dD = D(mu, pi_theta') - D(mu, pi_theta)`: the same divergence, the same rollout view of mu, after the step theta -> theta'. *Increase* iff `dD > tie_tol`, *decrease* iff `dD < -tie_tol`, otherwise a tie.
- a criterion c calls a token's update **outward** iff `A * c > 0` (ratio: `c = log r`; predictive: `c = Ddot`). **kept_c** = tokens of the set that c does not mask (not outward).
- **unsafe-keep rate** = |kept_c with dD > 0| / |kept_c|; **corrective-update rate** = |kept_c with dD < 0| / |kept_c| (they add up to 1 minus the share of ties).
- **sign accuracy** = share of the set where `sign(A c) = sign(dD)`; **mask precision** = |masked_c with dD > 0| / |masked_c|.
- **disagreement set** of a predictive criterion p: tokens of O where the ratio and p differ on "outward".
- **across seeds**: the mean of the per-seed rates over seeds with a non-zero denominator; 95% percentile bootstrap interval over seeds (seeded); *p - ratio* is the mean of the paired per-seed differences with its own interval; *pooled* = sum of numerators / sum of denominators.
- **steps**: *batch* = one optimizer step of the configured loss on the whole batch (a fresh optimizer unless the settings name a state: a run's AdamW state or the lag steps'; weights restored after each seed); *isolated* = for a seeded uniform sample of O (and, separately, of the disagreement set) a parameter step of fixed length along the gradient of that token's loss `-w A log pi_k` alone (all parameters, or only the output embedding: *isolated_head*), weights restored after each token; *logit* = the step `z -> z + eta sign(A) (e_k - pi)/|e_k - pi|` on the position's logits alone (the literal first-order claim).
- The paper's exact rate definitions were not available to us; the definitions above are ours.
"""


def _cell(st: dict | None, pct: bool = True, signed: bool = False) -> str:
    if not st or st.get("mean") is None:
        return "n/a"
    if pct:
        f = (lambda x: f"{100 * x:+.1f}") if signed else (lambda x: f"{100 * x:.1f}")
        lo, hi = st["ci95"]
        return f"{f(st['mean'])}{' pp' if signed else '%'} [{f(lo)}, {f(hi)}]"
    lo, hi = st["ci95"]
    return f"{st['mean']:.3g} [{lo:.3g}, {hi:.3g}]"


def _paper(c: str, headline: str, rate: str) -> str:
    if rate not in ("unsafe_keep", "corrective"):
        return ""
    if c == RATIO:
        return fmt_pct(PAPER[rate]["ratio"])
    if c == headline:
        return fmt_pct(PAPER[rate]["predictive"])
    return ""


def rate_table(summary: dict, criteria, headline: str, *, paper: bool = True) -> list[str]:
    crit = summary["criteria"]
    head = "| criterion | kept / set | unsafe-keep | corrective | sign accuracy | mask precision |"
    sep = "|---|---|---|---|---|---|"
    if paper:
        head += " paper unsafe-keep | paper corrective |"
        sep += "---|---|"
    lines = [head, sep]
    for c in criteria:
        if c not in crit:
            continue
        e = crit[c]
        n = e["counts"]
        row = (f"| {c}{' (headline)' if c == headline else ''} | {n['kept']} / {n['n']} | {_cell(e['unsafe_keep'])} | "
               f"{_cell(e['corrective'])} | {_cell(e['sign_accuracy'])} | {_cell(e['mask_precision'])} |")
        if paper:
            row += f" {_paper(c, headline, 'unsafe_keep')} | {_paper(c, headline, 'corrective')} |"
        lines.append(row)
    return lines


def diff_table(summary: dict, criteria) -> list[str]:
    d = summary.get(f"diff_vs_{RATIO}", {})
    lines = ["| predictive - ratio | unsafe-keep | corrective | sign accuracy | seeds |", "|---|---|---|---|---|"]
    for c in criteria:
        if c in d:
            e = d[c]
            lines.append(f"| {c} | {_cell(e['unsafe_keep'], signed=True)} | {_cell(e['corrective'], signed=True)} | "
                         f"{_cell(e['sign_accuracy'], signed=True)} | {e['unsafe_keep']['n_seeds']} |")
    return lines


def markdown(doc: dict) -> str:
    cfg = doc["settings"]["audit"]
    run = doc["settings"].get("run", {})
    S = doc["summary"]
    headline = predictive_name(cfg["estimator"])
    seeds = S["per_seed"]
    L = ["# Direction audit", ""]
    if run.get("command"):
        L += ["Command:", "", "```", run["command"], "```", ""]
    L += [f"{len(seeds)} seeds; divergence `{cfg['divergence']}`, delta_low {cfg['delta_low']}, delta_high "
          f"{cfg['delta_high']}; batch step: mode `{cfg['step_mode']}`, {cfg['optimizer']} lr {cfg['lr']}, "
          f"loss_agg {cfg['loss_agg']}, is_cap {cfg['is_cap']}; headline predictive criterion `{headline}`. "
          f"All settings are in `audit.json`.", ""]
    if run:
        L += ["| setting | value |", "|---|---|"] + [f"| {k} | `{v}` |" for k, v in run.items()
                                                    if k not in _LONG_RUN_KEYS]
        L += [""]
    L += ["## Summary (batch step, out-of-region tokens)", ""] + headline_table(doc) + [""]
    L += ["## Definitions (ours)", "", DEFINITIONS, ""]

    mean = lambda key: sum(s[key] for s in seeds) / len(seeds)  # noqa: E731
    dis = [s["n_disagreement"][headline] for s in seeds]
    L += ["## Counts", "",
          "| | ours (mean per seed) | paper (per seed) |", "|---|---|---|",
          f"| seeds | {len(seeds)} | {PAPER['seeds']} |",
          f"| sequences per rollout batch | {mean('n_sequences'):.0f} | {PAPER['sequences_per_rollout']} |",
          f"| response tokens | {mean('n_response_tokens'):.1f} | n/a |",
          f"| out-of-region tokens O | {mean('n_out_of_region'):.1f} | ~{PAPER['out_of_region_per_seed']} |",
          f"| disagreement tokens ({headline} vs ratio) | {sum(dis) / len(dis):.1f} | ~{PAPER['disagreement_per_seed']} |",
          ""]

    rates = S["rates"]
    L += ["## Batch step, out-of-region tokens", ""]
    L += rate_table(rates["batch"]["out_of_region"], CRITERIA, headline) + [""]
    L += diff_table(rates["batch"]["out_of_region"], PREDICTIVE) + [""]
    L += ["## Batch step, disagreement sets", "",
          "Each predictive criterion against the ratio, on the tokens of O where the two differ "
          "(there, what one keeps the other masks).", ""]
    for p in PREDICTIVE:
        key = f"disagreement:{p}"
        if key in rates["batch"]:
            L += [f"**{p}** (total {rates['batch'][key]['criteria'][RATIO]['counts']['n']} tokens)", ""]
            L += rate_table(rates["batch"][key], (RATIO, p), headline, paper=False)
            L += [""] + diff_table(rates["batch"][key], (p,)) + [""]
    key = f"disagreement:{headline}"
    for which in cfg.get("isolated_params", ["all"]):
        kind = "isolated" if which == "all" else f"isolated_{which}"
        if kind not in rates:
            continue
        what = "all parameters" if which == "all" else "the output embedding only"
        L += [f"## Isolated step ({what}), uniform sample of O", "",
              f"Step length {cfg['isolated_step']} in parameter space along the token's own loss gradient, "
              f"{cfg['isolated_dtype']}; up to {cfg['isolated_tokens']} tokens per seed.", ""]
        L += rate_table(rates[kind]["out_of_region"], CRITERIA, headline, paper=False) + [""]
        L += diff_table(rates[kind]["out_of_region"], PREDICTIVE) + [""]
        iso_d = rates[f"{kind}_disagreement"][key]
        L += [f"## Isolated step ({what}) on disagreement tokens ({headline} vs ratio)", "",
              f"Up to {cfg['isolated_disagreement']} disagreement tokens per seed "
              f"(total {iso_d['criteria'][RATIO]['counts']['n']}).", ""]
        L += rate_table(iso_d, (RATIO, headline), headline, paper=False) + [""]
        L += diff_table(iso_d, (headline,)) + [""]
    L += ["## Logit-space step on every token of O (the literal first-order claim)", "",
          f"Step length {cfg['logit_step']} along `sign(A)(e_k - pi)`, float64. The exact-top-K (for a top-K "
          "divergence) or full (for a full divergence) predictive criterion is the exact derivative here, so its "
          "sign accuracy checks the implementation.", ""]
    L += rate_table(rates["logit"]["out_of_region"], CRITERIA, headline, paper=False) + [""]

    L += fidelity_md(S["fidelity"], cfg) + entropy_md(S["entropy"])
    L += ["## Plots", "", "![rates](rates.png)", "", "![fidelity](fidelity.png)", "", "![scatter](scatter.png)", ""]
    L += ["## Per seed", "", "| seed | tokens | active (A != 0) | O | disagreement | isolated (uniform / dis.) | "
          "reward | loss | mean D |", "|---|---|---|---|---|---|---|---|---|"]
    for s in seeds:
        rew = f"{s['reward_mean']:.3f}" if "reward_mean" in s else "n/a"
        L.append(f"| {s['seed']} | {s['n_response_tokens']} | {s['n_active_tokens']} | {s['n_out_of_region']} | "
                 f"{s['n_disagreement'][headline]} | {s['n_isolated_uniform']} / {s['n_isolated_disagreement']} | "
                 f"{rew} | {s['loss']:.4g} | {s['divergence_mean']:.4g} |")
    return "\n".join(L) + "\n"


def headline_table(doc: dict) -> list[str]:
    """The paper's figures next to ours: the table for a README."""
    cfg = doc["settings"]["audit"]
    S = doc["summary"]
    headline = predictive_name(cfg["estimator"])
    seeds = S["per_seed"]
    o = S["rates"]["batch"]["out_of_region"]
    crit, diff = o["criteria"], o[f"diff_vs_{RATIO}"].get(headline, {})
    iso = S["rates"].get("isolated", {}).get("out_of_region")
    n = len(seeds)
    rows = [
        ("seeds", str(n), str(PAPER["seeds"])),
        ("out-of-region tokens per seed", f"{sum(s['n_out_of_region'] for s in seeds) / n:.1f}",
         f"~{PAPER['out_of_region_per_seed']}"),
        (f"disagreement tokens per seed ({headline} vs ratio)",
         f"{sum(s['n_disagreement'][headline] for s in seeds) / n:.1f}", f"~{PAPER['disagreement_per_seed']}"),
        (f"unsafe-keep, {headline}", _cell(crit[headline]["unsafe_keep"]), fmt_pct(PAPER["unsafe_keep"]["predictive"])),
        ("unsafe-keep, ratio", _cell(crit[RATIO]["unsafe_keep"]), fmt_pct(PAPER["unsafe_keep"]["ratio"])),
        ("unsafe-keep, predictive - ratio", _cell(diff.get("unsafe_keep"), signed=True),
         f"{100 * (PAPER['unsafe_keep']['predictive'] - PAPER['unsafe_keep']['ratio']):+.1f} pp"),
        (f"corrective, {headline}", _cell(crit[headline]["corrective"]), fmt_pct(PAPER["corrective"]["predictive"])),
        ("corrective, ratio", _cell(crit[RATIO]["corrective"]), fmt_pct(PAPER["corrective"]["ratio"])),
        (f"sign accuracy, {headline} / ratio",
         f"{_cell(crit[headline]['sign_accuracy'])} / {_cell(crit[RATIO]['sign_accuracy'])}", "n/a"),
    ]
    if iso:
        rows.append((f"isolated step sign accuracy, {headline} / ratio",
                     f"{_cell(iso['criteria'][headline]['sign_accuracy'])} / {_cell(iso['criteria'][RATIO]['sign_accuracy'])}",
                     "n/a"))
    F = S["fidelity"].get("response", {})
    k20 = next((k for k in sorted(F.get("kl_share", {}), key=int) if int(k) >= 20), None)
    if k20 is not None:
        rows.append((f"top-{k20} share of the full KL", _pooled(F["kl_share"][k20]), PAPER["top20_kl_share"]))
        rows.append((f"aggregated = uniform sign (top-{k20}, response tokens)", _cell(F["agg_vs_uniform"][k20]),
                     "nearly identical"))
    return ["| | ours (mean [95% CI]) | paper |", "|---|---|---|"] + [f"| {a} | {b} | {c} |" for a, b, c in rows]


def fidelity_md(F: dict, cfg: dict) -> list[str]:
    from ..directions import ESTIMATORS
    L = ["## Estimator fidelity", "",
         f"Sign agreement of `Ddot_topK` with the full-vocabulary `Ddot` ({cfg['divergence'].split('_')[1].upper()} "
         "family), the top-K view being the first K entries of the engine's top-K; share of the full KL (TV) that "
         "the top-K KL (TV) captures. Paper: top-20 captures > 99% of the KL; the two paper estimators "
         "(aggregated, uniform) nearly identical.", ""]
    for name in ("out_of_region", "response"):
        if name not in F:
            continue
        e = F[name]
        L += [f"**{'out-of-region tokens' if name == 'out_of_region' else 'all response tokens with A != 0'}**", "",
              "| K | " + " | ".join(ESTIMATORS) + " | aggregated = uniform | KL share | TV share |",
              "|---|" + "---|" * (len(ESTIMATORS) + 3)]
        for k in sorted(e["sign_agreement"], key=int):
            sa = e["sign_agreement"][k]
            L.append(f"| {k} | " + " | ".join(_cell(sa[x]) for x in ESTIMATORS)
                     + f" | {_cell(e['agg_vs_uniform'][k])} | {_pooled(e['kl_share'][k])} | {_pooled(e['tv_share'][k])} |")
        L += [""]
    L += ["Shares are pooled (sum of top-K / sum of full over the set, all seeds).", ""]
    return L


def _pooled(st: dict) -> str:
    return "n/a" if st.get("pooled") is None else f"{100 * st['pooled']:.2f}%"


def entropy_md(E: dict) -> list[str]:
    L = ["## Entropy side-effect", "",
         "First-order entropy change of a token's own update, `A * Hdot` with `Hdot = grad_z H . (e_k - pi)` "
         "(per unit logit step; > 0 raises the entropy). *kept*: active tokens the criterion keeps; *masked*: "
         "tokens it masks; *drift*: `sum_kept A Hdot / n_active` per seed (what the masked step does to the "
         "entropy, to first order, with token-mean weights).", "",
         "| criterion | kept: mean A Hdot | kept: share > 0 | masked: mean A Hdot | masked: share > 0 | masked tokens | drift |",
         "|---|---|---|---|---|---|---|"]
    for c, e in E.items():
        sh = lambda x: "n/a" if x is None else f"{100 * x:.1f}%"  # noqa: E731
        L.append(f"| {c} | {_cell(e['kept'], pct=False)} | {sh(e['kept']['share_increasing'])} | "
                 f"{_cell(e['masked'], pct=False)} | {sh(e['masked']['share_increasing'])} | {e['masked']['n_tokens']} | "
                 f"{_cell(e['drift_per_token'], pct=False)} |")
    return L + [""]


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, torch.Tensor):
        return _jsonable(x.tolist())
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


def write_report(outdir, results, summary: dict, cfg: AuditConfig, *, run_settings: dict | None = None,
                 plots: bool = True, runtime_s: float | None = None) -> dict:
    """Write audit.json, audit.md, audit_tokens.npz and the plots into ``outdir``; return the JSON doc."""
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "settings": {"audit": cfg.to_dict(), "run": dict(run_settings or {})},
        "definitions": DEFINITIONS,
        "paper": PAPER,
        "summary": summary,
        "per_seed_counts": [{"seed": r.seed, "counts": r.counts, "entropy": r.entropy, "fidelity": r.fidelity}
                            for r in results],
        "environment": {"torch": torch.__version__, "python": platform.python_version()},
        "runtime_s": runtime_s,
    }
    doc = _jsonable(doc)
    (out / "audit.json").write_text(json.dumps(doc, indent=1))
    (out / "audit.md").write_text(markdown(doc))
    _dump_tokens(out / "audit_tokens.npz", results)
    if plots:
        from .plots import plot_all
        plot_all(out, doc, results)
    return doc


def _dump_tokens(path: Path, results) -> None:
    """Per-token arrays of O over all seeds (``seed`` column added). ``dD_isolated*`` is NaN
    for tokens that were not sampled for the isolated step."""
    import numpy as np
    if not results:
        return
    keys = list(results[0].tokens)
    arrays = {k: np.concatenate([r.tokens[k].numpy() for r in results]) for k in keys}
    arrays["seed"] = np.concatenate([np.full(r.tokens["b"].shape[0], r.seed) for r in results])
    np.savez_compressed(path, **{k.replace(":", "_"): v for k, v in arrays.items()})
