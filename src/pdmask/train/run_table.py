"""One run's summary as a table: what ``pdmask train`` prints when a run ends, and the
columns (key, header, format) every summary table shares (the lab's across-run tables,
:mod:`pdmask_lab.report`, use the same ones)."""

from __future__ import annotations

from .environment import one_line

#: (summary key, column header, format) of a run summary's headline numbers
#: (:func:`pdmask.train.grpo.summarize` writes the keys).
COLUMNS = [("mode", "mode", "{}"), ("seed", "seed", "{}"), ("delta_high", "δ", "{}"),
           ("eval_accuracy_start", "eval acc @0", "{:.3f}"), ("eval_accuracy_final", "eval acc final", "{:.3f}"),
           ("eval_accuracy_best", "best", "{:.3f}"), ("reward_last10", "reward (last 10)", "{:.3f}"),
           ("mismatch_topk_kl_mean", "mismatch KL", "{:.2e}"), ("out_of_region_frac_mean", "out-of-region", "{:.3f}"),
           ("masked_frac_mean", "masked", "{:.3f}"), ("disagreement_frac_mean", "disagree", "{:.3f}"),
           ("time_step_s_median", "s/step", "{:.2f}"), ("update_s_per_1k_tokens_median", "update s/1k tok", "{:.3f}")]


def fmt(v, f: str) -> str:
    """``f.format(v)``; ``-`` for a missing value, ``str(v)`` when the format does not apply."""
    if v is None:
        return "-"
    try:
        return f.format(v)
    except (ValueError, TypeError):
        return str(v)


def run_table(summary: dict, title: str = "run"):
    """A two-column rich Table (metric, value) of one run's summary."""
    from rich.table import Table

    t = Table(title=title)
    t.add_column("metric")
    t.add_column("value", justify="right")
    fmts = {k: f for k, _, f in COLUMNS}
    for k, v in summary.items():
        if k == "environment":
            v = one_line(v).removeprefix("Environment: ")
        t.add_row(k, fmt(v, fmts.get(k, "{:.4g}" if isinstance(v, float) else "{}")))
    return t
