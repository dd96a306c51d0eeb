"""Writing the audit: ``audit.json`` (every number and setting), ``audit.md`` (tables,
the paper's figures side by side, our definitions), ``audit_tokens.npz`` (the per-token
records every rate table is computed from) and the PNG plots (:mod:`.plots`).

:func:`report_from_records` recomputes the rate tables from an ``audit_tokens.npz``
alone (the report's numbers must be reproducible from the records; tested)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from ..significance import format_p
from pdmask.train.environment import environment, one_line
from .config import AuditConfig
from .criteria import CRITERIA, PREDICTIVE, RATIO, predictive_name
from .paper import PAPER
from .tables import KINDS

#: run settings kept out of the markdown settings table (they are in audit.json)
_LONG_RUN_KEYS = ("command", "trainer_config", "sft", "lag_steps")
#: schema version of audit_tokens.npz (docs/audit.md)
RECORDS_VERSION = 2

DEFINITIONS = """\
- **O (out-of-region set)**: response tokens with `A != 0` and `D > delta` (`delta_high` if A > 0, `delta_low` if A < 0), D the proximity divergence at theta.
- a criterion c calls a token's update **outward** iff `A * c > 0` (ratio: `c = log r`; predictive: `c = Ddot`). **kept_c** = tokens of the set that c does not mask (not outward).
- **step kinds** (what "the token's divergence change" is measured by; each gives a signed value per token, its *sign* is what a criterion predicts):
  - *batch*: `dD = D(theta') - D(theta)` after one optimizer step of the configured loss on the whole batch (the trainer's step; a fresh optimizer unless the settings name a state);
  - *logit*: `dD` after the step `z -> z + eta sign(A)(e_k - pi)/|e_k - pi|` on the position's logits alone (the literal first-order claim; the exact criterion is right by construction);
  - *param*: `s = <grad_theta D_t, grad_theta (A_t log pi_t)>`, exact by autograd in float64: the first-order change of D_t along the token's own gradient step, through the network (no step length); *param_head*: its output-layer term alone;
  - *precond*: `<grad_theta D_t, P grad_theta (A_t log pi_t)>` with P the AdamW preconditioner of the optimizer state (docs/audit.md gives P): what the trainer's next update made of token t alone does, to first order;
  - *own*: `dD_t(batch step) - dD_t(batch step without token t)`, float64, the warm optimizer state: the part of the batch step's change at t that masking t removes;
  - *isolated*: `dD` after a small parameter step of fixed length along the token's own loss gradient (all parameters; *isolated_head*: the output embedding only).
- **unsafe-keep rate** = |kept_c with value > 0| / |kept_c|; **corrective-update rate** = |kept_c with value < 0| / |kept_c|; **sign accuracy** = share of the set where `sign(A c) = sign(value)`; **mask precision** = |masked_c with value > 0| / |masked_c|. For realized changes `|dD| <= tie_tol` is a tie.
- **disagreement set** of a predictive criterion p: tokens of O where the ratio and p differ on "outward". There exactly one of the two is right on every token whose value is not tied.
- **sets of the per-token instruments** (param, precond, own, isolated): they are measured on a seeded uniform sample of O (their O-level rates) plus the headline disagreement tokens (their disagreement-set rates). batch and logit cover all of O.
- **statistics**: every rate is **pooled** over tokens (sum of numerators / sum of denominators over all seeds) with a 95% **seed-cluster** percentile bootstrap interval (seeds resampled, never tokens); the mean of the per-seed rates is a secondary column. *predictive - ratio* is the difference of the pooled rates with the paired cluster bootstrap. Sign accuracy on a set is compared by McNemar's exact test; on a disagreement set by the exact two-sided binomial (sign) test of "predictive right" against 1/2. Every table states n tokens and n seeds.
- The paper's exact rate definitions were not available to us; the definitions above are ours.
"""


def pct(d: dict | None, key: str = "estimate") -> str:
    v = None if not d else _v(d.get(key))
    return "n/a" if v is None else f"{100 * v:.1f}%"


def ci(d: dict | None, signed: bool = False) -> str:
    """``62.5% [55.1, 70.2]`` (or ``-3.1 pp [-6.0, -0.2]``) from a pooled ratio / difference dict."""
    e = None if not d else _v(d.get("estimate"))
    if e is None:
        return "n/a"
    f = (lambda x: f"{100 * x:+.1f}") if signed else (lambda x: f"{100 * x:.1f}")
    lo, hi = _v(d.get("lo")), _v(d.get("hi"))
    unit = " pp" if signed else "%"
    if lo is None or hi is None:
        return f"{f(e)}{unit} [n/a]"
    return f"{f(e)}{unit} [{f(lo)}, {f(hi)}]"


def _p(x) -> str:
    return format_p(float(x)) if x is not None else "p = n/a"


def sign_row(kind: str, sname: str, t: dict, headline: str) -> str | None:
    """One summary row: sign accuracy of the headline and the ratio on one set, with the test."""
    if headline not in t["criteria"]:
        return None
    cr, vs = t["criteria"], t[f"vs_{RATIO}"].get(headline, {})
    acc_p, acc_r = cr[headline]["sign_accuracy"], cr[RATIO]["sign_accuracy"]
    test = _test(vs)
    where = "O" if sname == "out_of_region" else "disagreement"
    if sname == "out_of_region" and KINDS[kind][1]:
        where = "O (uniform sample)"
    return (f"| {kind} | {where} | {t['n_tokens']} | {t['n_seeds']} | {ci(acc_p)} | {ci(acc_r)} | "
            f"{ci(vs.get('sign_accuracy'), signed=True)} | {test} |")


def _test(vs: dict) -> str:
    """The test of a set: the sign test on a disagreement set, McNemar's on O."""
    if "sign_test" in vs:
        s = vs["sign_test"]
        return f"{s['predictive_right']} / {s['n_untied']} predictive right, binomial {_p(s['p'])}"
    m = vs.get("mcnemar", {})
    return (f"discordant {m.get('only_predictive_right', 0)} : {m.get('only_ratio_right', 0)}, "
            f"McNemar {_p(m.get('p'))}")


def _counts(seeds: list[dict], headline: str) -> str:
    n_tok = sum(s["n_response_tokens"] for s in seeds)
    n_o = sum(s["n_out_of_region"] for s in seeds)
    n_dis = sum(s["n_disagreement"][headline] for s in seeds)
    return (f"{len(seeds)} seeds, {n_tok} response tokens, {n_o} out-of-region tokens, {n_dis} disagreement tokens "
            f"({headline} vs ratio)")


def headline(doc: dict) -> list[str]:
    """The audit's result as a few console lines: the token counts, then for the first step
    kind (the batch step, the one the audit is about) the sign accuracy of the headline
    criterion and of the ratio on O and on the disagreement set, each with its test and p
    (the first rows of audit.md's summary table)."""
    h = predictive_name(doc["settings"]["audit"]["estimator"])
    S = doc["summary"]
    L = [_counts(S["per_seed"], h)]
    for kind, sets in S["rates"].items():
        for sname in ("out_of_region", f"disagreement:{h}"):
            t = sets.get(sname)
            if t is None or h not in t["criteria"]:
                continue
            vs = t[f"vs_{RATIO}"].get(h, {})
            where = "O" if sname == "out_of_region" else "disagreement"
            L.append(f"{kind} step, {where} ({t['n_tokens']} tokens, {t['n_seeds']} seeds): sign accuracy {h} "
                     f"{ci(t['criteria'][h]['sign_accuracy'])}, ratio {ci(t['criteria'][RATIO]['sign_accuracy'])}; "
                     f"{_test(vs)}")
        break
    return L


def summary_table(S: dict, headline: str) -> list[str]:
    """Sign accuracy of the headline predictive criterion vs the ratio, every step kind, O
    and the disagreement set: the audit's main table."""
    L = [f"| step kind | set | n tokens | n seeds | sign accuracy, {headline} | sign accuracy, ratio | "
         "predictive - ratio | test |", "|---|---|---|---|---|---|---|---|"]
    for kind, sets in S["rates"].items():
        for sname in ("out_of_region", f"disagreement:{headline}"):
            if sname in sets:
                row = sign_row(kind, sname, sets[sname], headline)
                if row:
                    L.append(row)
    return L


def rate_table(t: dict, criteria, headline: str, *, paper: bool = False) -> list[str]:
    """Every rate of every criterion on one set: pooled [cluster-bootstrap CI] (per-seed mean)."""
    crit = t["criteria"]
    head = "| criterion | kept / set | unsafe-keep | corrective | sign accuracy | mask precision | per-seed mean (unsafe / sign) |"
    sep = "|---|---|---|---|---|---|---|"
    if paper:
        head += " paper unsafe-keep | paper corrective |"
        sep += "---|---|"
    L = [head, sep]
    for c in criteria:
        if c not in crit:
            continue
        e = crit[c]
        n = e["counts"]
        row = (f"| {c}{' (headline)' if c == headline else ''} | {n['kept']} / {n['n']} | {ci(e['unsafe_keep'])} | "
               f"{ci(e['corrective'])} | {ci(e['sign_accuracy'])} | {ci(e['mask_precision'])} | "
               f"{pct(e['unsafe_keep'], 'per_cluster_mean')} / {pct(e['sign_accuracy'], 'per_cluster_mean')} |")
        if paper:
            row += f" {_paper(c, headline, 'unsafe_keep')} | {_paper(c, headline, 'corrective')} |"
        L.append(row)
    return L


def _paper(c: str, headline: str, rate: str) -> str:
    if c == RATIO:
        return f"{100 * PAPER[rate]['ratio']:.1f}%"
    return f"{100 * PAPER[rate]['predictive']:.1f}%" if c == headline else ""


def diff_table(t: dict, criteria) -> list[str]:
    d = t.get(f"vs_{RATIO}", {})
    L = ["| predictive - ratio | unsafe-keep | corrective | sign accuracy | McNemar (only p right : only ratio right) |",
         "|---|---|---|---|---|"]
    for c in criteria:
        if c in d:
            e, m = d[c], d[c]["mcnemar"]
            L.append(f"| {c} | {ci(e['unsafe_keep'], True)} | {ci(e['corrective'], True)} | "
                     f"{ci(e['sign_accuracy'], True)} | {m['only_predictive_right']} : {m['only_ratio_right']}, "
                     f"{_p(m['p'])} |")
    return L


def shares_table(G: dict) -> list[str]:
    if not G:
        return []
    L = ["| set | n tokens | output layer | input embedding | body | tied cross term | output layer's sign = total's |",
         "|---|---|---|---|---|---|---|"]
    for name, g in G.items():
        if not g:
            continue
        L.append(f"| {name} | {g['n_tokens']} | {pct(g, 'share_head')} | {pct(g, 'share_embed')} | "
                 f"{pct(g, 'share_body')} | {pct(g, 'share_cross')} | {pct(g, 'head_sign_equals_total')} |")
    return L


def sweep_table(W: dict, headline: str) -> list[str]:
    kinds = [k for k in KINDS if any(k in w["rates"] for w in W.values())]
    L = ["| delta | O tokens | disagreement tokens | " + " | ".join(kinds) + " |",
         "|---|---|---|" + "---|" * len(kinds)]
    for d, w in W.items():
        cols = []
        for k in kinds:
            t = w["rates"].get(k, {}).get(f"disagreement:{headline}")
            st = t and t[f"vs_{RATIO}"][headline].get("sign_test")
            cols.append(f"{st['predictive_right']}/{st['n_untied']}, {_p(st['p'])}" if st else "n/a")
        L.append(f"| {d} | {w['n_out_of_region']} | {w['n_disagreement']} | " + " | ".join(cols) + " |")
    return L + ["", "Cells: tokens of the disagreement set where the predictive criterion is right / untied tokens, "
                "exact binomial p."]


def cost_table(seeds: list[dict]) -> list[str]:
    keys = sorted({k for s in seeds for k in s.get("time_s", {})})
    if not keys:
        return []
    n_meas = sum(s.get("n_measured", 0) for s in seeds)
    L = ["| stage | s per seed | s per measured token |", "|---|---|---|"]
    for k in keys:
        tot = sum(s.get("time_s", {}).get(k, 0.0) for s in seeds)
        per_tok = f"{tot / n_meas:.3f}" if n_meas and k in ("param", "own", "isolated", "isolated-head") else ""
        L.append(f"| {k} | {tot / len(seeds):.2f} | {per_tok} |")
    tot = sum(s.get("time_total_s", 0.0) for s in seeds)
    L.append(f"| total (without the rollout) | {tot / len(seeds):.2f} | |")
    return L


def markdown(doc: dict, *, plots: bool = True) -> str:
    """audit.md from the JSON doc; ``plots``: the PNGs were written beside it (else the page
    links none: ``--no-plots``)."""
    cfg = doc["settings"]["audit"]
    run = doc["settings"].get("run", {})
    S = doc["summary"]
    headline = predictive_name(cfg["estimator"])
    seeds = S["per_seed"]
    R = S["rates"]
    L = ["# Direction audit", ""]
    if run.get("command"):
        L += ["Command:", "", "```", run["command"], "```", ""]
    loss = cfg["loss"]
    th = loss["thresholds"]
    L += [f"{_counts(seeds, headline)}; divergence `{cfg['divergence']}`, "
          + ", ".join(f"{k} {v}" for k, v in th.items() if k.startswith("delta"))
          + f"; batch step: mode `{loss['mode']}`, {cfg['optimizer']} lr {cfg['lr']}, "
          f"loss_agg {loss['aggregation']['loss_agg']}, is_cap {loss['corrections']['is_cap']}; optimizer state: "
          f"{run.get('optimizer_state', 'as given')}. All settings are in `audit.json`; every rate table is "
          "recomputable from `audit_tokens.npz` (`pdmask_lab.audit.report.report_from_records`).", ""]
    if doc.get("environment"):
        L += [one_line(doc["environment"]), ""]
    if run:
        L += ["| setting | value |", "|---|---|"] + [f"| {k} | `{v}` |" for k, v in run.items()
                                                    if k not in _LONG_RUN_KEYS]
        L += [""]
    L += ["## Summary: is the predictive direction right more often than the ratio?", "",
          "Sign accuracy pooled over tokens [95% seed-cluster bootstrap]; on O the McNemar exact test, on the "
          "disagreement set the exact binomial test of the count of tokens where the predictive criterion is right.",
          ""] + summary_table(S, headline) + [""]
    if "batch" in R:
        L += ["## Batch step on O, with the paper's figures", ""]
        L += rate_table(R["batch"]["out_of_region"], CRITERIA, headline, paper=True) + [""]
        L += diff_table(R["batch"]["out_of_region"], PREDICTIVE) + [""]
    if S.get("delta_sweep"):
        L += ["## delta sweep (from the records: O(delta') is the subset of O with D > delta')", ""]
        L += sweep_table(S["delta_sweep"], headline) + [""]
    if S.get("group_shares"):
        L += ["## Where the first-order change lives (parameter groups)", "",
              "Pooled share of `sum |term|` of each group of `<grad D, grad A log pi>` (the four terms add up to "
              "the total exactly); the output layer's role is what the logit-space prediction describes.", ""]
        L += shares_table(S["group_shares"]) + [""]
    L += ["## Definitions (ours)", "", DEFINITIONS, ""]
    for kind, sets in R.items():
        L += [f"## {kind}: {KINDS[kind][2]}", ""]
        for sname, t in sets.items():
            crit = CRITERIA if sname == "out_of_region" else (RATIO, sname.split(":", 1)[1])
            where = "out-of-region tokens" if sname == "out_of_region" else sname
            if sname == "out_of_region" and KINDS[kind][1]:
                where = "uniform sample of the out-of-region tokens"
            L += [f"**{where}** ({t['n_tokens']} tokens, {t['n_seeds']} seeds)", ""]
            L += rate_table(t, crit, headline) + [""] + diff_table(t, [c for c in crit if c != RATIO]) + [""]
            st = t[f"vs_{RATIO}"].get(crit[1] if len(crit) == 2 else headline, {}).get("sign_test")
            if st:
                L += [f"Sign test: predictive right on {st['predictive_right']}, ratio on {st['ratio_right']} "
                      f"of {st['n_untied']} untied tokens ({st['n_tied']} tied), {_p(st['p'])}.", ""]
    L += fidelity_md(S["fidelity"], cfg) + entropy_md(S["entropy"])
    L += ["## Cost", ""] + cost_table(seeds) + [""]
    L += ["## Plots", "", *(["![rates](rates.png)", "", "![fidelity](fidelity.png)", "", "![scatter](scatter.png)"]
                            if plots else ["Not written (`--no-plots`)."]), ""]
    L += rollouts_md(seeds)
    L += ["## Per seed", "", "| seed | tokens | active (A != 0) | O | disagreement | measured (sample / dis.) | "
          "reward | loss | mean D |", "|---|---|---|---|---|---|---|---|---|"]
    for s in seeds:
        rew = f"{s['reward_mean']:.3f}" if "reward_mean" in s else "n/a"
        L.append(f"| {s['seed']} | {s['n_response_tokens']} | {s['n_active_tokens']} | {s['n_out_of_region']} | "
                 f"{s['n_disagreement'][headline]} | {s['n_sample']} / {s['n_disagreement_measured']} | "
                 f"{rew} | {s['loss']:.4g} | {s['divergence_mean']:.4g} |")
    return "\n".join(L) + "\n"


def rollouts_md(seeds: list[dict]) -> list[str]:
    """The task at the audited temperature, over the audited batches (mean, min-max over seeds)."""
    rows = [("accuracy (mean reward; 0/1 rewards)", "reward_mean"),
            ("groups with A != 0", None), ("responses that end within the budget", "finished_frac"),
            ("engine mass beyond its top-K, mean over response tokens", "tail_beyond_topk")]
    L = ["## Rollouts", "", f"Over the {len(seeds)} audited batches: mean (min - max over seeds).", "",
         "| quantity | value |", "|---|---|"]
    for label, key in rows:
        if key is None:
            vals = [None if "flat_group_frac" not in s else 1.0 - s["flat_group_frac"] for s in seeds]
        else:
            vals = [s.get(key) for s in seeds]
        if not vals or any(v is None for v in vals):  # a sampler that does not record it (older seeds, tests)
            continue
        L.append(f"| {label} | {sum(vals) / len(vals):.3g} ({min(vals):.3g} - {max(vals):.3g}) |")
    return L + [""]


def fidelity_md(F: dict, cfg: dict) -> list[str]:
    from pdmask.keys import ESTIMATORS
    L = ["## Estimator fidelity", "",
         f"Sign agreement of `Ddot_topK` with the full-vocabulary `Ddot` ({cfg['divergence'].split('_')[1].upper()} "
         "family), the top-K view being the first K entries of the engine's top-K; share of the full KL (TV) that "
         "the top-K KL (TV) captures. Pooled over tokens and seeds. Paper: top-20 captures > 99% of the KL; the two "
         "paper estimators (aggregated, uniform) nearly identical.", ""]
    for name in ("out_of_region", "response"):
        if name not in F:
            continue
        e = F[name]
        L += [f"**{'out-of-region tokens' if name == 'out_of_region' else 'all response tokens with A != 0'}**", "",
              "| K | " + " | ".join(ESTIMATORS) + " | aggregated = uniform | KL share | TV share |",
              "|---|" + "---|" * (len(ESTIMATORS) + 3)]
        for k in sorted(e["sign_agreement"], key=int):
            sa = e["sign_agreement"][k]
            L.append(f"| {k} | " + " | ".join(ci(sa[x]) for x in ESTIMATORS)
                     + f" | {ci(e['agg_vs_uniform'][k])} | {_share(e['kl_share'][k])} | {_share(e['tv_share'][k])} |")
        L += [""]
    return L


def _share(st: dict) -> str:
    v = _v(st.get("estimate"))
    return "n/a" if v is None else f"{100 * v:.2f}%"


def entropy_md(E: dict) -> list[str]:
    def num(d):
        v = _v(d.get("estimate"))
        if v is None:
            return "n/a"
        lo, hi = _v(d.get("lo")), _v(d.get("hi"))
        if lo is None or hi is None:
            return f"{v:.3g}"
        return f"{v:.3g} [{lo:.3g}, {hi:.3g}]"

    L = ["## Entropy side-effect", "",
         "First-order entropy change of a token's own update, `A * Hdot` with `Hdot = grad_z H . (e_k - pi)` "
         "(per unit logit step; > 0 raises the entropy), pooled over tokens. *kept*: active tokens the criterion "
         "keeps; *masked*: tokens it masks; *drift*: `sum_kept A Hdot / n_active` (what the masked step does to "
         "the entropy, to first order, with token-mean weights).", "",
         "| criterion | kept: mean A Hdot | kept: share > 0 | masked: mean A Hdot | masked: share > 0 | masked tokens | drift |",
         "|---|---|---|---|---|---|---|"]
    for c, e in E.items():
        L.append(f"| {c} | {num(e['kept'])} | {pct(e['kept']['share_increasing'])} | {num(e['masked'])} | "
                 f"{pct(e['masked']['share_increasing'])} | {int(_v(e['masked']['den']) or 0)} | {num(e['drift_per_token'])} |")
    return L + [""]


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, torch.Tensor):
        return _jsonable(x.tolist())
    if isinstance(x, np.ndarray):
        return _jsonable(x.tolist())
    if isinstance(x, np.generic):
        return _jsonable(x.item())
    if isinstance(x, float) and math.isnan(x):
        return None  # JSON null: a rate with an empty denominator, an interval with < 2 seeds
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


def _v(x) -> float | None:
    """A number of the JSON doc as a float, None when missing / NaN / not a number."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return None if math.isnan(x) else float(x)


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
        "per_seed_counts": [{"seed": r.seed, "entropy": r.entropy, "fidelity": r.fidelity} for r in results],
        "environment": environment((run_settings or {}).get("threads")),
        "runtime_s": runtime_s,
    }
    doc = _jsonable(doc)
    (out / "audit.json").write_text(json.dumps(doc, indent=1))
    (out / "audit.md").write_text(markdown(doc, plots=plots))
    write_records(out / "audit_tokens.npz", results, cfg)
    if plots:
        from .plots import plot_all
        plot_all(out, doc, results)
    return doc


def write_records(path: Path, results, cfg: AuditConfig) -> None:
    """The per-token records of all seeds plus what recomputing the tables needs: the
    audited seeds (a seed without tokens is still a cluster), the headline estimator,
    tie_tol, the bootstrap settings, the schema version."""
    from .runner import concat_tokens

    rec = concat_tokens(results)
    meta = {"seeds": np.array(sorted(r.seed for r in results), dtype=np.int64),
            "meta_version": np.array(RECORDS_VERSION), "meta_estimator": np.array(cfg.estimator),
            "meta_tie_tol": np.array(cfg.tie_tol), "meta_bootstrap": np.array(cfg.bootstrap),
            "meta_bootstrap_seed": np.array(cfg.bootstrap_seed), "meta_divergence": np.array(cfg.divergence)}
    np.savez_compressed(path, **rec, **meta)


def load_records(path) -> tuple[dict, dict]:
    """``(records, meta)`` from an ``audit_tokens.npz``."""
    with np.load(path, allow_pickle=False) as z:
        data = {k: z[k] for k in z.files}
    meta = {k[5:]: data.pop(k).item() for k in list(data) if k.startswith("meta_")}
    meta["seeds"] = data.pop("seeds")
    if meta.get("version") != RECORDS_VERSION:
        raise ValueError(f"records: {str(path)!r} has schema version {meta.get('version')}, "
                         f"this pdmask reads {RECORDS_VERSION}")
    return data, meta


def report_from_records(path) -> dict:
    """The rate tables (``rates``, ``group_shares``) recomputed from ``audit_tokens.npz`` alone."""
    from .tables import tables

    rec, meta = load_records(path)
    return tables(rec, meta["seeds"], headline=predictive_name(meta["estimator"]), tie_tol=meta["tie_tol"],
                  n_boot=int(meta["bootstrap"]), boot_seed=int(meta["bootstrap_seed"]))

