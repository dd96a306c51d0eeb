#!/usr/bin/env bash
# CI for pdmask.ops: a fresh venv WITH triton, so the Triton kernel tests run in Triton's CPU
# interpreter and the kernels are compiled for sm_80/sm_90 (no GPU needed). The main CI
# (.ci/run, no triton) runs the same directory with those tests skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${PDMASK_OPS_CI_VENV:-/tmp/pdmask-ops-ci-venv}
rm -rf "$VENV"
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q torch==2.13.0          # first: the CPU wheel, never a CUDA build
"$VENV/bin/python" -m pip install -q -e ".[test,triton]" numpy  # numpy: Triton's interpreter needs it
"$VENV/bin/python" -m pytest tests/ops -q -rs
