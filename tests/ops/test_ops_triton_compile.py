"""The Triton kernels compile for real GPUs (sm_80, sm_90) down to a cubin, on a machine
without one: catches compiler-only errors the interpreter tests cannot see. Runs in a
fresh process because the interpreter tests import triton in interpreter mode."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="needs the optional 'triton' package (pip install -e '.[triton]')")


@pytest.mark.parametrize("arch", [80, 90])
def test_kernels_compile_to_cubin(arch):
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
            f"from triton_compile import compile_check\nprint('\\n'.join(compile_check({arch})))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 9 and all("bytes" in ln for ln in lines), r.stdout
