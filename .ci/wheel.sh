#!/usr/bin/env bash
# Release check: build the sdist and the wheel of both distributions (python -m build: an
# isolated build environment with setuptools from the package index): pdmask (the library, the
# repository root) and pdmask-lab (the research lab, lab/), then install the wheels -- not the
# checkout -- in a fresh virtual environment (torch 2.13.0 CPU first, held by the constraint of
# make_venv) and use them from outside the source tree: the library alone first (`import pdmask`,
# the package data, the `pdmask` entry point, a lab verb answering with its one line), then with
# the lab added (the lab's verbs on `pdmask`, `import pdmask_lab`). A release is then one upload
# of dist/* away.
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
for d in . lab; do
  "$BUILD_VENV/bin/python" -m build --sdist --wheel --outdir "$OUT" "$d" > "$OUT/build.log" 2>&1 \
    || { tail -30 "$OUT/build.log" >&2; exit 1; }
done
rm -rf build src/pdmask.egg-info lab/build lab/src/pdmask_lab.egg-info  # setuptools' leftovers in the checkout
WHEEL=$(ls "$OUT"/pdmask-[0-9]*.whl)
SDIST=$(ls "$OUT"/pdmask-[0-9]*.tar.gz)
LAB_WHEEL=$(ls "$OUT"/pdmask_lab-*.whl)
LAB_SDIST=$(ls "$OUT"/pdmask_lab-*.tar.gz)
echo "built: $(basename "$SDIST") $(basename "$WHEEL") $(basename "$LAB_SDIST") $(basename "$LAB_WHEEL")"

# 2. what the files hold: the pdmask wheel the library and its typed marker, no lab module (old
#    name or new), no tests, the console script; the pdmask-lab wheel its package only, its
#    dependency on this pdmask and the pdmask.commands entry point; each sdist its own package
"$BUILD_VENV/bin/python" - "$WHEEL" "$LAB_WHEEL" "$SDIST" "$LAB_SDIST" <<'PY'
import sys, tarfile, zipfile
wheel, lab_wheel, sdist, lab_sdist = sys.argv[1:]


def member(zf, suffix):
    return zf.read(next(n for n in zf.namelist() if n.endswith(suffix))).decode()


zf = zipfile.ZipFile(wheel)
names = zf.namelist()
assert "pdmask/__init__.py" in names and "pdmask/py.typed" in names, "package files missing"
assert not [n for n in names if n.startswith("tests/")], "tests/ in the wheel"
lab = [n for n in names if n.startswith(("pdmask/lab/", "pdmask_lab"))]
assert not lab, f"lab files in the pdmask wheel: {lab[:5]}"
text = member(zf, ".dist-info/entry_points.txt")
assert "pdmask = pdmask.cli:main" in text, text
assert "pdmask = pdmask.integrations.verl.plugin" in text, text
lz = zipfile.ZipFile(lab_wheel)
lab_names = lz.namelist()
assert {"pdmask_lab/__init__.py", "pdmask_lab/audit/runner.py", "pdmask_lab/py.typed"} <= set(lab_names), "lab files missing"
stray = [n for n in lab_names if not n.startswith(("pdmask_lab/", "pdmask_lab-"))]
assert not stray, f"files outside pdmask_lab in the lab wheel: {stray[:5]}"
lab_ep = member(lz, ".dist-info/entry_points.txt")
assert "[pdmask.commands]" in lab_ep and "lab = pdmask_lab.cli:register" in lab_ep, lab_ep
assert "Requires-Dist: pdmask[train]==0.1.0" in member(lz, ".dist-info/METADATA"), "the lab's dependency on pdmask"
in_sdist = tarfile.open(sdist).getnames()
assert not [n for n in in_sdist if "pdmask_lab" in n or "/lab/" in n], "lab files in the pdmask sdist"
assert [n for n in tarfile.open(lab_sdist).getnames() if n.endswith("pdmask_lab/regime.py")], "lab sdist lacks its package"
print(f"wheels: pdmask {len(names)} files, no lab file; pdmask-lab {len(lab_names)} files; entry points present")
PY

# 3. the library alone (with the train extra: the CLI needs typer) in a fresh venv, used from
#    outside the checkout: nothing can come from src/ or lab/src/
make_venv "${PDMASK_WHEEL_VENV:-$TMP/venv}"
inst "pdmask[train] @ file://${WHEEL}"
mkdir "$TMP/run" && cd "$TMP/run"
"$PY" -c "import pdmask, torch; assert 'site-packages' in pdmask.__file__, pdmask.__file__; \
print('pdmask', pdmask.__file__, '| torch', torch.__version__, '| modes', len(pdmask.MODES))"
"$PY" -c "import importlib.util as u, sys; sys.exit('pdmask_lab importable without pdmask-lab' if u.find_spec('pdmask_lab') else 0)"
"$VENV/bin/pdmask" --help > help.txt
grep -q "│ train " help.txt && grep -q "│ model " help.txt || { cat help.txt >&2; echo "pdmask --help lacks its commands" >&2; exit 1; }
if grep -q "│ ladder " help.txt; then cat help.txt >&2; echo "pdmask --help lists ladder without pdmask-lab" >&2; exit 1; fi
rc=0
"$VENV/bin/pdmask" ladder --spec ladder > out.txt 2> err.txt || rc=$?
if [ "$rc" -ne 2 ] || [ "$(wc -l < err.txt)" -ne 1 ] || ! grep -q "pip install -e ./lab" err.txt || [ -s out.txt ]; then
  cat out.txt err.txt >&2; echo "pdmask ladder without pdmask-lab: exit $rc; expected one line and exit 2" >&2; exit 1
fi
if "$PY" -c "import pdmask.lab" 2> err.txt; then echo "import pdmask.lab succeeded" >&2; exit 1; fi
grep -q "moved to the pdmask-lab distribution: import pdmask_lab" err.txt || { cat err.txt >&2; exit 1; }
echo "pdmask alone: --help without the lab's verbs; 'pdmask ladder': one line, exit 2; 'import pdmask.lab' names pdmask_lab"

# 4. the lab's wheel added (its dependency, pdmask[train]==0.1.0, is the wheel above): its verbs
#    on `pdmask`, its modules imported from site-packages
inst "pdmask[train] @ file://${WHEEL}" "pdmask-lab @ file://${LAB_WHEEL}"
"$PY" -c "import pdmask_lab, pdmask_lab.regime, pdmask_lab.audit.runner; \
assert 'site-packages' in pdmask_lab.__file__, pdmask_lab.__file__; print('pdmask_lab', pdmask_lab.__file__)"
"$VENV/bin/pdmask" --help > help.txt
for verb in train compare report task-stats ladder model audit audit-grid; do
  grep -q "│ $verb " help.txt || { cat help.txt >&2; echo "pdmask --help lacks $verb with pdmask-lab" >&2; exit 1; }
done
"$VENV/bin/pdmask" ladder --help > /dev/null
echo "pdmask + pdmask-lab: --help lists the lab's verbs, pdmask_lab imports: ok"
echo "wheel CI total: $((SECONDS - t0)) s"
