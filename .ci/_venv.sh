# Sourced by the CI scripts: make_venv DIR creates a fresh virtual environment and defines
# `inst ARGS...` to install into it. torch==2.13.0 (the CPU wheel on the machine's disk) is
# installed first and held by a constraints file, so no dependency can swap in a CUDA build.
# Installs go through uv when it can be installed (parallel downloads: seconds instead of
# minutes on a 2-core machine), else pip.
make_venv() {
  VENV=$1
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  PY="$VENV/bin/python"
  CONSTRAINTS="$VENV/torch-constraint.txt"
  echo "torch==2.13.0" > "$CONSTRAINTS"
  FIND_LINKS=()
  [ -d /opt/wheels ] && FIND_LINKS=(--find-links /opt/wheels)
  if "$PY" -m pip install -q --disable-pip-version-check uv; then
    inst() { "$VENV/bin/uv" pip install -q --python "$PY" "${FIND_LINKS[@]}" -c "$CONSTRAINTS" "$@"; }
  else
    inst() { "$PY" -m pip install -q --disable-pip-version-check -c "$CONSTRAINTS" "$@"; }
  fi
  inst torch==2.13.0
  "$PY" -c "import torch, sys; v = torch.__version__; sys.exit(0 if v.startswith('2.13.0') and 'cu' not in v else f'wrong torch {v}')"
}

# pytest_no_skip LABEL PYTEST-ARGS...: run pytest with the venv's python; a skipped test
# fails the step too -- in an extra's own environment a skip means the extra did not import,
# and the step would otherwise pass vacuously.
pytest_no_skip() {
  local label=$1 log rc
  shift
  log=$(mktemp)
  set +e
  "$PY" -m pytest -rs -p no:cacheprovider "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  set -e
  if [ "$rc" -eq 0 ] && grep -qE "[0-9]+ skipped" "$log"; then
    echo "$label tests were skipped in the $label CI environment" >&2
    rc=1
  fi
  rm -f "$log"
  return "$rc"
}
