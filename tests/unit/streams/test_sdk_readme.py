"""The README's Python example names what the SDK exports: each of its import lines runs."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[3] / "README.md"


def test_the_readme_python_example_imports_what_the_sdk_exports() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    imports = [line for block in blocks for line in block.splitlines() if line.startswith(("from ", "import "))]
    assert any("streams.sdk" in line for line in imports)
    for line in imports:
        exec(compile(line, "README.md", "exec"), {})  # raises ImportError for a name the SDK no longer has
