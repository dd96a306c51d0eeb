"""Import every verl module a verl entry point can reach; print what failed, as JSON.

Run as a script (a fresh interpreter) by ``test_verl_imports.py``::

    python verl_import_closure.py verl.trainer.main_ppo verl.trainer.main_ppo_v0

"Can reach" is the closure over ``import`` statements in the package's source, module-level
**and** inside functions (verl imports most of its runtime lazily: ``TaskRunnerV1.run``
imports ``transfer_queue`` and the v1 trainers, the legacy ``TaskRunner`` its workers,
the rollout servers import ``uvicorn`` and ``fastapi`` ...), parsed with ``ast`` without
executing anything. Every module of the closure is then imported; the output lists
each failure with its exception type, the missing module's name (for
``ModuleNotFoundError``) and the message.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import sys
from pathlib import Path


def _source(root: Path, mod: str) -> Path | None:
    p = root.joinpath(*mod.split(".")[1:])
    if (p / "__init__.py").is_file():
        return p / "__init__.py"
    if p.with_suffix(".py").is_file():
        return p.with_suffix(".py")
    return None


def _imports(mod: str, path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.add(target)
            out.update(f"{target}.{a.name}" for a in node.names)  # `from pkg import submodule`
    return out


def closure(roots: list[str]) -> list[str]:
    root = Path(importlib.util.find_spec("verl").origin).parent
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        path = _source(root, mod)
        if path is None:  # a name imported from a module, not a module
            continue
        seen.add(mod)
        parts = mod.split(".")
        todo.extend(".".join(parts[:i]) for i in range(2, len(parts)))  # parent packages run first
        todo.extend(m for m in _imports(mod, path) if m.split(".")[0] == "verl")
    return sorted(seen)


def main(roots: list[str]) -> None:
    mods = closure(roots)
    failures = {}
    for mod in mods:
        try:
            importlib.import_module(mod)
        except BaseException as e:  # noqa: BLE001 - report every kind of import failure
            failures[mod] = {"type": type(e).__name__, "missing": getattr(e, "name", None), "message": str(e)[:300]}
    print(json.dumps({"modules": mods, "failures": failures}))


if __name__ == "__main__":
    main(sys.argv[1:])
