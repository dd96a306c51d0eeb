"""The trainer's registered forwards: the pdm-batch-* modes train only once the lab's batch
mask has registered its forward, and a config naming one without it is refused in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(SRC)})


def test_a_batch_mode_without_the_lab_is_refused_naming_mode():
    r = _run("from pdmask.train.config import load_config\n"
             "try:\n    load_config(None, ['mode=pdm-batch-topk-kl'])\n"
             "except ValueError as e:\n    print(e)\n")
    assert r.returncode == 0, r.stderr
    # the lab registers the batch modes: without it the name is not a registered mode
    assert r.stdout.startswith("mode: unknown value 'pdm-batch-topk-kl'; valid values are: ") and \
        "pdm-topk-kl" in r.stdout
    assert "pdmask_lab.batchmask" in r.stdout


def test_importing_the_lab_registers_the_batch_forward():
    r = _run("import pdmask_lab.batchmask\n"
             "from pdmask.train.config import load_config\n"
             "from pdmask.train.forwards import FORWARDS, forward_for\n"
             "cfg = load_config(None, ['mode=pdm-batch-topk-kl'])\n"
             "print(sorted(FORWARDS), forward_for(cfg.loss.mode).forward.__module__, forward_for('pdm-topk-kl'))\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["['ddot_batch']", "pdmask_lab.batchmask.trainer", "None"]


def test_the_registered_check_refuses_a_bad_batch_method():
    pytest.importorskip("pdmask_lab.batchmask")
    import pdmask_lab.batchmask  # noqa: F401
    from pdmask.train.config import load_config

    with pytest.raises(ValueError, match=r"^batch_method: unknown value 'fast'; valid values are: auto, jvp"):
        load_config(None, ["batch_method=fast"])
