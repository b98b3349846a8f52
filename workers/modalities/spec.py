"""What one modality is, as data: ``ModalitySpec``.

Everything that differs between modalities lives in its spec, and the rest of the
pipeline reads the spec instead of listing modalities again: the encode topics and stage
(``encode.<name>``), the stage's runner (which says what the reuse cache keys on), the
cache TTL, the router's cost estimate (unit, default ms per unit, units of one part,
units one queued record stands for), the pool admission charges, what the language model
is told about a part, the model it serves and the recipe that builds it, and how many
replicas ``mmstream up`` starts.

A spec is a descriptor: plain data and small pure functions (extras maps, sizes), cheap to
import, so the topology (topics, router, assembler) reads it without loading any model
library. Its compute is named, not imported: ``runner`` is ``"package.module:builder"``,
imported only when a worker of the stage starts, the way engine backends are
(``workers.engines.BACKENDS``). The builder's ``Runner`` also says what the reuse cache keys
on (``cache_content``, ``preprocessing``).
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

from schemas.request import MODALITY_NAME_RE
from schemas.settings import Settings
from workers.outputs import Observer

if TYPE_CHECKING:  # for annotations only: the descriptor loads no compute
    from workers.encoders import EncoderFront, Runner

RunnerBuilder = Callable[[Settings, Observer, str], "Runner"]
"""(settings, observer, stage) -> the stage's Runner. ``stage`` is the label its engine is
reported under: ``encode.<name>``, or ``encode.any`` in the no-routing baseline's pool."""

FRONT = "workers.encoders:front_for"
"""What puts claim checks and the reuse cache in front of a runner (loaded with it)."""
_REF_RE = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


def resolve(ref: str) -> Any:
    """The object a ``"package.module:name"`` reference names, imported now."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)

RESERVED_NAMES = frozenset({"any", "mixed"})
"""``any`` is the shared topic of the no-routing baseline, ``mixed`` the metrics label of a
request with parts of several modalities."""


def one_unit(size: int, max_frames: int) -> float:
    """Every part costs one unit (an image, a clip), whatever its size."""
    return 1.0


def no_grounding(extras: Mapping[str, Any]) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class ModalitySpec:
    name: str
    """The wire name (``parts[].modality``); topics ``<p>.encode.<name>.<lane>`` and the stage
    ``encode.<name>`` are named after it. Lowercase letters and digits, at most 32."""
    runner: str | RunnerBuilder | None = None
    """Builds the encode stage's batch function: ``"package.module:builder"`` (imported when a
    worker of the stage starts; a plugin may give the function itself). None for a modality
    that fans out instead."""
    fanout: tuple[str, ...] = ()
    """Pools a part of this modality fans out to (video: frame chunks to ``image``, the
    soundtrack to ``audio``); its stage is then a fan-out loop in ``streams/stages/``, not an
    encoder. The first pool is the one admission charges for the part."""
    model_setting: str | None = None
    """Field of ``ModelSettings`` that names the model this modality serves."""
    model: str | None = None
    """The model served when no setting names it (a plugin's own model)."""
    recipe: str | None = None
    """Name of the build recipe (``workers.models.build.RECIPES``) of its model, built by
    ``mmstream models build``; None when it serves another modality's model."""
    cost_unit: str = "part"
    """What one unit of work is (token, image, clip, frame): for people reading costs."""
    ms_per_unit: float = 10.0
    """Engine milliseconds per unit before any worker has published a measured number."""
    units: Callable[[int, int], float] = one_unit
    """(size, max_frames) -> work units of one part, as the router sees it without decoding:
    ``size`` is the text's characters or the inline bytes (0 for a ref)."""
    head_units: Callable[[bytes, int, Any], float] | None = None
    """(the payload's first bytes, its size in bytes, ``settings.limits``) -> work units of
    one part, where its header says more than its size (an audio clip's 30 s windows, from its
    duration bound); None: ``units``. The worker must hold the part to what it was priced at."""
    fanout_units: Callable[[bytes, Any], Mapping[str, float]] | None = None
    """(the payload's bytes as the router has them, ``settings``) -> the work units one part
    causes in the pools of its ``fanout`` beyond the first (a video's soundtrack, in audio
    windows), priced by the router at those pools; the fan-out stage must forward no more than
    it reads from the same bytes. None: only the admission stage's cost."""
    prepare_ms: Callable[[bytes, int, int], float] | None = None
    """(the payload's first bytes, its size in bytes, ``limits.max_image_pixels``) -> ms of a
    core a worker spends on one part before the engine (an image's decode, read from its
    header), priced by the router on top of the engine's cost; None: nothing beyond it."""
    ref_bound: Callable[[bytes], int | None] | None = None
    """(the first bytes of a ref's payload) -> what the job carries as ``ref_pixels``: the
    bound the worker holds the payload it fetches to, so that the price read at admission
    stays the price (an image's declared pixels); None: no such bound."""
    cache_ttl_s: int = 3600
    """How long a cached output stays reusable, unless a setting says otherwise."""
    ttl_setting: str | None = None
    """Field of ``CacheSettings`` holding this modality's TTL (text and image have one)."""
    grounding: Callable[[Mapping[str, Any]], dict[str, Any]] = no_grounding
    """What the language model is told about an encoded part, from the part's extras: the
    fields forwarded beside ``modality`` in a generate job (``schemas.jobs.GenerateJob``)."""
    prompt_part: Callable[[Mapping[str, Any]], Any] | None = None
    """The ``workers.prompt`` part for one forwarded grounding map (which may say
    ``failed``); None: the language model is not told about such parts."""
    replicas: int = 1
    """Workers of its stage that ``mmstream up`` starts by default."""

    def __post_init__(self) -> None:
        if not re.fullmatch(MODALITY_NAME_RE, self.name) or self.name in RESERVED_NAMES:
            raise ValueError(f"modality name {self.name!r} must be 1-32 lowercase letters or digits, "
                             f"starting with a letter, and not one of {sorted(RESERVED_NAMES)}")
        if (self.runner is None) == (not self.fanout):
            raise ValueError(f"modality {self.name!r} needs exactly one of a runner or fan-out pools")
        if isinstance(self.runner, str) and not _REF_RE.fullmatch(self.runner):
            raise ValueError(f"modality {self.name!r}: runner {self.runner!r} is not 'package.module:builder'")
        if self.replicas < 0 or self.ms_per_unit < 0 or self.cache_ttl_s <= 0:
            raise ValueError(f"modality {self.name!r}: replicas, costs and TTL must be positive")

    @property
    def stage(self) -> str:
        return f"encode.{self.name}"

    @property
    def admission_stage(self) -> str:
        """The stage whose queued work admission weighs a part of this modality against."""
        return f"encode.{self.fanout[0]}" if self.fanout else self.stage

    def model_name(self, settings: Settings) -> str | None:
        """The model this modality serves under ``settings`` (None: it has none of its own)."""
        if self.model_setting is not None:
            return str(getattr(settings.models, self.model_setting))
        return self.model

    def cache_ttl(self, settings: Settings) -> int:
        """Seconds a cached output lives: ``MMSTREAM_CACHE_TTL_OVERRIDES`` when it names this
        modality, else the modality's own setting, else the spec's default."""
        overrides = settings.cache.ttls()
        if self.name in overrides:
            return overrides[self.name]
        if self.ttl_setting is not None:
            return int(getattr(settings.cache, self.ttl_setting))
        return self.cache_ttl_s

    def build_runner(self, settings: Settings, observer: Observer, stage: str) -> "Runner":
        """The stage's ``Runner``: its builder imported (when named) and called."""
        if self.runner is None:
            raise ValueError(f"modality {self.name!r} fans out; it has no encoder")
        builder = resolve(self.runner) if isinstance(self.runner, str) else self.runner
        return builder(settings, observer, stage)

    def front(self, settings: Settings, observer: Observer, stage: str) -> "EncoderFront":
        """The encode stage's compute for this modality: its runner with claim checks and
        the reuse cache (keyed by the runner's content and versions) in front."""
        runner = self.build_runner(settings, observer, stage)
        return resolve(FRONT)(runner, settings, observer, self.name, self.cache_ttl(settings))
