#!/usr/bin/env bash
# TRL integration tests (tests/integrations, incl. the two-process torchrun/gloo run) in their
# own environment: TRL 1.16 and its transformers/accelerate/datasets ranges.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS
. .ci/_venv.sh
make_venv "${PDMASK_TRL_VENV:-$(mktemp -d)/venv}"
inst ".[trl,test]"
rm -rf build src/pdmask.egg-info  # build leftovers of the non-editable install
"$PY" -c "import torch, trl, transformers, accelerate; print('torch', torch.__version__, '| trl', trl.__version__, '| transformers', transformers.__version__, '| accelerate', accelerate.__version__)"
echo "trl env: $((SECONDS - t0)) s"
# the TRL tests (tests/integrations/verl runs in .ci/verl.sh); a skip fails the step: here it
# would mean TRL did not import
OMP_NUM_THREADS=1 pytest_no_skip TRL tests/integrations --ignore=tests/integrations/verl -W ignore::FutureWarning
echo "trl CI total: $((SECONDS - t0)) s"
