"""Typed, frozen settings for every component, read once from the environment.

Each component has one ``*Settings`` dataclass. A field ``name`` of the section ``kafka`` is
read from ``MMSTREAM_KAFKA_NAME``; every field has a default and a ``doc`` in its metadata
that says what it trades off. ``Settings.from_env()`` is called once at start-up and the
result is passed down: no other module reads the environment.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, TypeVar, get_type_hints

ENV_PREFIX = "MMSTREAM_"


def setting(default: Any, doc: str) -> Any:
    """A settings field: its default and a sentence on what it trades off."""
    if isinstance(default, (list, dict, set)):
        raise TypeError("settings defaults must be immutable")
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class KafkaSettings:
    bootstrap: str = setting("127.0.0.1:9092", "Kafka bootstrap servers, comma separated.")
    topic_prefix: str = setting(
        "mm", "Prefix of every topic and consumer group; tests use a unique one per run."
    )
    partitions: int = setting(
        4, "Partitions per stage topic: the most replicas of one stage that can share its work."
    )
    replication_factor: int = setting(1, "Replication factor of created topics (1 on a laptop).")
    max_message_bytes: int = setting(
        8 * 1024 * 1024, "Largest record the producers send; payloads above go by claim check."
    )


@dataclass(frozen=True)
class RedisSettings:
    url: str = setting("redis://127.0.0.1:6379/0", "Redis used for the reuse cache and claim checks.")


@dataclass(frozen=True)
class LimitsSettings:
    max_text_bytes: int = setting(64 * 1024, "Largest text part, UTF-8 bytes.")
    max_parts: int = setting(16, "Most parts in one request.")
    max_inline_bytes: int = setting(
        1024 * 1024, "Largest inline binary part; bigger payloads must travel by `ref`."
    )
    max_request_bytes: int = setting(
        4 * 1024 * 1024, "Largest encoded request on ingress; larger ones go to the DLQ."
    )
    default_deadline_ms: int = setting(
        30_000, "Deadline given to requests that set none, milliseconds from acceptance."
    )
    max_deadline_ms: int = setting(600_000, "Longest deadline a client may ask for.")
    max_ref_bytes: int = setting(64 * 1024 * 1024, "Largest payload fetched by claim check (ref).")
    ref_file_root: str = setting(
        "", "Directory whose files may be sent as file:// refs; empty: file refs are refused."
    )
    claim_ttl_s: int = setting(3600, "How long the SDK keeps a claim-checked payload in Redis.")
    max_audio_seconds: float = setting(300.0, "Longest audio clip accepted (decoded duration).")
    max_image_pixels: int = setting(
        25_000_000, "Largest image (width x height, read from the header before decoding): the decompression-bomb guard."
    )


@dataclass(frozen=True)
class EncoderSettings:
    max_batch_size: int = setting(16, "Most items in one engine call; bigger batches raise throughput and latency.")
    max_wait_ms: float = setting(
        4.0, "How long the first item of a batch waits for company before the batch runs anyway."
    )
    max_batch_tokens: int = setting(
        4096, "Token budget of one text batch (padded length x rows): keeps long texts from inflating a batch."
    )
    intra_op_threads: int = setting(0, "ONNX Runtime intra-op threads; 0 lets the runtime choose.")
    allow_spinning: bool = setting(
        False, "Let ONNX Runtime threads spin between ops: a little faster alone, much slower on a shared box."
    )
    precision: str = setting("fp32", "Engine variant to serve: fp32 or int8.")
    max_queue: int = setting(256, "Most jobs held in a worker between Kafka and the engine.")
    providers: str = setting(
        "tensorrt,cuda,cpu", "ONNX Runtime execution providers, tried in order (tensorrt, cuda, cpu or full names); "
        "those this onnxruntime build lacks are skipped. Without cuda, Whisper stays on the CPU too."
    )


@dataclass(frozen=True)
class RouterSettings:
    served_modalities: str = setting(
        "", "Comma-separated modalities with an encoder pool (empty: every registered one); parts of others fail "
        "with unsupported_media."
    )
    served_tasks: str = setting("embed,generate", "Comma-separated tasks this deployment answers.")
    topic_cache_s: float = setting(10.0, "How long the router trusts its list of existing reply topics.")
    modality_topics: bool = setting(
        True, "One encode topic and pool per modality; off, every part goes to one shared topic and generic pool "
        "(the no-routing baseline: light text waits behind video)."
    )
    partitioner: str = setting(
        "least-loaded", "How a job's partition inside a pool is chosen: least-loaded, spread, hash or round-robin."
    )


@dataclass(frozen=True)
class CacheSettings:
    enabled: bool = setting(True, "Reuse encoder outputs from Redis; off, every part is computed.")
    cross_tenant: bool = setting(
        False, "Share cached outputs between tenants (same content, same answer); off, the tenant is in the key."
    )
    ttl_text_s: int = setting(3600, "How long a text embedding stays reusable.")
    ttl_image_s: int = setting(3600, "How long an image (or video frame chunk) embedding stays reusable.")
    whole_result: bool = setting(
        True, "Answer identical embed requests (same tenant, content and models) from the stored answer at the router."
    )
    ttl_result_s: int = setting(600, "How long a whole answer stays reusable.")
    timeout_ms: float = setting(50.0, "Redis socket timeout: past it a lookup counts as a miss and a failure.")
    breaker_failures: int = setting(3, "Consecutive Redis failures that open the breaker (cache bypassed).")
    breaker_cooldown_s: float = setting(10.0, "How long the breaker stays open before one trial call.")
    ttl_overrides: str = setting(
        "", "Cache TTLs by modality, e.g. audio=7200,doc=60 (seconds); a modality not named keeps its own default "
        "(text and image: the two settings above)."
    )


@dataclass(frozen=True)
class VideoSettings:
    max_seconds: float = setting(120.0, "Longest video accepted; longer ones fail with payload_too_large.")
    fps: float = setting(1.0, "Frames sampled per second of video.")
    max_frames: int = setting(16, "Most frames sampled from one video: bounds its cost on the image pool.")
    frames_per_chunk: int = setting(4, "Frames per image-pool job: smaller chunks spread one video over more replicas.")


@dataclass(frozen=True)
class AdmissionSettings:
    enabled: bool = setting(True, "Admit by queued work per stage and lane; off, everything valid is accepted.")
    max_queued_ms_rt: float = setting(5_000.0, "Queued engine work (ms) at a stage past which new rt requests get overloaded.")
    max_queued_ms_bulk: float = setting(
        1_000.0, "Queued engine work (ms) past which new bulk requests get overloaded: lower than rt, so bulk is shed first."
    )
    refresh_ms: int = setting(1_000, "How often the router re-reads consumer lag to estimate queued work.")
    backpressure_high_ms: float = setting(3_000.0, "Total queued work (ms) past which the router stops reading bulk ingress.")
    backpressure_low_ms: float = setting(1_000.0, "Total queued work (ms) under which it reads bulk ingress again.")
    rt_backlog_records: int = setting(
        100, "rt ingress records waiting at the router past which it stops reading bulk ingress (rt first)."
    )


@dataclass(frozen=True)
class GeneratorSettings:
    precision: str = setting(
        "fp32", "LM weights: fp32 (batched output equals alone) or int8 (faster, not batch-invariant, drifts from fp32)."
    )
    scheduler: str = setting("continuous", "continuous (step-level, sequences join and leave) or static batching.")
    max_tokens_per_step: int = setting(256, "Token budget of one model step (prefill chunks + one per decoding sequence).")
    max_running: int = setting(8, "Most sequences holding KV state at once.")
    max_prefill_chunk: int = setting(256, "Most prompt tokens of one sequence in one step (chunked prefill).")
    stream_every_tokens: int = setting(1, "Send a token event every N tokens (fewer events, coarser streaming).")
    prefix_cache_mb: int = setting(64, "Memory for reused prompt-prefix KV blocks; 0 turns the prefix cache off.")


@dataclass(frozen=True)
class AssemblerSettings:
    sweep_interval_ms: int = setting(
        100, "How often the assembler looks for requests past their deadline: the deadline's resolution."
    )
    retention_ms: int = setting(
        120_000, "How long a finished request is remembered so late duplicates cannot answer it twice."
    )
    orphan_ttl_ms: int = setting(600_000, "How long parts that never got a manifest are kept.")
    max_pending: int = setting(100_000, "Most requests one assembler tracks; past it new manifests are answered overloaded.")


@dataclass(frozen=True)
class MetricsSettings:
    port: int = setting(0, "Port of this worker's /metrics; 0 picks a free one (reported by `mmstream status`).")
    bind: str = setting("127.0.0.1", "Address /metrics listens on; 0.0.0.0 to let a remote Prometheus scrape.")
    lag_interval_s: float = setting(5.0, "How often the lag monitor reads offsets from the broker.")


@dataclass(frozen=True)
class LocalSettings:
    """Where `mmstream up` keeps its processes, data and downloads on this machine."""

    state_dir: Path = setting(
        Path.home() / ".local" / "state" / "mmstream",
        "Per-run broker data, pid files and logs of `mmstream up`.",
    )
    cache_dir: Path = setting(
        Path.home() / ".cache" / "mmstream",
        "Broker jars and exported models; kept across runs so later runs skip the work.",
    )
    kafka_version: str = setting("4.1.1", "Apache Kafka broker version fetched from Maven Central.")
    kafka_heap_mb: int = setting(512, "Heap of the local broker's JVM.")
    kafka_controller_port: int = setting(9093, "Local broker's KRaft controller port.")
    redis_maxmemory_mb: int = setting(256, "Redis memory cap; keys are evicted LRU past it.")
    metrics_base_port: int = setting(9400, "First Prometheus port handed to local workers.")


@dataclass(frozen=True)
class ModelSettings:
    repository: Path = setting(
        Path.home() / ".cache" / "mmstream" / "models",
        "Model repository: <name>/<version>/model*.onnx plus config.json.",
    )
    text_model: str = setting("all-minilm-l6-v2", "Model served by the text encoder.")
    image_model: str = setting("efficientnet-lite0", "Model served by the image encoder.")
    lm_model: str = setting("smollm2-135m", "Language model of the generator.")
    audio_model: str = setting("whisper-base", "Model served by the audio encoder (transcript + embedding).")
    audio_precision: str = setting(
        "int8", "Whisper weights to run: int8 (CTranslate2; its transcripts matched fp32 on the build set) or fp32."
    )


@dataclass(frozen=True)
class ModalitiesSettings:
    plugins: str = setting(
        "", "Comma-separated Python modules that each register an extra modality when imported "
        "(see docs/adding-a-modality.md); every worker and the CLI load them at start."
    )


@dataclass(frozen=True)
class Settings:
    kafka: KafkaSettings = field(default_factory=KafkaSettings)
    redis: RedisSettings = field(default_factory=RedisSettings)
    limits: LimitsSettings = field(default_factory=LimitsSettings)
    router: RouterSettings = field(default_factory=RouterSettings)
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    encoder: EncoderSettings = field(default_factory=EncoderSettings)
    assembler: AssemblerSettings = field(default_factory=AssemblerSettings)
    generator: GeneratorSettings = field(default_factory=GeneratorSettings)
    metrics: MetricsSettings = field(default_factory=MetricsSettings)
    video: VideoSettings = field(default_factory=VideoSettings)
    cache: CacheSettings = field(default_factory=CacheSettings)
    local: LocalSettings = field(default_factory=LocalSettings)
    models: ModelSettings = field(default_factory=ModelSettings)
    modalities: ModalitiesSettings = field(default_factory=ModalitiesSettings)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Settings":
        """Build the settings from ``MMSTREAM_<SECTION>_<FIELD>`` variables.

        Raises ``SettingsError`` naming the variable when a value does not parse.
        """
        env = os.environ if env is None else env
        sections = {}
        for f in dataclasses.fields(cls):
            section_cls = f.default_factory  # type: ignore[misc]
            sections[f.name] = _section_from_env(section_cls, f.name, env)
        return cls(**sections)


class SettingsError(ValueError):
    """An environment variable holds a value its setting cannot take."""


S = TypeVar("S")


def env_name(section: str, name: str) -> str:
    return f"{ENV_PREFIX}{section}_{name}".upper()


def _section_from_env(section_cls: type[S], section: str, env: Mapping[str, str]) -> S:
    hints = get_type_hints(section_cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(section_cls):  # type: ignore[arg-type]
        var = env_name(section, f.name)
        if var in env:
            values[f.name] = _parse(hints[f.name], env[var], var)
    return section_cls(**values)


def _parse(kind: Any, raw: str, var: str) -> Any:
    try:
        if kind is bool:
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if kind is Path:
            return Path(raw).expanduser()
        return kind(raw)
    except (TypeError, ValueError):
        raise SettingsError(f"{var}={raw!r} is not a valid {getattr(kind, '__name__', kind)}") from None


def describe(settings: Settings) -> list[tuple[str, Any, str]]:
    """Every setting as (environment variable, current value, doc), for `mmstream config`."""
    rows = []
    for sf in dataclasses.fields(settings):
        section = getattr(settings, sf.name)
        for f in dataclasses.fields(section):
            rows.append((env_name(sf.name, f.name), getattr(section, f.name), f.metadata.get("doc", "")))
    return rows
