"""Where does a run break? Each run's curves read against the signs a practitioner would stop
a run for (docs/real_rl.md, "Where the trust region matters"); the ladder report's "Where
runs break" section is built from them.

A run **breaks** when any of these holds (the thresholds are this module's constants, the
one place they are written; the page prints them from here):

- ``accuracy``: held-out accuracy falls at least :data:`ACC_DROP` below its running best;
- ``entropy``: the policy entropy on the sampled tokens (a 3-step moving mean) falls below
  :data:`ENTROPY_COLLAPSE` x its start (the mean of steps 1-3) or rises above
  :data:`ENTROPY_EXPLODE` x its start;
- ``ending``: answers stop ending: the finish rate (3-step moving mean) falls below
  :data:`FINISH_FALL` x its start, or the mean response length (3-step moving mean) reaches
  :data:`LENGTH_CAP` x ``max_new_tokens``;
- ``mismatch``: the engine mismatch (top-K KL before each step's updates, a moving mean over
  one sync cycle) exceeds :data:`MISMATCH_RUNAWAY` x its first cycle's mean.

A rung (one setting) **breaks** when :data:`UNGUARDED` (``none``) breaks on at least one
seed while :data:`GUARD` (``dppo-topk-kl``) in the same rung breaks on none.

The stale-engine comparison (``configs/real-stale.yaml``, docs/real_rl.md, "The stale engine")
fixed a second set before its first run, :data:`STALE_CRITERIA` (:func:`judge_stale`), each
reported on its own, never as a union:

- ``ending_sampled``: the sampled finish rate (3-step moving mean, from step 4) is ``<=``
  :data:`FINISH_FALL` x its start (mean of steps 1-3);
- ``ending_greedy``: at an eval after step 0, the greedy answers' share that end is ``<=``
  :data:`GREEDY_ENDING_FLOOR` (most held-out answers no longer end);
- ``accuracy``: held-out accuracy ``>=`` :data:`ACC_DROP` below its running best;
- ``no_learning``: final held-out accuracy ``<`` start + :data:`LEARN_GAIN`;
- ``entropy``: the entropy (3-step moving mean, from step 4) ``<`` :data:`ENTROPY_COLLAPSE` x
  its start, counted only when one of the four above also holds;
- ``mismatch``: the engine mismatch (top-K KL before each step's updates, moving mean over a
  sync cycle) ``>`` :data:`MISMATCH_RUNAWAY_ABS` x :data:`FP8_FLOOR_TOPK_KL`, the lag-0 fp8
  engine's mean top-K KL (docs/results/real-lm/task_stats.md): one absolute bar for every mode.

Naive equivalent of one criterion::

    start = mean(finish_rate[:3]); ending = any(moving_mean(finish_rate, 3)[1:] < 0.5 * start)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .seed_summary import mean_present as _mean

ACC_DROP = 0.15
ENTROPY_COLLAPSE = 0.25
ENTROPY_EXPLODE = 2.0
FINISH_FALL = 0.5
LENGTH_CAP = 0.95
MISMATCH_RUNAWAY = 4.0
#: the rung verdict's two modes: training without a trust region, and the one that guards it
UNGUARDED, GUARD = "none", "dppo-topk-kl"
#: the criteria, in the order the page lists them
CRITERIA = ("accuracy", "entropy", "ending", "mismatch")
#: what each criterion tests, with its threshold (the page's definitions)
DEFINITIONS = {
    "accuracy": f"held-out accuracy falls at least {ACC_DROP:g} below its running best",
    "entropy": f"the policy entropy (3-step moving mean) falls below {ENTROPY_COLLAPSE:g}x or rises above "
               f"{ENTROPY_EXPLODE:g}x its start (mean of steps 1-3)",
    "ending": f"the finish rate (3-step moving mean) falls below {FINISH_FALL:g}x its start, or the mean response "
              f"length (3-step moving mean) reaches {LENGTH_CAP:g}x max_new_tokens",
    "mismatch": f"the engine mismatch (top-K KL, moving mean over a sync cycle) exceeds {MISMATCH_RUNAWAY:g}x its "
                "first cycle's",
}


# ------------------------------------------------------------------ the stale-engine criteria
#: the greedy-ending bar: at most this share of held-out greedy answers end
GREEDY_ENDING_FLOOR = 0.5
#: did not learn: final held-out accuracy below start + this
LEARN_GAIN = 0.15
#: the fp8 engine's mean top-K KL at lag 0 (docs/results/real-lm/task_stats.md, fp8 column)
FP8_FLOOR_TOPK_KL = 0.00931
#: mismatch runaway: the cycle's mean top-K KL above this many fp8 floors
MISMATCH_RUNAWAY_ABS = 10.0
#: how the pi_old-anchored modes' delta is chosen, fixed before the comparison's pilot ran: the q90
#: of the top-K KL(pi_old || pi) after one mini-batch update, i.e. the trainer's
#: ``mb2_divergence_q90`` with ``anchor: old`` and mode ``none`` (no mask: the drift as it is),
#: averaged over the first 3 steps of one pilot run at seed 100 (outside the comparison's seeds
#: 0-7), in the comparison's cell; the mu-anchored modes keep delta = 0.02, the fp8 engine's q90
STALE_OLD_DELTA_RULE = ("q90 of top-K KL(pi_old || pi) after one mini-batch (mb2_divergence_q90, anchor old, mode "
                        "none), mean over steps 1-3 of a pilot run at seed 100 in the comparison's cell")
#: the stale-engine comparison's criteria, in the page's order (entropy counts only with another)
STALE_CRITERIA = ("ending_sampled", "ending_greedy", "accuracy", "no_learning", "entropy", "mismatch")
STALE_DEFINITIONS = {
    "ending_sampled": f"the sampled finish rate (3-step moving mean, from step 4) <= {FINISH_FALL:g}x its start "
                      "(mean of steps 1-3)",
    "ending_greedy": f"at an eval after step 0, the share of greedy held-out answers that end <= "
                     f"{GREEDY_ENDING_FLOOR:g}",
    "accuracy": f"held-out accuracy >= {ACC_DROP:g} below its running best",
    "no_learning": f"final held-out accuracy < start + {LEARN_GAIN:g}",
    "entropy": f"the entropy (3-step moving mean, from step 4) < {ENTROPY_COLLAPSE:g}x its start, counted only "
               "when one of the four criteria above also holds",
    "mismatch": f"the engine mismatch (top-K KL before each step's updates, moving mean over a sync cycle) > "
                f"{MISMATCH_RUNAWAY_ABS:g} x {FP8_FLOOR_TOPK_KL:g} (the lag-0 fp8 engine's mean top-K KL)",
}


def judge_stale(recs: list[dict], *, sync_every: int) -> dict[str, int]:
    """The :data:`STALE_CRITERIA` a run's metrics records meet, each with the first step it was
    met at (an empty dict: none). Records without the finish rate cannot be judged: ValueError."""
    steps = [r for r in recs if r.get("step", 0) > 0]
    if any(r.get("finish_rate") is None for r in steps):
        raise ValueError("metrics: a record without finish_rate; this run cannot be judged on the stale criteria")
    evals = [(r["step"], r["eval_accuracy"], r.get("eval_finished")) for r in recs if r.get("eval_accuracy") is not None]
    out: dict[str, int] = {}
    fin = [float(r["finish_rate"]) for r in steps]
    if len(fin) >= 4:
        s0 = sum(fin[:3]) / 3
        hit = next((i + 3 for i, x in enumerate(moving_mean(fin, 3)) if i >= 1 and x <= FINISH_FALL * s0), None)
        if hit is not None:
            out["ending_sampled"] = hit
    hit = next((s for s, _, f in evals if s > 0 and f is not None and f <= GREEDY_ENDING_FLOOR), None)
    if hit is not None:
        out["ending_greedy"] = hit
    best = None
    for s, a, _ in evals:
        best = a if best is None else max(best, a)
        if best - a >= ACC_DROP - 1e-9:
            out.setdefault("accuracy", s)
    if len(evals) >= 2 and evals[-1][1] < evals[0][1] + LEARN_GAIN - 1e-9:
        out["no_learning"] = evals[-1][0]
    ent = [float(r["entropy_mean"]) for r in steps if r.get("entropy_mean") is not None]
    if out and len(ent) >= 4:
        s0 = sum(ent[:3]) / 3
        hit = next((i + 3 for i, x in enumerate(moving_mean(ent, 3)) if i >= 1 and x < ENTROPY_COLLAPSE * s0), None)
        if hit is not None:
            out["entropy"] = hit
    k = max(int(sync_every), 1)
    mis = [float(r["mismatch_topk_kl"]) for r in steps if r.get("mismatch_topk_kl") is not None]
    hit = next((i + k for i, x in enumerate(moving_mean(mis, k)) if x > MISMATCH_RUNAWAY_ABS * FP8_FLOOR_TOPK_KL), None)
    if hit is not None:
        out["mismatch"] = hit
    return dict(sorted(out.items(), key=lambda kv: STALE_CRITERIA.index(kv[0])))


def moving_mean(xs: list[float], n: int) -> list[float]:
    """Means of each ``n`` consecutive values (``len(xs) - n + 1`` of them)."""
    return [sum(xs[i - n + 1:i + 1]) / n for i in range(n - 1, len(xs))] if len(xs) >= n else []


@dataclass
class RunBreaks:
    """One run's curves (per RL step from 1) and the criteria it met, each with the step at
    which it was first met."""

    mode: str
    seed: int
    evals: list[tuple[int, float]]
    entropy: list[float]
    finish: list[float]
    length: list[float]
    mismatch: list[float]
    broke: dict[str, int] = field(default_factory=dict)

    @property
    def broken(self) -> bool:
        return bool(self.broke)


def judge(recs: list[dict], *, mode: str, seed: int, max_new_tokens: int, sync_every: int) -> RunBreaks | None:
    """A run's metrics records judged against the criteria; None for records without the
    finish rate (runs logged before it existed), which cannot be judged on every criterion."""
    steps = [r for r in recs if r.get("step", 0) > 0]
    if not steps or any(r.get("finish_rate") is None for r in steps):
        return None

    def col(k):
        return [float(r[k]) for r in steps if r.get(k) is not None]

    rb = RunBreaks(mode, seed, [(r["step"], r["eval_accuracy"]) for r in recs if r.get("eval_accuracy") is not None],
                   col("entropy_mean"), col("finish_rate"), col("response_length"), col("mismatch_topk_kl"))
    best = None
    for s, a in rb.evals:
        best = a if best is None else max(best, a)
        if best - a >= ACC_DROP - 1e-9:
            rb.broke.setdefault("accuracy", s)
    _first_fall(rb, "entropy", rb.entropy, lambda x, s0: x < ENTROPY_COLLAPSE * s0 or x > ENTROPY_EXPLODE * s0)
    _first_fall(rb, "ending", rb.finish, lambda x, s0: x < FINISH_FALL * s0)
    for i, x in enumerate(moving_mean(rb.length, 3)):
        if x >= LENGTH_CAP * max_new_tokens:
            rb.broke["ending"] = min(rb.broke.get("ending", i + 3), i + 3)
            break
    k = max(int(sync_every), 1)
    if len(rb.mismatch) >= 2 * k:
        s0 = sum(rb.mismatch[:k]) / k
        for i, x in enumerate(moving_mean(rb.mismatch, k)):
            if s0 > 0 and x > MISMATCH_RUNAWAY * s0:
                rb.broke.setdefault("mismatch", i + k)
                break
    return rb


def _first_fall(rb: RunBreaks, name: str, xs: list[float], test) -> None:
    """The first step whose 3-step moving mean, from step 4 on, meets ``test(x, start)``."""
    if len(xs) < 4:
        return
    s0 = sum(xs[:3]) / 3
    for i, x in enumerate(moving_mean(xs, 3)):
        if i >= 1 and test(x, s0):
            rb.broke.setdefault(name, i + 3)
            return


def judge_run(run: Path) -> RunBreaks | None:
    """:func:`judge` of a run directory's ``metrics.jsonl`` and ``config.yaml``; its ``mode`` is
    the run's label (:func:`pdmask_lab.seed_summary.variant_label`: ``dppo-topk-kl@old`` is not
    merged with ``dppo-topk-kl``)."""
    from pdmask.train.config import stored_config
    from pdmask.train.logging import read_jsonl
    from .seed_summary import variant_label

    cfg = stored_config(run) or {}
    mode = variant_label(run, str(cfg.get("mode") or (cfg.get("loss") or {}).get("mode")))
    return judge(read_jsonl(run / "metrics.jsonl"), mode=mode, seed=int(cfg.get("seed", 0)),
                 max_new_tokens=int(cfg.get("max_new_tokens", 1 << 30)), sync_every=int(cfg.get("sync_every", 1)))


def rung_breaks(runs: list[Path], reference: str) -> dict | None:
    """Per mode: the seeds that broke (each with its criteria and first steps), the finish
    rate and entropy at the start and over the last 3 steps; against ``reference``'s seeds
    (the ladder's reference mode), McNemar's exact test of the breaks (the seeds where exactly
    one of the two broke), and the paired per-seed difference of the end finish rate (the
    same failure as a number, for runs too short to cross the threshold: mean, seed-bootstrap
    interval, exact sign-flip test); the rung's :func:`verdict`. None when no run logged the
    finish rate."""
    from .significance import clopper_pearson, mcnemar_exact, paired_difference

    judged = [j for j in map(judge_run, runs) if j is not None]
    if not judged:
        return None
    by: dict[str, dict[int, RunBreaks]] = {}
    for j in judged:
        by.setdefault(j.mode, {})[j.seed] = j
    ref = by.get(reference, {})
    modes = {}
    for m, seeds in by.items():
        k = sum(j.broken for j in seeds.values())
        lo, hi = clopper_pearson(k, len(seeds))
        row = {"k": k, "n": len(seeds), "lo": lo, "hi": hi,
               "per_seed": {s: dict(sorted(j.broke.items(), key=lambda x: x[1])) for s, j in sorted(seeds.items())},
               "finish_start": _mean([_mean(j.finish[:3]) for j in seeds.values()]),
               "finish_end": _mean([_mean(j.finish[-3:]) for j in seeds.values()]),
               "entropy_start": _mean([_mean(j.entropy[:3]) for j in seeds.values()]),
               "entropy_end": _mean([_mean(j.entropy[-3:]) for j in seeds.values()]),
               "vs_reference": None, "finish_end_vs_reference": None}
        common = sorted(set(seeds) & set(ref))
        if m != reference and common:
            b = sum(seeds[s].broken and not ref[s].broken for s in common)
            c = sum(ref[s].broken and not seeds[s].broken for s in common)
            row["vs_reference"] = {"reference": reference, "n": len(common), "only_mode": b, "only_reference": c,
                                   "p": mcnemar_exact(b, c)}
            ends = [(_mean(seeds[s].finish[-3:]), _mean(ref[s].finish[-3:])) for s in common]
            row["finish_end_vs_reference"] = paired_difference([x for x, _ in ends], [y for _, y in ends]).to_dict()
        modes[m] = row
    return {"modes": modes, "verdict": verdict(modes)}


def verdict(modes: dict) -> str:
    """``breaks`` (:data:`UNGUARDED` broke on a seed, :data:`GUARD` on none), ``both break``,
    ``stable`` (:data:`UNGUARDED` broke on none), ``no guard run`` or ``no unguarded run``."""
    if UNGUARDED not in modes:
        return f"no {UNGUARDED} run"
    if modes[UNGUARDED]["k"] == 0:
        return "stable"
    if GUARD not in modes:
        return "no guard run"
    return "both break" if modes[GUARD]["k"] else "breaks"


def breaks_rows(rep: dict) -> tuple[list[str], list[list[str]]]:
    """(headers, rows) of the report's "Where runs break" table: one row per (rung, mode)."""
    h = ["rung", "verdict", "mode", "broke (seeds)", "criteria: first step per seed", "finish rate start -> end",
         "entropy start -> end", f"Δ broke vs {rep['reference']} (McNemar)",
         f"Δ end finish rate vs {rep['reference']} (sign-flip)"]
    rows = []
    for r in rep["rungs"]:
        br = r.get("breaks")
        if not br:
            continue
        for m, row in br["modes"].items():
            crit = "; ".join(f"s{s}: " + (", ".join(f"{c} @{st}" for c, st in b.items()) or "-")
                             for s, b in row["per_seed"].items())
            vs = row["vs_reference"]
            f2 = lambda a, b: "-" if a is None or b is None else f"{a:.2f} -> {b:.2f}"  # noqa: E731
            rows.append([r["name"], br["verdict"], m, f"{row['k']}/{row['n']} [{row['lo']:.2f}, {row['hi']:.2f}]",
                         crit, f2(row["finish_start"], row["finish_end"]), f2(row["entropy_start"], row["entropy_end"]),
                         "-" if vs is None else f"{vs['only_mode']} vs {vs['only_reference']} (p = {vs['p']:.3g})",
                         _paired_cell(row.get("finish_end_vs_reference"))])
    return h, rows


def _paired_cell(d: dict | None) -> str:
    """``+0.12 [+0.05, +0.20], 6 up / 1 down of 8 seeds, p = 0.03`` (a paired difference)."""
    if d is None:
        return "-"
    ci = "" if d["n"] < 2 else f" [{d['lo']:+.2f}, {d['hi']:+.2f}]"
    return f"{d['estimate']:+.2f}{ci}, {d['wins']} up / {d['losses']} down of {d['n']} seeds, p = {d['p']:.3g}"
