import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="trainer tests need the 'train' extra (transformers)")
pytest.importorskip("tokenizers", reason="trainer tests need the 'train' extra (tokenizers)")

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "configs" / "smoke.yaml"


@pytest.fixture(scope="session")
def cache_dir(smoke_cache):
    """The session's one SFT cache (tests/conftest.py)."""
    return smoke_cache


@pytest.fixture(scope="session")
def cli():
    """(run_cli, popen_cli): run ``python -m pdmask.cli`` with this checkout's sources."""
    return run_cli, popen_cli


def run_cli(args, *, cwd, timeout=240, check=True):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-m", "pdmask.cli", *map(str, args)], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"pdmask {' '.join(map(str, args))} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


def popen_cli(args, *, cwd):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.Popen([sys.executable, "-m", "pdmask.cli", *map(str, args)], cwd=cwd, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
