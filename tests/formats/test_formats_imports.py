"""pdmask.formats sits below the engines and the plugins: it imports none of them.

Read from the source (every import statement, including the ones inside functions), so a
lazy import that would only run on some path is caught too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

FORMATS = Path(__file__).resolve().parents[2] / "src" / "pdmask" / "formats"
FORBIDDEN = ("pdmask.engine", "pdmask.train", "pdmask_lab", "pdmask.integrations")


def imported_modules(path: Path) -> list[str]:
    """Absolute names of the modules a file of pdmask.formats imports."""
    package = "pdmask.formats"
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module
            # `from pdmask import engine` imports the module pdmask.engine
            names += [mod] + [f"{mod}.{a.name}" for a in node.names]
    return names


def test_resolves_relative_imports():
    """The resolver itself: a test that cannot see an import would pass vacuously."""
    src = FORMATS / "sglang.py"
    names = imported_modules(src)
    assert "pdmask.formats.topk" in names and "pdmask.formats.vllm" in names and "torch" in names


@pytest.mark.parametrize("path", sorted(FORMATS.glob("*.py")), ids=lambda p: p.name)
def test_formats_import_no_engine_trainer_audit_or_plugin(path):
    bad = [n for n in imported_modules(path) if n.startswith(FORBIDDEN)]
    assert not bad, f"{path.name} imports {bad}: pdmask.formats may import only the core"
