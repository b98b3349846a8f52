"""The modalities this deployment knows: one ``ModalitySpec`` each, in ``REGISTRY``.

Topics, stages and their runners, the supervisor's default replicas, admission's cost
defaults and units, the router's load view, assembly's grounding, the generator's prompt
parts, the default model builds and the served modalities all read this table, so adding a
modality is one spec (see docs/adding-a-modality.md), not an edit in each of them.

The built-in specs (text, image, audio, video) are in the table from the start. A plugin is
a module that calls ``register(SPEC)`` when imported; ``load_plugins`` imports the modules
that ``MMSTREAM_MODALITIES_PLUGINS`` names, and every process that starts a stage, the
router included, calls it before it reads the table (``streams/stages/runner.py``, the CLI,
the supervisor). Registration order is the table's order: stages and topics follow it.
"""

from __future__ import annotations

import importlib

from schemas.settings import Settings
from workers.modalities import audio, image, text, video
from workers.modalities.spec import ModalitySpec, RunnerBuilder

__all__ = ["REGISTRY", "ModalityError", "ModalitySpec", "RunnerBuilder", "get", "load_plugins", "names",
           "register", "served", "specs"]


class ModalityError(ValueError):
    """A modality cannot be registered, or a plugin named in the settings cannot be loaded."""


REGISTRY: dict[str, ModalitySpec] = {s.name: s for s in (text.SPEC, image.SPEC, audio.SPEC, video.SPEC)}
"""Modality name -> spec. Change it only through ``register``."""


def register(spec: ModalitySpec) -> ModalitySpec:
    """Add ``spec`` to the registry and return it. Registering the same spec again is a no-op
    (a plugin module may be imported twice); another spec under a taken name, or a fan-out
    to a modality that is not registered, raises ``ModalityError``."""
    have = REGISTRY.get(spec.name)
    if have is not None:
        if have == spec:
            return spec
        raise ModalityError(f"modality {spec.name!r} is already registered with another spec")
    missing = [m for m in spec.fanout if m not in REGISTRY or REGISTRY[m].runner is None]
    if missing:
        raise ModalityError(f"modality {spec.name!r} fans out to {missing}, which no registered encoder serves")
    REGISTRY[spec.name] = spec
    return spec


def load_plugins(modules: str) -> list[str]:
    """Import each module of the comma-separated ``modules`` (each registers its spec on
    import); returns the names now registered. Raises ``ModalityError`` naming a module
    that cannot be imported."""
    for name in (m.strip() for m in modules.split(",")):
        if not name:
            continue
        try:
            # By name from the settings: plugins are modules this package cannot know of.
            importlib.import_module(name)
        except ImportError as exc:
            raise ModalityError(f"modality plugin {name!r} (MMSTREAM_MODALITIES_PLUGINS) cannot be imported: "
                                f"{exc}") from exc
    return names()


def specs() -> list[ModalitySpec]:
    """Every registered spec, in registration order."""
    return list(REGISTRY.values())


def names() -> list[str]:
    return list(REGISTRY)


def get(name: str) -> ModalitySpec | None:
    return REGISTRY.get(name)


def served(settings: Settings) -> frozenset[str]:
    """The modalities with an encoder pool in this deployment: ``MMSTREAM_ROUTER_SERVED_MODALITIES``,
    or every registered one when that is empty."""
    listed = frozenset(m.strip() for m in settings.router.served_modalities.split(",") if m.strip())
    return listed or frozenset(REGISTRY)
