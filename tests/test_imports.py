"""Every import of a pdmask module inside the package resolves.

test_layers.py reads the import graph by names and maps an unknown name to its deepest
known prefix, so an import of a module that no longer exists (a module folded into another,
a relative import one level short after a move) would pass it and fail only at run time,
on the path that executes it. This imports every named module and looks up every imported
name, skipping only the optional extras a test environment may lack."""

from __future__ import annotations

import ast
import importlib

import pytest

from tests.test_layers import PKG, SRC

#: modules of optional extras: an import that fails because one of these is missing is skipped
OPTIONAL = ("triton", "trl", "verl", "vllm", "peft", "ray", "sglang")


def _imports():
    for path in sorted((SRC / PKG).rglob("*.py")):
        mod = ".".join(path.relative_to(SRC).with_suffix("").parts)
        pkg = mod.removesuffix(".__init__") if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = pkg.split(".")[:len(pkg.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == PKG or target.startswith(PKG + "."):
                yield f"{path.relative_to(SRC)}:{node.lineno}", target, [a.name for a in node.names]


def _optional_missing(e: BaseException) -> bool:
    return any(name in str(e) for name in OPTIONAL)


def test_every_pdmask_import_resolves():
    bad = []
    for where, target, names in _imports():
        try:
            mod = importlib.import_module(target)
        except ImportError as e:
            if not _optional_missing(e):
                bad.append(f"{where}: {target}: {e}")
            continue
        for name in names:
            if name == "*" or hasattr(mod, name):
                continue
            try:
                importlib.import_module(f"{target}.{name}")
            except ImportError as e:
                if not _optional_missing(e):
                    bad.append(f"{where}: {target} has no {name!r}")
    assert not bad, "imports that do not resolve:\n" + "\n".join(bad)


def test_the_scan_sees_relative_imports_of_the_core():
    got = {(w.split(":")[0], t) for w, t, _ in _imports()}
    assert ("pdmask/lab/audit/rates.py", "pdmask.masks") in got  # three dots up from the lab's audit
    assert len(got) > 200
