from __future__ import annotations

import sys
from typing import Any, Iterator

import pytest

from workers import modalities, prompt
from workers.encoders import Runner
from workers.modalities import ModalitySpec


def memo_runner(settings: Any, observer: Any, stage: str) -> Runner:
    """A runner a spec can name (``tests.unit.conftest:memo_runner``)."""
    return Runner(lambda job: None, lambda items: [], identity="memo/1", preprocessing="memo-v1")


def memo_spec(**over: Any) -> ModalitySpec:
    """A small extra modality for tests: documents costed by bytes, grounded by an excerpt."""
    fields: dict[str, Any] = dict(
        name="memo",
        runner=lambda settings, observer, stage: Runner(lambda job: None, lambda items: []),
        model="memo-model",
        recipe=None,
        cost_unit="token",
        ms_per_unit=0.5,
        units=lambda size, max_frames: max(1.0, size / 4.0),
        cache_ttl_s=60,
        grounding=lambda extras: {"text": extras.get("excerpt", "")},
        prompt_part=lambda g: prompt.AttachmentPart("memo", "text", g.get("text", ""), failed=bool(g.get("failed"))),
        replicas=2,
    )
    fields.update(over)
    return ModalitySpec(**fields)


@pytest.fixture
def registry() -> Iterator[dict[str, ModalitySpec]]:
    """The modality registry, put back as it was after the test (plugin modules forgotten)."""
    before, loaded = dict(modalities.REGISTRY), set(sys.modules)
    yield modalities.REGISTRY
    modalities.REGISTRY.clear()
    modalities.REGISTRY.update(before)
    for name in set(sys.modules) - loaded:
        if name.startswith("mm_test_plugin"):
            del sys.modules[name]


@pytest.fixture
def memo(registry: dict[str, ModalitySpec]) -> ModalitySpec:
    """The ``memo`` modality, registered for the duration of the test."""
    return modalities.register(memo_spec())
