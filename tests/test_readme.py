"""The README's Python example runs and its commands exist."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    for block in blocks:
        exec(compile(block, str(README), "exec"), {})


def test_readme_names_the_two_commands_and_makefile_has_them():
    text = README.read_text()
    assert "make reproduce" in text and "make test" in text
    makefile = (README.parent / "Makefile").read_text()
    assert re.search(r"^reproduce:", makefile, flags=re.M)
    assert re.search(r"^test:", makefile, flags=re.M)
    assert "make test" in (README.parent / ".ci" / "run").read_text()
