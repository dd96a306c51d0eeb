#!/usr/bin/env bash
# LoRA in the built-in trainer (the `lora` extra: peft) and the tests that need it
# (tests/train/test_trainable.py; in the main environment, without peft, its LoRA tests skip).
# A skip fails the step: here it would mean peft did not install.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS
. .ci/_venv.sh
make_venv "${PDMASK_LORA_VENV:-$(mktemp -d)/venv}"
# ./lab: test_trainable.py uses the audit's helpers (pdmask_lab.audit), the pdmask-lab distribution
inst -e ".[train,lora,test]" -e ./lab -c constraints/lora.txt  # pinned (constraints/lora.txt)
"$PY" -c "import peft; print('peft', peft.__version__)"
PDMASK_CACHE="$(mktemp -d)" OMP_NUM_THREADS=2 pytest_no_skip lora tests/train/test_trainable.py -W ignore::DeprecationWarning
echo "lora CI total: $((SECONDS - t0)) s"
