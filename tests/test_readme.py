"""The README's Python code blocks run as written."""

import re
from pathlib import Path

README = Path(__file__).parents[1] / "README.md"


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python block"
    for code in blocks:
        if "import pdmask" in code and "from pdmask import MaskMode" not in code:
            exec(compile(code, str(README), "exec"), {"__name__": "__readme__"})
