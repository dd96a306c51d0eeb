"""Paths as written records hold them: never an absolute path of the machine that wrote them.

A record (``summary.json``, ``audit.json`` / ``audit.md``, ``ladder.json``, ``task_stats.json``,
``phi.json``, the command lines they quote) is read on other machines, committed, compared
across CPUs; a path like ``/home/alice/.cache/pdmask/models/...`` says nothing there and leaks
the writer's layout. :func:`portable_path` writes instead what identifies the thing anywhere:

- a named model's cached conversion -> ``$PDMASK_CACHE/models/<entry>``: the entry's name is
  the model's name, the SHA-256 of its GGUF file and the conversion version (its revision);
- a cached SFT base -> ``$PDMASK_CACHE/<entry>`` (the entry's name is its content key);
- a Hugging Face hub snapshot -> ``<org>/<name>@<revision>``;
- a path under ``base`` (default: the working directory) -> relative to it;
- a path under the home directory -> ``~/...``;
- any other absolute path -> ``.../<parent>/<name>`` (its last two parts);
- a relative path, or a name (``smollm2-135m``) -> as it is.

Naive equivalent: ``os.path.relpath(p)`` where possible, by hand elsewhere.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

#: a hub cache snapshot: .../models--ORG--NAME/snapshots/REVISION[/...]
_HUB = re.compile(r"models--(?P<repo>[^/]+)/snapshots/(?P<rev>[^/]+)")


def _cache_entry(p: Path) -> str | None:
    """``$PDMASK_CACHE/...`` for a directory of pdmask's cache, recognised by the file it holds."""
    from .named_models import SOURCE_FILE

    if (p / SOURCE_FILE).is_file():
        return f"$PDMASK_CACHE/models/{p.name}"
    if (p / "sft.json").is_file():
        return f"$PDMASK_CACHE/{p.name}"
    return None


def portable_path(path: str | os.PathLike, *, base: str | os.PathLike | None = None) -> str:
    """``path`` as a record may hold it (see the module docstring); never absolute."""
    s = str(path)
    if not os.path.isabs(s):
        return s
    p = Path(s)
    entry = _cache_entry(p)
    if entry is not None:
        return entry
    m = _HUB.search(p.as_posix())
    if m:
        return f"{m['repo'].replace('--', '/')}@{m['rev']}"
    for root, prefix in ((Path(base) if base is not None else Path.cwd(), ""), (Path.home(), "~/")):
        try:
            rel = p.resolve().relative_to(root.resolve())
        except (ValueError, OSError):
            continue
        return prefix + rel.as_posix() if rel.parts else (prefix.rstrip("/") or ".")
    tail = p.parts[-2:] if len(p.parts) > 2 else p.parts[-1:]
    return ".../" + "/".join(tail)


def relative_to(path: str | os.PathLike, start: str | os.PathLike) -> str:
    """``path`` relative to the directory ``start`` (``../long/calm/none-s0``): how one record
    names another beside it, valid wherever the two are copied together."""
    return Path(os.path.relpath(os.path.abspath(path), os.path.abspath(start))).as_posix()


#: the config keys that hold a path (``TrainConfig``)
PATH_KEYS = ("out_dir", "cache_dir", "model_path", "train_file", "eval_file")


def portable_config(values: dict) -> dict:
    """A config mapping (``TrainConfig.to_dict()``) with its path values written by
    :func:`portable_path`: what a report quoting the settings holds."""
    return {k: portable_path(v) if k in PATH_KEYS and isinstance(v, str) and v else v for k, v in values.items()}


def portable_arg(arg: str) -> str:
    """One command-line argument with an absolute path in it written by :func:`portable_path`:
    the argument itself, or the value of ``--option=PATH`` / ``key=PATH``."""
    if os.path.isabs(arg):
        return portable_path(arg)
    key, eq, value = arg.partition("=")
    if eq and os.path.isabs(value):
        return f"{key}={portable_path(value)}"
    return arg


def portable_command(prog: str, argv: list[str]) -> str:
    """``prog`` and ``argv`` as one shell line, its absolute paths made portable: what the
    pages that name the command that wrote them quote."""
    out = [prog]
    for a in argv:
        b = portable_arg(a)
        out.append(shlex.quote(b) if shlex.quote(a) != a or b == a else b)  # ~/ and $PDMASK_CACHE stay live
    return " ".join(out)
