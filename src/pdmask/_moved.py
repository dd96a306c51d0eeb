"""``pdmask.lab`` is now the ``pdmask_lab`` package of the pdmask-lab distribution (issue 42):
an import of the old name fails with one line saying where it went.

A meta-path finder, appended to ``sys.meta_path`` by ``import pdmask``: the path finder before it
finds every module that exists, so it is asked only about names nobody found, and it answers
only for ``pdmask.lab`` and its submodules (``None``, i.e. "not mine", for every other name).
``python -m pdmask.lab.X`` prints the same line, prefixed by runpy's "Error while finding
module specification".
"""

from __future__ import annotations

import sys

OLD, NEW = "pdmask.lab", "pdmask_lab"


def moved_message(name: str) -> str:
    """The one line for an import of ``name`` (``pdmask.lab`` or a module under it)."""
    return (f"{OLD} moved to the pdmask-lab distribution: import {NEW}{name[len(OLD):]} "
            "(pip install -e ./lab from a pdmask checkout)")


class MovedFinder:
    """Raises :class:`ModuleNotFoundError` with :func:`moved_message` for ``pdmask.lab[.X]``."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == OLD or name.startswith(OLD + "."):
            raise ModuleNotFoundError(moved_message(name), name=name)
        return None


def install() -> None:
    """Append the finder to ``sys.meta_path`` once (a re-imported pdmask adds no second one)."""
    if not any(type(f).__name__ == MovedFinder.__name__ and getattr(f, "__module__", None) == __name__
               for f in sys.meta_path):
        sys.meta_path.append(MovedFinder())
