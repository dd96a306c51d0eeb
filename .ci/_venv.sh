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
