"""The lab's verbs on the ``pdmask`` command: pdmask-lab adds them through the entry-point group
``pdmask.commands`` (lab/pyproject.toml); without it each answers with one line and exit code 2,
and a broken plugin is one warning line that leaves ``pdmask train`` working (issue 42)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("typer")

REPO = Path(__file__).resolve().parents[2]
LAB_VERBS = ["compare", "report", "task-stats", "ladder", "audit", "audit-grid"]

#: A driver that replaces the entry-point discovery before pdmask.cli is imported, then runs the
#: command line of argv[2:]: argv[1] is "none" (no plugin: the lab not installed) or "broken"
#: (the lab's entry point, pointing at a module that does not import).
DRIVER = """
import sys, importlib.metadata as md
real = md.entry_points
def entry_points(**kw):
    if kw.get("group") != "pdmask.commands":
        return real(**kw)
    if sys.argv[1] == "none":
        return []
    return [md.EntryPoint("lab", "pdmask_lab_gone.cli:register", "pdmask.commands")]
md.entry_points = entry_points
from pdmask.cli import main
main(sys.argv[2:])
"""


def _run(mode: str, *args: str):
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    env.pop("PDMASK_TRACEBACK", None)
    return subprocess.run([sys.executable, "-c", DRIVER, mode, *args], capture_output=True, text=True, env=env,
                          timeout=120)


def test_with_the_lab_help_lists_its_verbs_in_the_usual_order(capsys):
    pytest.importorskip("pdmask_lab")
    from pdmask.cli import HELP_ORDER, LAB_COMMANDS, app, main
    from pdmask_lab.cli import COMMANDS

    assert COMMANDS == LAB_COMMANDS
    names = [c.name or c.callback.__name__ for c in app.registered_commands]
    assert names == list(HELP_ORDER)
    modules = {n: c.callback.__wrapped__.__module__ for n, c in zip(names, app.registered_commands)}
    assert [v for v in LAB_COMMANDS if not modules[v].startswith("pdmask_lab.")] == []
    assert modules["train"] == modules["model"] == "pdmask.cli"
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    pos = [out.index(f"│ {v} ") for v in HELP_ORDER]
    assert pos == sorted(pos), out


@pytest.mark.parametrize("args", [["ladder"], ["ladder", "--spec", "configs/ladder.yaml", "--jobs", "2"],
                                  ["audit", "--help"], *[[v, "--bogus", "x"] for v in LAB_VERBS]],
                         ids=lambda a: " ".join(a))
def test_without_the_lab_each_verb_is_one_line_naming_it_and_the_install(args):
    r = _run("none", *args)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert lines == [f"error: `pdmask {args[0]}` is a command of the pdmask-lab distribution, which is not "
                     "installed; install it from a pdmask checkout: pip install -e ./lab"], r.stderr


def test_without_the_lab_help_lists_the_library_verbs_only_and_train_works(tmp_path):
    r = _run("none", "--help")
    assert r.returncode == 0 and r.stderr == ""
    assert "train" in r.stdout and "model" in r.stdout
    assert not [v for v in LAB_VERBS if f"│ {v} " in r.stdout], r.stdout
    r = _run("none", "train", "--help")
    assert r.returncode == 0 and "--help-config" in r.stdout and r.stderr == ""
    r = _run("none", "train", "group_size=1")  # a user error of train: still its own one line
    assert r.returncode == 2 and r.stderr.startswith("error: group_size:"), r.stderr


def test_a_broken_lab_entry_point_is_one_warning_and_train_still_works():
    r = _run("broken", "train", "--help")
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 0 and "--help-config" in r.stdout, r.stderr
    assert len(lines) == 1 and lines[0].startswith("warning: the pdmask commands of pdmask_lab_gone.cli:register")
    assert "ModuleNotFoundError" in lines[0] and "Traceback" not in r.stderr
    r = _run("broken", "ladder", "--plan")
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 2 and lines[1].startswith("error: `pdmask ladder` is a command of"), \
        r.stderr
