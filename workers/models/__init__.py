"""Model builds: export packaged weights to ONNX variants in the model repository.

The public entry points live in ``workers.models.build`` (``build_models``,
``ensure_built``, ``BuildReport``); they are re-exported here lazily so that
``python -m workers.models.build`` does not import its own module twice.
"""

from __future__ import annotations

from typing import Any

from workers.models import build

__all__ = ["BuildReport", "build_models", "ensure_built"]


def __getattr__(name: str) -> Any:
    if name in __all__:

        return getattr(build, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
