#!/usr/bin/env bash
# TRL integration tests in their own, freshly created environment.
#   bash .ci/trl.sh            (from the repository root)
# Creates a venv from scratch, installs torch==2.13.0 (CPU) first so nothing pulls a CUDA
# torch, then pdmask with the [trl,test] extras, and runs tests/integrations (slow tests
# included: the two-process torchrun/gloo run). Exits non-zero on any failure.
# Installs go through uv when it can be installed (parallel downloads: ~15 s instead of
# ~200 s with pip on a 2-core machine); pip otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
VENV="${PDMASK_TRL_VENV:-$(mktemp -d)/venv}"
rm -rf "$VENV"
python3 -m venv "$VENV"
PY="$VENV/bin/python"
FIND_LINKS=()
[ -d /opt/wheels ] && FIND_LINKS=(--find-links /opt/wheels)  # local torch wheel, where the machine has one
if "$PY" -m pip install -q --disable-pip-version-check uv; then
  inst() { "$VENV/bin/uv" pip install -q --python "$PY" "${FIND_LINKS[@]}" "$@"; }
else
  inst() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }
fi
inst torch==2.13.0
inst torch==2.13.0 ".[trl,test]"
rm -rf build src/pdmask.egg-info  # build leftovers of the non-editable install
"$PY" -c "import torch, trl, transformers, accelerate; print('torch', torch.__version__, '| trl', trl.__version__, '| transformers', transformers.__version__, '| accelerate', accelerate.__version__)"
echo "setup: $(( $(date +%s) - start )) s"
# -rs: every skip prints its reason
OMP_NUM_THREADS=1 "$PY" -m pytest tests/integrations -rs -p no:cacheprovider -W ignore::FutureWarning
echo "trl.sh total: $(( $(date +%s) - start )) s"
