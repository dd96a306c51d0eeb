"""The README's Python code blocks run as written.

Every ```python block is executed, in its own namespace; none is skipped. A snippet that
is not meant to run (an outline, a fragment) belongs in a ```text block, which this
test does not read.
"""

import re
from pathlib import Path

import pytest

README = Path(__file__).parents[1] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_readme_has_python_blocks():
    assert BLOCKS, "README has no python block"


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_readme_python_block_runs(i):
    exec(compile(BLOCKS[i], f"{README}:python block {i + 1}", "exec"), {"__name__": "__readme__"})
