"""Session-wide fixtures shared by every test directory."""

import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.numerics import one_thread as _one_thread

REPO = Path(__file__).resolve().parents[1]
ENV_KEYS = {"packages", "python", "cpu_capability", "cpu_model", "cpu_count", "threads", "torch_threads", "os",
            "machine", "env", "git", "executable"}


def _check_environment(env: dict, *, threads) -> None:
    """``env`` is :func:`pdmask.train.environment.environment` of this checkout on this
    machine, checked against the real values (not only the keys)."""
    import numpy
    import torch

    assert ENV_KEYS <= set(env), sorted(ENV_KEYS - set(env))
    pk = env["packages"]
    assert set(pk) == {"torch", "transformers", "tokenizers", "numpy", "safetensors"}
    assert pk["torch"] == torch.__version__ and pk["numpy"] == numpy.__version__
    for name in ("transformers", "tokenizers", "safetensors"):
        mod = pytest.importorskip(name)
        assert pk[name] == mod.__version__, name
    assert env["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert env["python"] == platform.python_version() and env["os"] == platform.platform()
    assert env["threads"] == threads and env["torch_threads"] >= 1
    if Path("/proc/cpuinfo").exists():
        assert env["cpu_model"] and env["cpu_model"] in Path("/proc/cpuinfo").read_text()
    sha = None
    if shutil.which("git") and (REPO / ".git").exists():
        p = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
        sha = p.stdout.strip() if p.returncode == 0 else None
    assert env["git"]["commit"] == sha
    assert (env["git"]["dirty"] is None) == (sha is None)


@pytest.fixture
def one_thread():
    """Pins torch to one intra-op thread for the test and restores the count after: a test
    asking for bitwise equality of two runs of the same operations uses it (see
    tests/numerics.py), since several threads may order a reduction differently."""
    with _one_thread():
        yield


@pytest.fixture(scope="session")
def check_environment():
    """``check_environment(env, threads=N)``: the recorded environment is this machine's."""
    return _check_environment


@pytest.fixture(scope="session")
def smoke_cache(tmp_path_factory):
    """The one SFT cache of the session: every run of the smoke preset (train, hardening,
    audit) trains its SFT base once and then reads it from here (the cache is
    content-addressed, so other settings add their own entry beside it)."""
    return tmp_path_factory.mktemp("sft-cache")


@pytest.fixture(scope="session")
def smoke_config():
    """configs/smoke.yaml, the tiny end-to-end preset."""
    return REPO / "configs" / "smoke.yaml"
