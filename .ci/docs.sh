#!/usr/bin/env bash
# The documentation site (mkdocs.yml: docs/*.md and the API reference mkdocstrings generates from
# the docstrings) built with `mkdocs build --strict` in its own environment (constraints/docs.txt,
# every version pinned; no torch: the sources are read statically), so a broken link, a missing
# anchor or a name the API reference cannot find fails CI.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS
VENV="${PDMASK_DOCS_VENV:-$(mktemp -d)/venv}"
rm -rf "$VENV"
python3 -m venv "$VENV"
if "$VENV/bin/python" -m pip install -q --disable-pip-version-check uv; then
  "$VENV/bin/uv" pip install -q --python "$VENV/bin/python" -r constraints/docs.txt
else
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r constraints/docs.txt
fi
echo "docs env: $((SECONDS - t0)) s"
SITE=$(mktemp -d)
NO_MKDOCS_2_WARNING=1 "$VENV/bin/mkdocs" build --strict --site-dir "$SITE"
test -s "$SITE/index.html" && test -s "$SITE/api/index.html"
rm -rf "$SITE"
echo "docs CI total: $((SECONDS - t0)) s"
