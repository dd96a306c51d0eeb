#!/usr/bin/env bash
# Release check: build the sdist and the wheel (python -m build: an isolated build environment
# with setuptools from the package index), then install the wheel -- not the checkout -- in a
# fresh virtual environment (torch 2.13.0 CPU first, held by the constraint of make_venv) and
# use it from outside the source tree: `import pdmask`, the package data, the `pdmask` entry point.
# A release is then one upload of dist/* away.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS
. .ci/_venv.sh
TMP=$(mktemp -d)            # the build and install venvs (and dist/, unless PDMASK_DIST_DIR is set)
trap 'rm -rf "$TMP"' EXIT
OUT=${PDMASK_DIST_DIR:-$TMP/dist}
rm -rf "$OUT" && mkdir -p "$OUT"

# 1. build (in its own venv: `build` is not a dependency of pdmask)
BUILD_VENV=$TMP/build-venv
python3 -m venv "$BUILD_VENV"
"$BUILD_VENV/bin/python" -m pip install -q --disable-pip-version-check build
"$BUILD_VENV/bin/python" -m build --sdist --wheel --outdir "$OUT" . > "$OUT/build.log" 2>&1 \
  || { tail -30 "$OUT/build.log" >&2; exit 1; }
rm -rf build src/pdmask.egg-info  # setuptools' leftovers in the checkout
WHEEL=$(ls "$OUT"/pdmask-*.whl)
SDIST=$(ls "$OUT"/pdmask-*.tar.gz)
echo "built: $(basename "$SDIST") $(basename "$WHEEL")"

# 2. what the wheel holds: the package and its typed marker, no tests, the console script
"$BUILD_VENV/bin/python" - "$WHEEL" <<'EOF'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
assert "pdmask/__init__.py" in names and "pdmask/py.typed" in names, "package files missing"
assert not [n for n in names if n.startswith("tests/")], "tests/ in the wheel"
ep = [n for n in names if n.endswith("entry_points.txt")]
text = zipfile.ZipFile(sys.argv[1]).read(ep[0]).decode()
assert "pdmask = pdmask.cli:main" in text, text
assert "pdmask = pdmask.integrations.verl.plugin" in text, text
print(f"wheel: {len(names)} files, console script and verl plugin entry points present")
EOF

# 3. install the wheel (with the train extra: the CLI needs typer) in a fresh venv and use it
make_venv "${PDMASK_WHEEL_VENV:-$TMP/venv}"
inst "pdmask[train] @ file://${WHEEL}"
mkdir "$TMP/run" && cd "$TMP/run"   # outside the checkout: nothing can come from src/
"$PY" -c "import pdmask, torch; assert 'site-packages' in pdmask.__file__, pdmask.__file__; \
print('pdmask', pdmask.__file__, '| torch', torch.__version__, '| modes', len(pdmask.MODES))"
"$VENV/bin/pdmask" --help > help.txt
grep -q "train" help.txt && grep -q "compare" help.txt || { cat help.txt >&2; echo "pdmask --help lacks its commands" >&2; exit 1; }
echo "pdmask --help: ok"
echo "wheel CI total: $((SECONDS - t0)) s"
