"""Command line: ``pdmask train | model``, and the lab's verbs ``compare | report | task-stats |
ladder | audit | audit-grid`` when pdmask-lab is installed.

Parsing and dispatch only; the work is in :mod:`pdmask.train`. The lab's verbs live in the
pdmask-lab distribution (:mod:`pdmask_lab.cli`); this module finds them through the entry-point
group ``pdmask.commands`` and never imports the lab itself. Without pdmask-lab, each of those
verbs answers with one line saying how to install it (exit code 2). Config presets live in
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
    from .train.run_table import run_table

    cfg = _load(config, overrides, model)
    console = _console()
    try:
        s = run_train(cfg, resume=resume, console=console)
    except ValueError as e:
        _fail(e)
    console.print(run_table(s, title=f"run {cfg.run_dir}"))


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


#: The verbs of the pdmask-lab distribution (:data:`pdmask_lab.cli.COMMANDS`): without it, each
#: answers with :func:`lab_missing_line` instead of "no such command".
LAB_COMMANDS = ("compare", "report", "task-stats", "ladder", "audit", "audit-grid")
#: The order of ``pdmask --help`` (a plugin's other verbs follow, in their registration order).
HELP_ORDER = ("train", "compare", "report", "task-stats", "ladder", "model", "audit", "audit-grid")
#: The entry-point group a distribution adds verbs through: ``name = "module:register"``, where
#: ``register(app)`` adds typer commands to the ``pdmask`` app (pdmask-lab's ``lab/pyproject.toml``).
COMMANDS_GROUP = "pdmask.commands"


def lab_missing_line(verb: str) -> str:
    """The one line a lab verb prints when pdmask-lab is not installed."""
    return (f"error: `pdmask {verb}` is a command of the pdmask-lab distribution, which is not installed; "
            "install it from a pdmask checkout: pip install -e ./lab")


def _lab_missing(verb: str):
    """A hidden command standing for a lab verb: any arguments, one line, exit code 2."""

    def command():  # its arguments (any) are left unparsed: allow_extra_args, ignore_unknown_options
        typer.echo(lab_missing_line(verb), err=True)
        raise typer.Exit(2)

    command.__doc__ = f"`pdmask {verb}` (needs pdmask-lab)."
    return command


def command_plugins():
    """The entry points of :data:`COMMANDS_GROUP` (a function: tests replace it)."""
    from importlib.metadata import entry_points

    return list(entry_points(group=COMMANDS_GROUP))


def register_plugins(app: typer.Typer) -> None:
    """Let every installed ``pdmask.commands`` entry point add its verbs; one that fails to load
    is one warning line on stderr (``pdmask train`` must not break because of it); then a hidden
    stand-in for each lab verb that is still missing, and the verbs in :data:`HELP_ORDER`."""
    for ep in command_plugins():
        try:
            ep.load()(app)
        except Exception as e:  # noqa: BLE001  (a broken plugin: any error, one line)
            if os.environ.get("PDMASK_TRACEBACK"):
                raise
            typer.echo(f"warning: the pdmask commands of {ep.value} ({COMMANDS_GROUP} entry point {ep.name!r}) "
                       f"did not load: {type(e).__name__}: {user_message(e)}", err=True)
    have = {c.name or c.callback.__name__ for c in app.registered_commands}
    for verb in LAB_COMMANDS:
        if verb not in have:
            app.command(verb, hidden=True, add_help_option=False,
                        context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                                          "help_option_names": []})(_lab_missing(verb))
    rank = {v: i for i, v in enumerate(HELP_ORDER)}
    app.registered_commands.sort(key=lambda c: rank.get(c.name or c.callback.__name__, len(rank)))


if __name__ != "__main__":  # `python -m pdmask.cli` runs the imported module's app (end of file)
    register_plugins(app)
    # every command, the plugins' included, reports user errors as one line (exit code 2)
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
    # `python -m pdmask.cli`: this file runs as __main__, a module of its own; the app with the
    # plugins' verbs is the one of the imported pdmask.cli (the module the plugins import helpers from)
    from pdmask.cli import main as _main

    _main()
    sys.exit(0)
