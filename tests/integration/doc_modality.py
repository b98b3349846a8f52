"""The "doc" modality plugin of docs/adding-a-modality.md, as the suite runs it: the guide's
code blocks that start with ``# mypkg/doc.py`` (the descriptor) and ``# mypkg/doc_runner.py``
(its compute), taken from the markdown as they stand, so the guide and what the tests run
cannot drift apart.

``write_plugin(root)`` writes them to ``root/mypkg/`` (with an empty
``root/mypkg/__init__.py``) and returns the descriptor's module name to put in
``MMSTREAM_MODALITIES_PLUGINS``, the way the guide says to load it; ``root`` goes on the
workers' ``PYTHONPATH`` and this process's ``sys.path``.
"""

from __future__ import annotations

import re
from pathlib import Path

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "adding-a-modality.md"
FILES = ("doc.py", "doc_runner.py")
MODULE = "mypkg.doc"


def guide_plugin(name: str = "doc.py", guide: Path = GUIDE) -> str:
    """The source of one file of the guide's plugin: its one ```python block starting with
    ``# mypkg/<name>``."""
    header = f"# mypkg/{name}"
    blocks = re.findall(r"^```python\n(.*?)^```$", guide.read_text(encoding="utf-8"), re.S | re.M)
    found = [b for b in blocks if b.startswith(header + "\n")]
    if len(found) != 1:
        raise LookupError(f"{guide} has {len(found)} python blocks starting with {header!r}, not one")
    return found[0]


def write_plugin(root: Path) -> str:
    """Write the guide's plugin as the package ``mypkg`` under ``root``; returns its module name."""
    pkg = root / "mypkg"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    for name in FILES:
        (pkg / name).write_text(guide_plugin(name))
    return MODULE
