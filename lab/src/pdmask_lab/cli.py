"""The lab's commands on the ``pdmask`` command line: ``compare``, ``report``, ``task-stats``,
``ladder``, ``audit`` and ``audit-grid``.

The library's CLI (:mod:`pdmask.cli`) finds :func:`register` through the entry-point group
``pdmask.commands`` (``lab/pyproject.toml``) and calls it with its typer app; without
pdmask-lab installed those verbs answer with one line saying how to install it. Parsing and
dispatch only, like :mod:`pdmask.cli`, whose helpers (config loading, the one-line errors,
the console) these commands share.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional

import typer

from pdmask.cli import _command_line, _console, _fail, _load, _resolve_config

#: The verbs :func:`register` adds, in the order ``pdmask --help`` lists them.
COMMANDS = ("compare", "report", "task-stats", "ladder", "audit", "audit-grid")


def compare(
    overrides: Optional[List[str]] = typer.Argument(None, help="config overrides key=value applied to every run"),
    config: Optional[str] = typer.Option(None, "--config", "-c", help="YAML preset (a path, or a name in configs/)"),
    modes: str = typer.Option("grpo,dppo-topk-kl,pdm-topk-kl", "--modes", help="comma-separated mask modes"),
    seeds: int = typer.Option(1, "--seeds", help="RL seeds per mode (seed, seed+1, ...)"),
    deltas: Optional[str] = typer.Option(None, "--deltas", help="comma-separated delta values to sweep (both of the loss's thresholds)"),
    out: Optional[str] = typer.Option(None, "--out", help="output directory (default: out_dir/compare-<name>)"),
    jobs: int = typer.Option(1, "--jobs", help="runs in parallel (subprocesses; each uses `threads` threads)"),
    model: Optional[str] = typer.Option(None, "--model", help="local Hugging Face model directory or a named "
                                                                    "source (smollm2-135m); sets model_path"),
    resume: bool = typer.Option(False, "--resume", help="resume unfinished runs"),
    timing: bool = typer.Option(True, "--timing/--no-timing", help="interleaved loss-time ratio pdm/dppo at the end"),
    reference: str = typer.Option("dppo-topk-kl", "--reference",
                                  help="mode every other mode is compared with, seed by seed (one of --modes)"),
    keep_checkpoints: Optional[int] = typer.Option(
        None, "--keep-checkpoints", help="checkpoints each run keeps in OUT/<run>/checkpoints (default: the "
                                         "config's keep_checkpoints, 2); 1: the last; 0: none once the run has "
                                         "finished (it can then not be resumed, extended or audited)"),
):
    """Run several mask modes on identical data and seeds; write one report.

    summary.json / summary.md hold per-mode results over the seeds and, for every mode,
    the paired difference from --reference (seed-bootstrap interval, sign-flip p)."""
    from .compare import run_compare

    cfg = _load(config, overrides, model)
    try:
        mode_list = [m.strip() for m in modes.split(",") if m.strip()]
        from pdmask import MODES
        from pdmask._validate import check_choice

        for m in mode_list:
            check_choice("modes", m, tuple(MODES))
        delta_list = None
        if deltas:
            try:
                delta_list = [float(d) for d in deltas.split(",") if d.strip()]
            except ValueError:
                raise ValueError(f"deltas: expected comma-separated numbers, got {deltas!r}") from None
        if jobs < 1:
            raise ValueError(f"jobs: must be >= 1, got {jobs}")
        run_compare(cfg, modes=mode_list, seeds=seeds, deltas=delta_list, out=out, jobs=jobs, resume=resume,
                    timing=timing, reference=reference, keep_checkpoints=keep_checkpoints, console=_console())
    except ValueError as e:
        _fail(e)


def report(
    run_dirs: List[str] = typer.Argument(..., help="run directories or directories of runs"),
    out: Optional[str] = typer.Option(None, "--out", help="where to write the PNGs (default: first RUN_DIR/report)"),
    reference: Optional[str] = typer.Option(
        None, "--reference", help="mode every other mode is compared with, seed by seed "
                                  "(default: dppo-topk-kl when the runs have it; given explicitly, it must be present)"),
):
    """Overlay runs in PNG plots (eval accuracy with seed bands, reward, mismatch, mask fractions),
    print tables, and (re)write the across-seed summary without rerunning anything.

    The summary goes to RUN_DIR/summary.json and summary.md when a single directory of runs
    (a compare directory) is given (its other keys are kept), else next to the PNGs."""
    from .report import find_runs, load_summaries, plot_runs, summary_table, write_summary
    from .seed_summary import DEFAULT_REFERENCE, seed_summary, seed_tables

    try:
        runs = find_runs(run_dirs)
        across = seed_summary(runs, reference=reference or DEFAULT_REFERENCE, require_reference=reference is not None)
    except ValueError as e:
        _fail(e)
    dest = Path(out) if out else Path(run_dirs[0]) / "report"
    pngs = plot_runs(runs, dest)
    summaries = load_summaries(runs)
    one_compare = len(run_dirs) == 1 and not (Path(run_dirs[0]) / "metrics.jsonl").exists()
    written = write_summary(Path(run_dirs[0]) if one_compare else dest, {"runs": summaries, "across_seeds": across})
    console = _console()
    console.print(summary_table(summaries, title="runs"))
    for t in seed_tables(across):
        console.print(t)
    for line in across["resolution"] + across["notes"]:
        console.print(line)
    for p in [*pngs, *written]:
        console.print(f"wrote {p}")


def task_stats_command(
    overrides: Optional[List[str]] = typer.Argument(None, help="config overrides key=value"),
    config: Optional[str] = typer.Option(None, "--config", help="trainer YAML preset (a path or a name in configs/)"),
    model: Optional[str] = typer.Option(None, "--model", help="local Hugging Face model directory or a named "
                                                              "source (smollm2-135m); sets model_path"),
    precisions: str = typer.Option("bf16,fp8", "--precisions", help="engine precisions to measure (comma-separated)"),
    batches: int = typer.Option(8, "--batches", help="GRPO batches per precision (batch i: sampling seed i)"),
    out: str = typer.Option("task-stats", "--out", help="output directory (task_stats.json, task_stats.md)"),
):
    """Before training: the task's accuracy, groups with A != 0, finish rate, the policy's
    tail beyond the top-K and each engine's top-K KL quantiles (what a delta is chosen from)."""
    from .task_stats import task_stats, write_task_stats

    cfg = _load(config, overrides, model)
    console = _console()
    try:
        doc = task_stats(cfg, precisions=[p.strip() for p in precisions.split(",") if p.strip()], batches=batches,
                         console=console)
        files = write_task_stats(doc, out, _command_line())
    except ValueError as e:
        _fail(e)
    for f in files:
        console.print(f"wrote {f}")


def ladder(
    overrides: Optional[List[str]] = typer.Argument(None, help="config overrides key=value applied to every run "
                                                              "(not keys a rung sets)"),
    spec: str = typer.Option("ladder", "--spec", help="ladder spec YAML (a path, or a name in configs/)"),
    out: Optional[str] = typer.Option(None, "--out", help="output directory (default: the spec's `out`)"),
    jobs: int = typer.Option(1, "--jobs", help="runs in parallel (subprocesses; each uses `threads` threads)"),
    rungs: Optional[str] = typer.Option(None, "--rungs", help="comma-separated rungs to run (default: all); "
                                                              "the report always covers every rung"),
    modes: Optional[str] = typer.Option(None, "--modes", help="comma-separated modes (replaces the spec's modes)"),
    seeds: Optional[int] = typer.Option(None, "--seeds", help="seeds per cell (replaces the spec's seeds)"),
    model: Optional[str] = typer.Option(None, "--model", help="model of every run: a local Hugging Face directory "
                                                              "or a named source (smollm2-135m); sets model_path"),
    prefix_of: Optional[str] = typer.Option(
        None, "--prefix-of", help="another ladder's output directory: its finished runs that differ from a cell "
                                  "not started here only by more steps become that cell (their first `steps` "
                                  "steps; exact, see pdmask_lab.prefix) instead of running it"),
    plan: bool = typer.Option(False, "--plan", help="print every cell's status (done / partial / todo) and exit"),
    report_only: bool = typer.Option(False, "--report-only", help="rebuild the report without running anything"),
    report_dir: Optional[str] = typer.Option(
        None, "--report-dir", help="write the report into this folder instead of OUT, with the records it is "
                                   "built from (per run config.yaml, metrics.jsonl, summary.json; the ladder's "
                                   "log; no checkpoints), so that `--out DIR --report-only` rebuilds it from them"),
    keep_checkpoints: Optional[int] = typer.Option(
        None, "--keep-checkpoints", help="checkpoints each cell keeps in OUT/<rung>/<run>/checkpoints (default: "
                                         "the config's keep_checkpoints, 2); 1: the last; 0: none once the cell "
                                         "has finished (it can then not be extended or audited)"),
):
    """Run the mismatch ladder: every mode x seed on rungs of increasing engine mismatch.

    Resumable without a flag: finished cells are skipped, a killed cell resumes from its
    checkpoint, new modes/seeds/rungs run only their own cells. Writes OUT/ladder.md,
    ladder.json, ladder.png (accuracy and collapse rate vs measured mismatch) and per rung
    the across-seed summary with paired tests against the spec's reference mode; with
    --report-dir DIR, into DIR together with the runs' records (a results folder)."""
    from .ladder import CellFailed, load_spec, plan_cells, run_ladder, statuses
    from .ladder_report import build_report, export_records

    try:
        if jobs < 1:
            raise ValueError(f"jobs: must be >= 1, got {jobs}")
        try:
            p = Path(spec) if Path(spec).is_file() else _resolve_config(spec)
        except ValueError:  # _resolve_config names `config`; here the file is the spec
            raise ValueError(f"spec: file {spec!r} not found (nor configs/{spec}.yaml)") from None
        overrides = [*(overrides or []), *([f"model_path={model}"] if model else [])]
        sp = load_spec(p, modes=modes, seeds=seeds, overrides=overrides)
        rung_list = [r.strip() for r in rungs.split(",") if r.strip()] if rungs else None
        console = _console()
        if plan and report_dir:
            raise ValueError("report_dir: --plan writes nothing; drop --report-dir")
        if prefix_of and (plan or report_only):
            raise ValueError("prefix_of: --plan and --report-only run nothing; drop --prefix-of")
        if keep_checkpoints is not None and (plan or report_only):
            raise ValueError("keep_checkpoints: --plan and --report-only run nothing; drop --keep-checkpoints")
        if plan:
            cells = plan_cells(sp, Path(out or sp.out), rung_list)
            st = statuses(cells)
            for c in cells:
                console.print(f"{st[c.key]:8s} {c.key}")
            console.print(", ".join(f"{sum(v == k for v in st.values())} {k}" for k in ("done", "partial", "todo"))
                          + f" of {len(cells)} cells")
            return
        if not report_only:
            run_ladder(sp, out=out, jobs=jobs, rungs=rung_list, prefix_of=prefix_of, keep_checkpoints=keep_checkpoints,
                       console=console)
        src = Path(out or sp.out)
        dest = Path(report_dir) if report_dir else src
        if dest.resolve() != src.resolve():
            # the page is built from the copied records, so a rebuild from them gives the same page
            n = export_records(sp, src, dest)
            console.print(f"copied the records of {n} runs from {src} to {dest}")
        build_report(sp, dest, console=console, command=_command_line())
    except ValueError as e:
        _fail(e)
    except CellFailed as e:  # one line naming the cell and its log; exit 1 (the cause may be a bug)
        if os.environ.get("PDMASK_TRACEBACK"):
            raise
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None


def register(app: typer.Typer) -> None:
    """Add the lab's verbs to the ``pdmask`` app (the ``pdmask.commands`` entry point), and
    import :mod:`pdmask_lab.batchmask`, which registers the ``pdm-batch-*`` modes' trainer
    forward: ``pdmask train`` trains them as it did when the lab was part of pdmask."""
    from . import batchmask  # noqa: F401  (registers the pdm-batch-* modes and their forward)
    from .audit.cli import register as register_audit

    app.command()(compare)
    app.command()(report)
    app.command("task-stats")(task_stats_command)
    app.command()(ladder)
    register_audit(app)  # `pdmask audit`, `pdmask audit-grid` (their options live in pdmask_lab.audit.cli)
