"""pdmask.train.environment: the one environment record every result file carries.

That each writer records it (with this machine's real values) is tested where the files are
written: test_cli_runs (a run's summary.json, report's summary), test_compare (compare's
summary.json / summary.md), test_ladder (ladder.json / ladder.md), tests/audit (audit.json).
"""

import json
import subprocess

import torch

from pdmask.train import environment as E


def test_record_is_json_safe_and_this_machines(check_environment):
    env = E.environment(3)
    assert json.loads(json.dumps(env)) == env
    check_environment(env, threads=3)
    assert env["torch_threads"] == torch.get_num_threads()


def test_no_git_or_no_checkout_is_null_not_an_error(tmp_path, monkeypatch):
    assert E.git_state(tmp_path) == {"commit": None, "dirty": None}  # not a checkout
    sub = tmp_path / "repo" / "src"  # inside a checkout, but not its top: says nothing about this code
    sub.mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(tmp_path / "repo")], check=True)
    assert E.git_state(sub) == {"commit": None, "dirty": None}

    def no_git(*a, **k):
        raise FileNotFoundError("git")

    monkeypatch.setattr(E.subprocess, "run", no_git)
    assert E.git_state() == {"commit": None, "dirty": None}
    assert E.environment()["git"] == {"commit": None, "dirty": None}


def test_dirty_flag(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "a.txt").write_text("1")
    subprocess.run([*git, "add", "a.txt"], check=True)
    subprocess.run([*git, "commit", "-qm", "a"], check=True)
    sha = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    (repo / "untracked.txt").write_text("run output")
    assert E.git_state(repo) == {"commit": sha, "dirty": False}  # untracked files do not count
    (repo / "a.txt").write_text("2")
    assert E.git_state(repo) == {"commit": sha, "dirty": True}


def test_missing_cpuinfo_and_packages(monkeypatch):
    monkeypatch.setattr("builtins.open", lambda *a, **k: (_ for _ in ()).throw(OSError("no /proc")))
    assert E.cpu_model() == (E.platform.processor() or None)
    assert E.package_version("surely-not-an-installed-package") is None


def test_one_line_and_groups():
    env = E.environment(1) | {"git": {"commit": "0123456789abcdef", "dirty": True}, "env": {"ATEN_CPU_CAPABILITY": "avx2"}}
    line = E.one_line(env)
    assert line.startswith(f"Environment: torch {torch.__version__}, ") and "commit 0123456789ab (dirty)" in line
    assert "1 torch thread(s) per run" in line and line.endswith("ATEN_CPU_CAPABILITY=avx2.")
    assert E.one_line(None) == "Environment: not recorded."
    assert E.one_line(env | {"source": "the runs"}) == line
    assert E.one_line(env | {"source": "the process that wrote this summary"}).startswith(
        "Environment (that of the process that wrote this summary): torch ")
    g = E.runs_environments([{"run": "a", "environment": env}, {"run": "b"}, {"run": "c", "environment": env}])
    assert g == [{"environment": env, "runs": ["a", "c"]}, {"environment": None, "runs": ["b"]}]
    assert "2 different environments" in E.environments_line(g) and E.environments_line(g[:1]) == ""
