"""Command line: ``pdmask train | compare | report | task-stats | ladder | model | audit | audit-grid``.

Parsing and dispatch only; the work is in :mod:`pdmask.train`. Config presets live in
``configs/*.yaml``; ``--config main`` is short for ``configs/main.yaml``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List, Optional

import typer

from .engine.registry import MissingExtra

def _command_line() -> str:
    """This invocation as a shell line, for the pages that name the command that wrote them
    (absolute paths in it made portable: :func:`pdmask.train.portable.portable_command`)."""
    from .train.portable import portable_command

    return portable_command("pdmask", sys.argv[1:])


app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="pdmask: trust-region masks for LLM RL (built-in trainer, comparisons, reports).")


def _resolve_config(config: Optional[str]) -> Optional[Path]:
    if config is None:
        return None
    p = Path(config)
    if p.exists():
        return p
    for cand in (Path("configs") / f"{config}.yaml", Path(__file__).resolve().parents[2] / "configs" / f"{config}.yaml"):
        if cand.exists():
            return cand
    raise ValueError(f"config: file {config!r} not found (nor configs/{config}.yaml)")


def _load(config, overrides, model):
    from .train.config import load_config

    ov = list(overrides or [])
    if model:
        ov.append(f"model_path={model}")
    try:
        return load_config(_resolve_config(config), ov)
    except ValueError as e:
        _fail(e)


def _console():
    """A rich console; wide when the output is not a terminal (logs, pipes, CI)."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=220)


def _fail(e: Exception):
    if os.environ.get("PDMASK_TRACEBACK"):
        raise e  # debugging: the full traceback
    typer.echo(f"error: {user_message(e)}", err=True)  # the message names the bad key/argument/file
    raise typer.Exit(2)


def user_message(e: BaseException) -> str:
    """One line: a ValueError's own message (it names the key), an OSError's file and reason."""
    if isinstance(e, OSError) and e.strerror:
        where = e.filename if e.filename is not None else ""
        if e.filename2 is not None:
            where = f"{where} -> {e.filename2}"
        msg = f"{where}: {e.strerror}" if where else e.strerror
    else:
        msg = str(e) or type(e).__name__
    return " ".join(msg.split())  # one line, whatever the message held


#: Exceptions that are the user's to fix (a bad value, file, directory or disk, an optional
#: extra not installed), reported as one line with exit code 2 by every command
#: (``PDMASK_TRACEBACK=1`` shows the traceback); anything else is a bug and keeps its
#: traceback, a plain ImportError included.
USER_ERRORS = (ValueError, OSError, MissingExtra)


def user_errors(fn):
    """Wrap a command so that a :data:`USER_ERRORS` exception is one ``error: ...`` line."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            check_int_options(fn, kwargs)
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort):
            raise
        except USER_ERRORS as e:
            _fail(e)

    return wrapper


def int_option_ranges() -> dict[str, tuple[int, int]]:
    """The range of the commands' integer options (typer checks that a value is an integer,
    not its range); an option not listed takes ``[0, INT_MAX]`` (a count or a size). The
    bounds are :mod:`pdmask.train.config`'s: ``MAX_SEEDS`` seeds per mode, ``MAX_JOBS``
    processes, 32-bit seeds."""
    from .train.config import INT_MAX, MAX_JOBS, MAX_SEEDS, SEED_MAX

    return {"jobs": (1, MAX_JOBS), "seeds": (1, MAX_SEEDS), "seed_offset": (0, SEED_MAX),
            "disagreement_tokens": (-1, INT_MAX), "top_k": (1, INT_MAX), "bootstrap": (1, INT_MAX),
            "batches": (1, INT_MAX), None: (0, INT_MAX)}


def check_int_options(fn, kwargs: dict) -> None:
    """Every integer option of a command call within :func:`int_option_ranges`, before the
    command does anything (a ``ValueError`` naming the flag otherwise): a huge value would
    overflow C code or plan for ever."""
    import typing

    from .train.config import SEED_MAX

    ranges, hints = int_option_ranges(), typing.get_type_hints(fn)
    for name, v in kwargs.items():
        tp = hints.get(name)
        if tp is not int and int not in typing.get_args(tp) or not isinstance(v, int) or isinstance(v, bool):
            continue
        lo, hi = ranges.get(name, ranges[None])
        if not lo <= v <= hi:
            raise ValueError(f"--{name.replace('_', '-')}: must be an integer in [{lo}, {hi}], got {v}")
    first, n = kwargs.get("seed_offset"), kwargs.get("seeds")
    if isinstance(first, int) and isinstance(n, int) and first + n - 1 > SEED_MAX:
        raise ValueError(f"--seeds: the last seed (--seed-offset + --seeds - 1 = {first + n - 1}) must be at most "
                         f"{SEED_MAX}")


def _usage_line(e) -> str:
    """A command-line usage error (an option that is not an integer, an unknown option or
    command) as one line naming the option, and where the options are listed."""
    where = getattr(getattr(e, "ctx", None), "command_path", None) or "pdmask"
    return f"{' '.join(e.format_message().split())} ({where} --help lists the options)"


def _print_config_help():
    from rich.console import Console
    from rich.table import Table

    from .train.config import field_help

    t = Table(title="TrainConfig fields (YAML keys and key=value overrides)")
    for c in ("name", "type", "default", "help"):
        t.add_column(c, overflow="fold")
    for row in field_help():
        t.add_row(*row)
    Console().print(t)


@app.command()
def train(
    overrides: Optional[List[str]] = typer.Argument(None, help="config overrides key=value (see --help-config)"),
    config: Optional[str] = typer.Option(None, "--config", "-c", help="YAML preset (a path, or a name in configs/)"),
    model: Optional[str] = typer.Option(None, "--model", help="local Hugging Face model directory or a named source (smollm2-135m); sets model_path"),
    resume: bool = typer.Option(False, "--resume", help="continue the run from its latest checkpoint"),
    help_config: bool = typer.Option(False, "--help-config", help="list every config field and exit"),
):
    """Train one run: SFT warm start (cached), then RL with the configured mask mode."""
    if help_config:
        _print_config_help()
        return
    from rich.console import Console

    from .train.grpo import train as run_train
    from .lab.report import run_table

    cfg = _load(config, overrides, model)
    console = _console()
    try:
        s = run_train(cfg, resume=resume, console=console)
    except ValueError as e:
        _fail(e)
    console.print(run_table(s, title=f"run {cfg.run_dir}"))


@app.command()
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
    from .lab.compare import run_compare

    cfg = _load(config, overrides, model)
    try:
        mode_list = [m.strip() for m in modes.split(",") if m.strip()]
        from . import MODES
        from ._validate import check_choice

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


@app.command()
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
    from .lab.report import find_runs, load_summaries, plot_runs, summary_table, write_summary
    from .lab.seed_summary import DEFAULT_REFERENCE, seed_summary, seed_tables

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


@app.command("task-stats")
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
    from .lab.task_stats import task_stats, write_task_stats

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


@app.command()
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
                                  "steps; exact, see pdmask.lab.prefix) instead of running it"),
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
    from .lab.ladder import CellFailed, load_spec, plan_cells, run_ladder, statuses
    from .lab.ladder_report import build_report, export_records

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


@app.command("model")
def model_command(
    name: str = typer.Argument(..., help="a named model (smollm2-135m)"),
    cache_dir: Optional[str] = typer.Option(None, "--cache-dir", help="cache root (default: $PDMASK_CACHE, else "
                                                                      "~/.cache/pdmask); the model goes to <root>/models"),
):
    """Convert a named model once and print its Hugging Face directory.

    The conversion reads the GGUF file the model's pip package ships; the printed directory
    is what any script, TRL's included, loads with from_pretrained. Later calls, and the trainer's `--model NAME`, reuse the cached directory (a damaged one
    is converted again). The path is the only line on stdout; progress goes to stderr."""
    from rich.console import Console

    from .train.named_models import NAMED_MODELS, resolve_model

    if name not in NAMED_MODELS:
        raise ValueError(f"name: {name!r} is not a named model; valid names are: {', '.join(NAMED_MODELS)} "
                         "(a local directory needs no conversion)")
    typer.echo(resolve_model(name, cache_dir=cache_dir, console=Console(stderr=True)))


# `pdmask audit`, `pdmask audit-grid`: the direction audit's commands (their options live in pdmask.lab.audit.cli)
from .lab.audit.cli import register as _register_audit  # noqa: E402  (registered last: listed last in --help)

_register_audit(app)

# every command, the audit's included, reports user errors as one line (exit code 2)
for _cmd in app.registered_commands:
    _cmd.callback = user_errors(_cmd.callback)


def main(argv: list[str] | None = None) -> None:
    """The ``pdmask`` command: typer's app, its usage errors (an option that is not an integer,
    an unknown option or command) one ``error: ...`` line with exit code 2 like every user
    error, instead of typer's framed message."""
    try:
        from typer._click import exceptions as cx  # typer >= 0.20 carries its own click
    except ImportError:  # older typer: click itself
        from click import exceptions as cx

    try:
        rv = app(args=argv, prog_name="pdmask", standalone_mode=False)
    except cx.NoArgsIsHelpError as e:  # `pdmask` alone: the help is printed
        sys.exit(e.exit_code)
    except cx.ClickException as e:
        typer.echo(f"error: {_usage_line(e)}", err=True)
        sys.exit(e.exit_code)
    except cx.Abort:
        typer.echo("Aborted!", err=True)
        sys.exit(1)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
    sys.exit(0)
