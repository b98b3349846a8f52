"""The "doc" modality plugin of docs/adding-a-modality.md, as the suite runs it: the guide's
code block that starts with ``# mypkg/doc.py``, taken from the markdown as it stands, so the
guide and what the tests run cannot drift apart.

``write_plugin(root)`` writes that block to ``root/mypkg/doc.py`` (with an empty
``root/mypkg/__init__.py``) and returns the module name to put in
``MMSTREAM_MODALITIES_PLUGINS``, the way the guide says to load it; ``root`` goes on the
workers' ``PYTHONPATH`` and this process's ``sys.path``.
"""

from __future__ import annotations

import re
from pathlib import Path

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "adding-a-modality.md"
HEADER = "# mypkg/doc.py"
MODULE = "mypkg.doc"


def guide_plugin(guide: Path = GUIDE) -> str:
    """The source of the guide's plugin: its one ```python block starting with ``HEADER``."""
    blocks = re.findall(r"^```python\n(.*?)^```$", guide.read_text(encoding="utf-8"), re.S | re.M)
    found = [b for b in blocks if b.startswith(HEADER + "\n")]
    if len(found) != 1:
        raise LookupError(f"{guide} has {len(found)} python blocks starting with {HEADER!r}, not one")
    return found[0]


def write_plugin(root: Path) -> str:
    """Write the guide's plugin as the package ``mypkg`` under ``root``; returns its module name."""
    pkg = root / "mypkg"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "doc.py").write_text(guide_plugin())
    return MODULE
