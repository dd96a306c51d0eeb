"""The environment a result was computed in: one JSON-safe record for every writer.

Runs on CPU are bitwise reproducible only in the same environment (docs/trainer.md,
"Determinism"): the same versions of the packages that do the arithmetic, the same CPU
capability (the vector kernels ATen dispatches to) and the same number of threads. Every
file that reports numbers records this dict (a run's ``summary.json``, a compare's
``summary.json`` / ``summary.md``, the ladder's ``ladder.json`` / ``ladder.md``, the
audit's ``audit.json``), so a difference between two results can be traced to the
environment or ruled out.

Nothing here may fail: a missing package, ``/proc/cpuinfo`` or ``git`` (or a source tree
that is not a git checkout) is recorded as ``None``.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

import torch

#: the packages whose versions decide the numbers (besides python)
PACKAGES = ("torch", "transformers", "tokenizers", "numpy", "safetensors")
#: environment variables that change the arithmetic or the threads
ENV_VARS = ("ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUBLAS_WORKSPACE_CONFIG")
#: the source tree this module belongs to (src/pdmask/train/environment.py -> the checkout)
SOURCE_ROOT = Path(__file__).resolve().parents[3]


def package_version(name: str) -> str | None:
    """The installed version of ``name``, None when it is not installed."""
    if name == "torch":
        return torch.__version__
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def cpu_model() -> str | None:
    """The CPU's ``model name`` from /proc/cpuinfo (Linux), else ``platform.processor()``, else None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def cpu_capability() -> str | None:
    """``torch.backends.cpu.get_cpu_capability()`` (e.g. ``AVX512``, ``AVX2``), None if unavailable."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # noqa: BLE001 -- an old torch or an exotic build: record, never fail
        return None


def _git(root: Path, *args: str) -> str | None:
    try:
        p = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout if p.returncode == 0 else None


def git_state(root: str | Path = SOURCE_ROOT) -> dict:
    """``{"commit": sha | None, "dirty": bool | None}`` of the checkout at ``root``.

    None for both when git is absent or ``root`` is not the top of a git checkout (an
    installed wheel: site-packages may sit inside some other repository, which says nothing
    about this code). ``dirty``: tracked files differ from the commit (untracked files,
    such as run outputs, are not counted)."""
    root = Path(root)
    top = _git(root, "rev-parse", "--show-toplevel")
    if top is None or Path(top.strip()).resolve() != root.resolve():
        return {"commit": None, "dirty": None}
    sha = _git(root, "rev-parse", "HEAD")
    status = _git(root, "status", "--porcelain", "--untracked-files=no")
    return {"commit": sha.strip() if sha else None, "dirty": None if status is None else bool(status.strip())}


def environment(threads: int | None = None, *, root: str | Path = SOURCE_ROOT) -> dict:
    """The environment of this process, JSON-safe.

    ``threads``: the configured torch threads of the runs the record describes (the
    config's ``threads``); ``torch_threads`` is ``torch.get_num_threads()`` of this
    process, which differs where a parent process (compare, ladder) records it for runs
    that set their own."""
    return {
        "packages": {name: package_version(name) for name in PACKAGES},
        "python": platform.python_version(),
        "cpu_capability": cpu_capability(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "threads": threads,
        "torch_threads": torch.get_num_threads(),
        "os": platform.platform(),
        "machine": platform.machine(),
        "env": {k: os.environ.get(k) for k in ENV_VARS if os.environ.get(k) is not None},
        "git": git_state(root),
        # the interpreter's name and whether it is a venv's, not its path (records hold no machine path)
        "executable": Path(sys.executable).name + (" (venv)" if sys.prefix != sys.base_prefix else ""),
    }


def one_line(env: dict | None) -> str:
    """The environment as one sentence (for summary.md / ladder.md)."""
    if not env:
        return "Environment: not recorded."
    pk = env.get("packages") or {}
    vers = ", ".join(f"{k} {v}" for k, v in pk.items() if v is not None)
    g = env.get("git") or {}
    commit = "no git commit" if not g.get("commit") else \
        f"commit {g['commit'][:12]}{' (dirty)' if g.get('dirty') else ''}"
    thr = env.get("threads")
    thr = f"{thr} torch thread(s) per run" if thr is not None else f"{env.get('torch_threads')} torch thread(s)"
    extra = "; " + ", ".join(f"{k}={v}" for k, v in env["env"].items()) if env.get("env") else ""
    src = f" (that of {env['source']})" if env.get("source") and env["source"] != "the runs" else ""
    return (f"Environment{src}: {vers}; python {env.get('python')}; CPU capability {env.get('cpu_capability')}, "
            f"{thr}, {env.get('cpu_model')} ({env.get('cpu_count')} CPUs); {env.get('os')}; {commit}{extra}.")


def runs_environments(summaries: list[dict]) -> list[dict]:
    """The distinct environments recorded in run summaries: ``[{"environment": env | None,
    "runs": [run names]}]``, in order of first appearance (``None``: runs written before
    environments were recorded)."""
    out: list[dict] = []
    for s in summaries:
        env = s.get("environment")
        for e in out:
            if e["environment"] == env:
                e["runs"].append(s.get("run"))
                break
        else:
            out.append({"environment": env, "runs": [s.get("run")]})
    return out


def environments_line(groups: list[dict]) -> str:
    """One sentence on the runs' environments when they are not all one (else empty)."""
    if len(groups) <= 1:
        return ""
    return (f"The runs were computed in {len(groups)} different environments "
            f"(summary.json `runs_environments`); their numbers are not bitwise comparable.")


@contextmanager
def torch_threads(n: int, *, keep: bool = False):
    """torch's CPU thread count is ``n`` inside the block and the caller's again after it, so a
    library call never leaves the process changed. ``keep=True``: a block that ends normally
    leaves ``n`` (a command whose next work runs at the config's count). Naive equivalent:
    ``before = torch.get_num_threads(); torch.set_num_threads(n); ...; torch.set_num_threads(before)``."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    ended = False
    try:
        yield
        ended = True
    finally:
        if not (keep and ended):
            torch.set_num_threads(before)
