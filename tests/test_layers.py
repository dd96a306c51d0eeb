"""The layers of docs/ARCHITECTURE.md, enforced on the source: who may import whom.

Every module under src/pdmask (the library, distribution pdmask) and lab/src/pdmask_lab (the
lab, distribution pdmask-lab) is parsed with ``ast`` (nothing is imported), and every
``import`` / ``from ... import`` of a module of either package is an edge, whether it sits at
module level or inside a function (a lazy import still ties the two modules together).
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
PKG = "pdmask"
#: The lab: its own distribution (lab/pyproject.toml), its own package.
LAB_SRC = REPO / "lab" / "src"
LAB_PKG = "pdmask_lab"
#: (source root, package) of both distributions: the graph spans them.
ROOTS = ((SRC, PKG), (LAB_SRC, LAB_PKG))

#: Top-level modules of the core (with the ``ops`` package and the package root, which
#: re-exports the public API).
CORE_MODULES = {"keys", "rollout", "_validate", "divergences", "anchor", "masks", "stats", "surrogates", "corrections", "loss"}
#: Modules of the package root's layer besides ``pdmask/__init__`` (the finder that names the
#: lab's new home on ``import pdmask.lab``).
API_MODULES = {"_moved"}
#: The library's layers; ``pdmask_lab`` is the lab, and ``cli`` the front door.
LIBRARY = {"core", "api", "formats", "engine", "train", "integrations"}
#: The lab's layers (``pdmask_lab``): the library never imports them.
LAB = {"significance", "batchmask", "experiments", "audit"}
#: Modules of ``pdmask_lab`` (top level) in the significance layer; ``cli`` is the lab's verbs
#: (layer lab-cli); the others are experiments.
SIGNIFICANCE_MODULES = {"significance", "power"}
#: layer -> the layers it may import (itself included). docs/ARCHITECTURE.md.
#: ``api`` is the package root (``import pdmask``: re-exports the core).
ALLOWED = {
    "core": {"core"},
    "api": {"core", "api"},
    "formats": {"core", "formats"},
    "engine": {"core", "formats", "engine"},
    "train": {"api", "core", "engine", "formats", "train"},
    "integrations": {"api", "core", "formats", "engine", "integrations"},
    "significance": {"significance"},
    "batchmask": {"api", "core", "engine", "train", "batchmask"},
    "experiments": {"api", "core", "engine", "formats", "train", "significance", "batchmask", "experiments"},
    "audit": {"api", "core", "engine", "train", "significance", "batchmask", "experiments", "audit"},
    # the library's CLI finds the lab's verbs through an entry point (importlib.metadata), never
    # by importing it; the lab's verbs reuse the library CLI's helpers
    "cli": LIBRARY | {"cli"},
    "lab-cli": LIBRARY | LAB | {"cli", "lab-cli"},
}
SUBPACKAGE_LAYERS = {"ops": "core", "formats": "formats", "engine": "engine", "train": "train",
                     "integrations": "integrations"}
LAB_SUBPACKAGE_LAYERS = {"batchmask": "batchmask", "audit": "audit"}


# ------------------------------------------------------------------ the graph
def module_name(path: Path, src: Path = SRC) -> str:
    """``src/pdmask/ops/_torch.py`` -> ``pdmask.ops._torch``; a package's ``__init__`` is the package."""
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules(src: Path = SRC, pkg: str = PKG) -> dict[str, Path]:
    """Every module of the package: dotted name -> file."""
    return {module_name(p, src): p for p in sorted((src / pkg).rglob("*.py"))}


def _imported(node: ast.AST, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The package modules one import statement names (its ``from X import name`` names
    count as modules when they are submodules of X)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
        found = set()
        for n in names:  # ``import pdmask.ops._torch`` names its deepest known prefix
            parts = n.split(".")
            for i in range(len(parts), 0, -1):
                if ".".join(parts[:i]) in known:
                    found.add(".".join(parts[:i]))
                    break
        return found
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    out = set()
    for a in node.names:
        sub = f"{target}.{a.name}"
        if sub in known:
            out.add(sub)
        elif target in known:
            out.add(target)
    return out


def import_graph(*roots: tuple[Path, str]) -> dict[str, set[str]]:
    """``{module: {package modules it imports}}`` over the packages ``roots`` ((source root,
    package) pairs; default: pdmask and pdmask_lab), module-level and function-level imports alike."""
    mods = {}
    for src, pkg in roots or ROOTS:
        mods.update(package_modules(src, pkg))
    known = set(mods)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= _imported(node, name, path.name == "__init__.py", known)
        edges.discard(name)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]], within: set[str] | None = None) -> list[list[str]]:
    """The import cycles of ``graph`` (restricted to the modules ``within``): every strongly
    connected component of more than one module, sorted. Empty iff the graph is acyclic."""
    nodes = set(graph) if within is None else set(within) & set(graph)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's algorithm (graphs here are small: recursion is fine)
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v] & nodes):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return sorted(found)


def layer_of(module: str) -> str | None:
    """The layer of a module (docs/ARCHITECTURE.md), or None when it has none yet."""
    parts = module.split(".")
    if parts[0] == LAB_PKG:
        return _lab_layer(parts)
    if parts == [PKG] or len(parts) == 2 and parts[1] in API_MODULES:
        return "api"
    if len(parts) == 2 and parts[1] in CORE_MODULES:
        return "core"
    if len(parts) == 2 and parts[1] == "cli":
        return "cli"
    return SUBPACKAGE_LAYERS.get(parts[1]) if len(parts) >= 2 else None


def _lab_layer(parts: list[str]) -> str | None:
    if len(parts) == 1:
        return "experiments"  # the lab's package root
    if parts[1] in LAB_SUBPACKAGE_LAYERS:
        return LAB_SUBPACKAGE_LAYERS[parts[1]]
    if len(parts) == 2:
        return "lab-cli" if parts[1] == "cli" else "significance" if parts[1] in SIGNIFICANCE_MODULES else "experiments"
    return None


def layer_violations(graph: dict[str, set[str]], layers=None) -> list[str]:
    """``"a -> b (layer x may not import layer y)"`` for every edge the layer table forbids
    (only for modules whose layer is in ``layers``; all when None)."""
    out = []
    for mod, deps in sorted(graph.items()):
        la = layer_of(mod)
        if la is None or (layers is not None and la not in layers):
            continue
        for dep in sorted(deps):
            lb = layer_of(dep)
            if lb is not None and lb not in ALLOWED[la]:
                out.append(f"{mod} -> {dep} (layer {la} may not import layer {lb})")
    return out


# ------------------------------------------------------------------ the graph builder itself
def test_graph_builder_sees_relative_absolute_and_function_level_imports(tmp_path):
    root = tmp_path / "src"
    pkg = root / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("import os\nfrom . import b\n\ndef f():\n    from .sub import c\n")
    (pkg / "b.py").write_text("import pkg.sub.c\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from ..a import f\nfrom .. import b as _b\n")
    g = import_graph((root, "pkg"))
    assert g == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b", "pkg.sub.c"}, "pkg.b": {"pkg.sub.c"},
                 "pkg.sub": set(), "pkg.sub.c": {"pkg.a", "pkg.b"}}
    assert cycles(g) == [["pkg.a", "pkg.b", "pkg.sub.c"]]
    assert cycles(g, within={"pkg", "pkg.a", "pkg.b"}) == []


def test_every_module_has_a_layer():
    assert [m for m in import_graph() if layer_of(m) is None] == []


# ------------------------------------------------------------------ the core
def test_core_imports_nothing_outside_the_core():
    graph = import_graph()
    assert {"pdmask.stats", "pdmask.ops", "pdmask.ops._truncate", "pdmask.loss"} <= {
        m for m in graph if layer_of(m) == "core"}
    assert layer_violations(graph, layers={"core"}) == []


def test_core_has_no_import_cycle():
    graph = import_graph()
    core = {m for m in graph if layer_of(m) == "core"}
    assert cycles(graph, within=core) == []


def test_stats_reaches_the_logits_only_through_ops_row_stats():
    """One dispatch: stats imports ``pdmask.ops`` and none of its private backends."""
    graph = import_graph()
    assert "pdmask.ops" in graph["pdmask.stats"]
    assert not {m for m in graph["pdmask.stats"] if m.startswith("pdmask.ops.")}
    assert not {m for m in graph["pdmask.ops"] | graph["pdmask.ops._truncate"] if m == "pdmask.stats"}


# ------------------------------------------------------------------ the whole package
def test_no_import_cycle_anywhere():
    assert cycles(import_graph()) == []


def test_every_layer_imports_only_what_it_may():
    assert layer_violations(import_graph()) == []


# ------------------------------------------------------------------ the library and the lab
def test_the_library_never_imports_the_lab():
    """No module of pdmask (core, api, formats, engine, train, integrations, and the CLI, which
    finds the lab's verbs through an entry point) imports any module of ``pdmask_lab``, eagerly
    or lazily: the lab is built on the library, never the reverse."""
    graph = import_graph()
    assert {"pdmask_lab.audit.runner", "pdmask_lab.batchmask.mask", "pdmask_lab.ladder",
            "pdmask_lab.significance", "pdmask_lab.cli"} <= {m for m in graph if layer_of(m) in LAB | {"lab-cli"}}
    assert "pdmask.train.update" in graph["pdmask_lab.batchmask.trainer"] | graph["pdmask_lab.audit.steps"]
    edges = [f"{m} -> {d}" for m, deps in sorted(graph.items()) if m.split(".")[0] == PKG
             for d in sorted(deps) if d.split(".")[0] == LAB_PKG]
    assert edges == []


def test_the_lab_check_catches_a_library_module_importing_the_lab(tmp_path):
    """The check above can fail: a trainer module with a lazy import of the lab is caught."""
    root, lab = tmp_path / "src", tmp_path / "lab" / "src"
    for d in (root / "pdmask" / "train", lab / "pdmask_lab" / "batchmask"):
        d.mkdir(parents=True)
        (d / "__init__.py").write_text("")
    (root / "pdmask" / "__init__.py").write_text("")
    (lab / "pdmask_lab" / "__init__.py").write_text("")
    (root / "pdmask" / "train" / "update.py").write_text("def f():\n    from pdmask_lab.batchmask import mask\n")
    (lab / "pdmask_lab" / "batchmask" / "mask.py").write_text("from pdmask.train import update\n")
    g = import_graph((root, "pdmask"), (lab, "pdmask_lab"))
    assert g["pdmask.train.update"] == {"pdmask_lab.batchmask.mask"}
    assert g["pdmask_lab.batchmask.mask"] == {"pdmask.train.update"}
    assert layer_violations(g) == ["pdmask.train.update -> pdmask_lab.batchmask.mask (layer train may not "
                                   "import layer batchmask)"]


def test_import_pdmask_loads_no_lab_module():
    """``import pdmask`` (and the trainer, the engines, the formats) load nothing of
    ``pdmask_lab``: measured in a fresh interpreter, on ``sys.modules``."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(LAB_SRC)])}
    code = ("import sys, pdmask, pdmask.train.grpo, pdmask.train.update, pdmask.engine, pdmask.formats; "
            "print(sorted(m for m in sys.modules if m == 'pdmask_lab' or m.startswith('pdmask_lab.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "[]"
    probe = subprocess.run([sys.executable, "-c", "import sys, pdmask_lab.ladder; "
                            "print('pdmask_lab.batchmask' in sys.modules)"], capture_output=True, text=True,
                           check=True, env=env)
    assert probe.stdout.strip() == "True"  # the probe sees a lab import when there is one


def distribution_packages(src: Path) -> list[str]:
    """The packages setuptools puts in a distribution whose ``pyproject.toml`` says
    ``[tool.setuptools.packages.find] where = ["src"]`` (its ``find_packages``; without setuptools,
    the same walk: every directory with an ``__init__.py`` under a package)."""
    try:
        from setuptools import find_packages
    except ImportError:
        return sorted(".".join(p.parent.relative_to(src).parts) for p in src.rglob("__init__.py")
                      if all((q / "__init__.py").exists() for q in p.parent.parents if src in q.parents))
    return sorted(find_packages(where=str(src)))


def test_the_pdmask_distribution_holds_no_lab_module():
    """The pdmask distribution installs the library only: the packages found in src/ are pdmask's,
    none of them the lab (old name or new); the lab's distribution holds pdmask_lab only."""
    import tomllib

    for root, name in ((REPO, "pdmask"), (REPO / "lab", "pdmask-lab")):
        meta = tomllib.loads((root / "pyproject.toml").read_text())
        assert meta["project"]["name"] == name
        assert meta["tool"]["setuptools"]["packages"]["find"]["where"] == ["src"]
    lib, lab = distribution_packages(SRC), distribution_packages(LAB_SRC)
    assert "pdmask" in lib and "pdmask.train" in lib and "pdmask_lab" in lab and "pdmask_lab.audit" in lab
    assert [p for p in lib if p.split(".")[0] != PKG or p.startswith("pdmask.lab")] == []
    assert [p for p in lab if p.split(".")[0] != LAB_PKG] == []
    assert not (SRC / "pdmask" / "lab").exists()


def test_the_distributions_check_can_fail(tmp_path):
    """A lab package left under src/ would be found (and shipped) by the library's discovery."""
    for d in ("pdmask", "pdmask/lab", "pdmask/lab/audit"):
        (tmp_path / d).mkdir(parents=True)
        (tmp_path / d / "__init__.py").write_text("")
    assert distribution_packages(tmp_path) == ["pdmask", "pdmask.lab", "pdmask.lab.audit"]
