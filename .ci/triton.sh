#!/usr/bin/env bash
# The fused Triton kernels in Triton's CPU interpreter (and the sm_80/sm_90 compile checks)
# in their own environment: the optional `triton` extra on top of the main install.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS
. .ci/_venv.sh
make_venv "${PDMASK_TRITON_VENV:-$(mktemp -d)/venv}"
inst -e ".[train,test,triton]" -c constraints/triton.txt  # pinned (constraints/triton.txt)
"$PY" -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__)"
echo "triton env: $((SECONDS - t0)) s"
# the kernel tests only (the rest of tests/ops ran in the main environment)
pytest_no_skip Triton tests/ops/test_ops_triton.py tests/ops/test_ops_triton_compile.py
echo "triton CI total: $((SECONDS - t0)) s"
