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

from tests.test_layers import LAB_PKG, PKG, ROOTS

#: modules of optional extras: an import that fails because one of these is missing is skipped
OPTIONAL = ("triton", "trl", "verl", "vllm", "peft", "ray", "sglang")


def _modules():
    """(source root, file) of every module of pdmask and pdmask_lab."""
    for src, pkg in ROOTS:
        for path in sorted((src / pkg).rglob("*.py")):
            yield src, path


def _imports():
    for src, path in _modules():
        mod = ".".join(path.relative_to(src).with_suffix("").parts)
        pkg = mod.removesuffix(".__init__") if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = pkg.split(".")[:len(pkg.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] in (PKG, LAB_PKG):
                yield f"{path.relative_to(src)}:{node.lineno}", target, [a.name for a in node.names]


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
    assert ("pdmask_lab/audit/rates.py", "pdmask.masks") in got  # the lab imports the library absolutely
    assert ("pdmask_lab/audit/tables.py", "pdmask_lab.significance") in got  # two dots up from the lab's audit
    assert len(got) > 200


def test_the_lab_imports_the_library_by_absolute_names():
    """A relative import in the lab stays inside pdmask_lab: one that climbs out of it (the
    ``from ...train import x`` of the days when the lab was pdmask.lab) would be a top-level
    import beyond the package and fail; the library is ``pdmask.*``, absolutely."""
    bad = []
    for src, path in _modules():
        if not path.relative_to(src).parts[0] == LAB_PKG:
            continue
        depth = len(path.relative_to(src).parts) - 1  # levels of packages above the module's own
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level > depth:
                bad.append(f"{path.relative_to(src)}:{node.lineno}")
    assert bad == []


def test_import_of_the_old_lab_name_is_one_line_naming_the_new_one():
    """``import pdmask.lab`` (any module under it) fails with one line saying where it went:
    the package ``pdmask_lab`` of the pdmask-lab distribution; ``python -m pdmask.lab.X`` too."""
    import subprocess
    import sys

    import pdmask

    want = "pdmask.lab moved to the pdmask-lab distribution: import pdmask_lab (pip install -e ./lab"
    for name in ("pdmask.lab", "pdmask.lab.regime", "pdmask.lab.audit.runner"):
        with pytest.raises(ModuleNotFoundError, match=r"^pdmask\.lab moved to the pdmask-lab") as e:
            importlib.import_module(name)
        assert e.value.name == "pdmask.lab" and str(e.value).startswith(want)
    with pytest.raises(ModuleNotFoundError, match="import pdmask_lab"):
        from pdmask.lab import regime  # noqa: F401
    with pytest.raises(ModuleNotFoundError, match="No module named 'pdmask.nonexistent'"):
        importlib.import_module("pdmask.nonexistent")  # other missing names: Python's own message
    importlib.reload(pdmask)  # a re-imported pdmask adds no second finder
    assert sum(type(f).__name__ == "MovedFinder" for f in sys.meta_path) == 1
    r = subprocess.run([sys.executable, "-m", "pdmask.lab.stale_report", "--help"], capture_output=True, text=True)
    assert r.returncode == 1 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and want in r.stderr, r.stderr
