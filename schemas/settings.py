"""Typed, frozen settings for every component, read once from the environment.

Each component has one ``*Settings`` section (a frozen pydantic model). A field ``name`` of
the section ``kafka`` is read from ``MMSTREAM_KAFKA_NAME``; every field has a default, a
``doc`` (its description) that says what it trades off, and the type, range or set of
values it may take. ``Settings.from_env()`` is called once at start-up and the result is
passed down: no other module reads the environment.

What is refused at start, as a ``SettingsError`` that names the variable:
- a value of the wrong type, out of its range or outside its set (``partitions >= 1``,
  ``partitioner`` one of four, ``precision`` one the engines know);
- an ``MMSTREAM_*`` variable that names no setting (with the closest name: a typo must not
  silently fall back to a default).

``Settings()`` is the defaults alone; ``Settings.from_env(env)`` reads ``env`` (the process
environment by default) through pydantic-settings' environment source. ``describe`` lists
every setting for `mmstream config`, with passwords in URLs masked.
"""

from __future__ import annotations

import difflib
import os
import re
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator,
                      model_validator)
from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict
from pydantic_settings.sources.utils import parse_env_vars

from schemas.request import MODALITY_NAME_RE

ENV_PREFIX = "MMSTREAM_"

# The value sets below are the ones the code acts on; tests check each against its user
# (the partitioner strategies, the engines' precisions), since this package imports nothing.
ENGINE_PRECISIONS = ("fp32", "fp16", "bf16", "int8")
"""Precision variants an ONNX engine can serve (the repository must hold the variant)."""
EnginePrecision = Literal["fp32", "fp16", "bf16", "int8"]
LmPrecision = Literal["fp32", "int8"]
"""The LM and Whisper engines serve fp32 or int8 weights."""
Partitioner = Literal["least-loaded", "spread", "hash", "round-robin"]
Scheduler = Literal["continuous", "static"]
SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN", "OAUTHBEARER"]
Grouping = Literal["length", "fifo"]
TASKS = ("embed", "generate")


def _check_bootstrap(value: str) -> str:
    servers = [s.strip() for s in value.split(",")]
    for server in servers:
        host, sep, port = server.rpartition(":")
        if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(f"{server!r} is not host:port")
    return ",".join(servers)


Bootstrap = Annotated[str, AfterValidator(_check_bootstrap)]
UserPath = Annotated[Path, AfterValidator(lambda p: p.expanduser())]


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def setting(default: Any, doc: str, **constraints: Any) -> Any:
    """A settings field: its default, a sentence on what it trades off, and its constraints
    (pydantic's ``ge``, ``gt``, ``le``, ``pattern``, ``min_length``...)."""
    if isinstance(default, (list, dict, set)):
        raise TypeError("settings defaults must be immutable")
    return Field(default=default, description=doc, **constraints)


class _Section(BaseModel):
    """A frozen group of settings; an unknown field is an error, not a silent no-op."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


class KafkaSettings(_Section):
    bootstrap: Bootstrap = setting("127.0.0.1:9092", "Kafka bootstrap servers, comma separated host:port pairs.")
    topic_prefix: str = setting(
        "mm", "Prefix of every topic and consumer group; tests use a unique one per run.",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
    )
    partitions: int = setting(
        4, "Partitions per stage topic: the most replicas of one stage that can share its work.", ge=1
    )
    replication_factor: int = setting(1, "Replication factor of created topics (1 on a laptop).", ge=1)
    max_message_bytes: int = setting(
        8 * 1024 * 1024, "Largest record the producers send; payloads above go by claim check.", ge=1024
    )
    fetch_max_wait_ms: int = setting(
        500, "How long the broker holds a stage's idle fetch open: records that arrive meanwhile answer it at once, so "
        "this only sets how often an idle stage asks (short waits cost CPU on every worker and the broker).", ge=1
    )
    linger_ms: int = setting(
        0, "How long a stage's producer waits to fill a batch: latency for fewer requests. Under load, records "
        "queue behind the request in flight and ride together anyway; idle, every millisecond here is one per hop.",
        ge=0
    )
    commit_interval_ms: int = setting(
        200, "How often stages commit finished offsets: more often repeats less work after a crash, costs more requests.",
        ge=1
    )
    session_timeout_ms: int = setting(
        30_000, "How long the broker keeps a silent stage replica's partitions: shorter moves a dead replica's work "
        "sooner, but a pause that long (GC, a stall) costs a rebalance. A stage stops sending a third of it earlier.",
        ge=3_000
    )
    heartbeat_interval_ms: int = setting(
        3_000, "How often a stage replica tells the broker it is alive (at most a third of the session timeout).", ge=100
    )
    security_protocol: SecurityProtocol = setting(
        "PLAINTEXT", "How every client of the pipeline (workers, CLI, SDK, lag monitor, bench) talks to Kafka: PLAINTEXT "
        "trusts every client and takes the tenant from the request; SSL, SASL_PLAINTEXT or SASL_SSL authenticate, and "
        "the tenant then comes from the per-tenant ingress topic the broker let it write (see the README's Security)."
    )
    sasl_mechanism: SaslMechanism = setting(
        "SCRAM-SHA-512", "SASL mechanism with a SASL_* protocol: SCRAM-SHA-512 (or -256) sends no password over the "
        "wire; PLAIN sends it (only under TLS); OAUTHBEARER sends the token read from oauth_token_file."
    )
    username: str = setting("", "SASL user (the pipeline's service principal) with a SASL_* protocol.")
    password: SecretStr = setting(SecretStr(""), "Password of the SASL user; never printed (`mmstream config` shows ***).")
    ssl_ca_file: str = setting(
        "", "PEM file of the CA that signed the brokers' certificates (SSL, SASL_SSL); empty: the system's CAs."
    )
    ssl_cert_file: str = setting("", "PEM client certificate for mutual TLS (SSL); empty: none.")
    ssl_key_file: str = setting("", "PEM key of ssl_cert_file; empty: none.")
    ssl_check_hostname: bool = setting(
        True, "Check that the broker's certificate names the host connected to; off only for a test broker whose "
        "certificate lacks the name."
    )
    oauth_token_file: str = setting(
        "", "With OAUTHBEARER: a file holding the current bearer token, read again for every new connection (so "
        "whatever renews it just rewrites the file)."
    )

    @model_validator(mode="after")
    def _security_complete(self) -> "KafkaSettings":
        if self.security_protocol.startswith("SASL_"):
            if self.sasl_mechanism == "OAUTHBEARER":
                if not self.oauth_token_file:
                    raise ValueError("sasl_mechanism OAUTHBEARER needs oauth_token_file")
            elif not (self.username and self.password.get_secret_value()):
                raise ValueError(f"security_protocol {self.security_protocol} needs username and password")
            if self.sasl_mechanism == "PLAIN" and self.security_protocol == "SASL_PLAINTEXT":
                raise ValueError("sasl_mechanism PLAIN over SASL_PLAINTEXT would send the password in clear; use "
                                 "SASL_SSL or a SCRAM mechanism")
        if bool(self.ssl_cert_file) != bool(self.ssl_key_file):
            raise ValueError("ssl_cert_file and ssl_key_file go together")
        return self

    @property
    def authenticated(self) -> bool:
        """Whether the broker authenticates clients, so the tenant comes from per-tenant
        topics rather than from the request (everything but PLAINTEXT)."""
        return self.security_protocol != "PLAINTEXT"


class RedisSettings(_Section):
    url: str = setting(
        "redis://127.0.0.1:6379/0", "Redis of the workers (reuse cache, load reports, claim checks), as "
        "redis://[user:password@]host:port/db; rediss:// for TLS. A password in it is never printed.",
        pattern=r"^(redis|rediss|unix)://",
    )
    client_url: str = setting(
        "", "Redis the SDK and `mmstream submit` store claim checks in, usually as a user that may only SET and GET "
        "mm:claim:* keys (infra/redis/redis.conf); empty: the workers' url.",
        pattern=r"^((redis|rediss|unix)://.*)?$",
    )
    tls_ca: str = setting(
        "", "CA certificate file that signs the Redis server's certificate (rediss:// URLs); empty: the system's CAs."
    )

    @property
    def clients(self) -> str:
        """The URL clients store claim checks through."""
        return self.client_url or self.url


class LimitsSettings(_Section):
    max_text_bytes: int = setting(64 * 1024, "Largest text part, UTF-8 bytes.", ge=1)
    max_parts: int = setting(16, "Most parts in one request.", ge=1)
    max_inline_bytes: int = setting(
        1024 * 1024, "Largest inline binary part; bigger payloads must travel by `ref`.", ge=1
    )
    max_request_bytes: int = setting(
        4 * 1024 * 1024, "Largest encoded request on ingress; larger ones go to the DLQ.", ge=1
    )
    default_deadline_ms: int = setting(
        30_000, "Deadline given to requests that set none, milliseconds from acceptance.", ge=1
    )
    max_deadline_ms: int = setting(600_000, "Longest deadline a client may ask for.", ge=1)
    max_ref_bytes: int = setting(64 * 1024 * 1024, "Largest payload fetched by claim check (ref).", ge=1)
    ref_file_root: str = setting(
        "", "Directory whose files may be sent as file:// refs, one subdirectory per tenant (a tenant's refs resolve "
        "only under <root>/<tenant>/); empty: file refs are refused."
    )
    claim_ttl_s: int = setting(3600, "How long the SDK keeps a claim-checked payload in Redis.", ge=1)
    max_audio_seconds: float = setting(300.0, "Longest audio clip accepted (decoded duration).", gt=0)
    max_image_pixels: int = setting(
        25_000_000, "Largest image (width x height, read from the header before decoding): the decompression-bomb guard.", ge=1
    )


class EncoderSettings(_Section):
    max_batch_size: int = setting(16, "Most items in one engine call; bigger batches raise throughput and latency.", ge=1)
    max_wait_ms: float = setting(
        4.0, "How long the first item of a batch waits for company before the batch runs anyway.", ge=0
    )
    max_batch_ms: float = setting(
        60.0, "Engine time one batch may take, predicted by the stage's learned batch cost model: bounds how long a "
        "batch holds the engine (and so the wait of what arrives meanwhile).", gt=0
    )
    grouping: Grouping = setting(
        "length", "Which queued items ride together: length (similar padded lengths, so a long text never pads short "
        "ones) or fifo (arrival order, as a generic server)."
    )
    intra_op_threads: int = setting(
        1, "ONNX Runtime intra-op threads per engine; 0 lets the runtime choose (one per core). One is the measured "
        "best on a small box, where every stage, the broker and Redis share the cores (docs/capacity.md).", ge=0
    )
    allow_spinning: bool = setting(
        False, "Let ONNX Runtime threads spin between ops: a little faster alone, much slower on a shared box."
    )
    precision: EnginePrecision = setting(
        "int8", f"Encoder variant to serve: one of {', '.join(ENGINE_PRECISIONS)} (the variant must be built and pass its "
        "fidelity gate, else the engine falls back to fp32). int8 measured 2.4x less CPU per text than fp32 at mean "
        "cosine 0.993 to it on real sentences (docs/capacity.md)."
    )
    max_queue: int = setting(256, "Most jobs held in a worker between Kafka and the engine.", ge=1)
    providers: str = setting(
        "tensorrt,cuda,cpu", "ONNX Runtime execution providers, tried in order (tensorrt, cuda, cpu or full names); "
        "those this onnxruntime build lacks are skipped. Without cuda, Whisper stays on the CPU too.", min_length=1
    )


class RouterSettings(_Section):
    served_modalities: str = setting(
        "", "Comma-separated modalities with an encoder pool (empty: every registered one); parts of others fail "
        "with unsupported_media."
    )
    served_tasks: str = setting(
        "embed,generate", "Comma-separated tasks this deployment answers."
    )
    topic_cache_s: float = setting(10.0, "How long the router trusts its list of existing reply topics.", ge=0)
    modality_topics: bool = setting(
        True, "One encode topic and pool per modality; off, every part goes to one shared topic and generic pool "
        "(the no-routing baseline: light text waits behind video)."
    )
    partitioner: Partitioner = setting(
        "least-loaded", "How a job's partition inside a pool is chosen: least-loaded, spread, hash or round-robin."
    )

    @field_validator("served_tasks")
    @classmethod
    def _known_tasks(cls, value: str) -> str:
        unknown = [v for v in _csv(value) if v not in TASKS]
        if unknown:
            raise ValueError(f"unknown {', '.join(map(repr, unknown))}; choose from {', '.join(TASKS)}")
        return value

    @field_validator("served_modalities")
    @classmethod
    def _modality_names(cls, value: str) -> str:
        # Which modalities exist is the registry's (plugins add some): here only their shape.
        bad = [v for v in _csv(value) if not re.fullmatch(MODALITY_NAME_RE, v)]
        if bad:
            raise ValueError(f"{', '.join(map(repr, bad))} is not a modality name (lowercase letters and digits)")
        return value


class CacheSettings(_Section):
    enabled: bool = setting(True, "Reuse encoder outputs from Redis; off, every part is computed.")
    cross_tenant: bool = setting(
        False, "Share cached outputs between tenants (same content, same answer); off, the tenant is in the key."
    )
    ttl_text_s: int = setting(3600, "How long a text embedding stays reusable.", ge=1)
    ttl_image_s: int = setting(3600, "How long an image (or video frame chunk) embedding stays reusable.", ge=1)
    whole_result: bool = setting(
        True, "Answer identical embed requests (same tenant, content and models) from the stored answer at the router."
    )
    ttl_result_s: int = setting(600, "How long a whole answer stays reusable.", ge=1)
    timeout_ms: float = setting(50.0, "Redis socket timeout: past it a lookup counts as a miss and a failure.", gt=0)
    breaker_failures: int = setting(3, "Consecutive Redis failures that open the breaker (cache bypassed).", ge=1)
    breaker_cooldown_s: float = setting(10.0, "How long the breaker stays open before one trial call.", ge=0)
    ttl_overrides: str = setting(
        "", "Cache TTLs by modality, e.g. audio=7200,doc=60 (seconds); a modality not named keeps its own default "
        "(text and image: the two settings above)."
    )


class VideoSettings(_Section):
    max_seconds: float = setting(120.0, "Longest video accepted; longer ones fail with payload_too_large.", gt=0)
    fps: float = setting(1.0, "Frames sampled per second of video.", gt=0)
    max_frames: int = setting(16, "Most frames sampled from one video: bounds its cost on the image pool.", ge=1)
    frames_per_chunk: int = setting(
        4, "Frames per image-pool job: smaller chunks spread one video over more replicas.", ge=1
    )


class AdmissionSettings(_Section):
    enabled: bool = setting(True, "Admit by queued work per stage and lane; off, everything valid is accepted.")
    max_queued_ms_rt: float = setting(
        500.0, "The most an admitted rt request waits at a stage (ms of engine work ahead of it: the rt work queued "
        "there and the batch running; rt goes before bulk). Past it, new rt requests get overloaded with retry_after_ms.",
        ge=0
    )
    max_queued_ms_bulk: float = setting(
        2_000.0, "The most an admitted bulk request waits at a stage (ms of all the work queued there). Past it, new "
        "bulk requests get overloaded; bulk is shed first because it waits behind every rt request.", ge=0,
    )
    refresh_ms: int = setting(1_000, "How often the router re-reads consumer lag to estimate queued work.", ge=1)
    backpressure_high_ms: float = setting(
        3_000.0, "Total queued work (ms) past which the router stops reading bulk ingress.", ge=0
    )
    backpressure_low_ms: float = setting(
        1_000.0, "Total queued work (ms) under which it reads bulk ingress again.", ge=0
    )
    rt_backlog_records: int = setting(
        100, "rt ingress records waiting at the router past which it stops reading bulk ingress (rt first).", ge=0
    )

    @model_validator(mode="after")
    def _hysteresis(self) -> "AdmissionSettings":
        if self.backpressure_low_ms > self.backpressure_high_ms:
            raise ValueError(f"backpressure_low_ms ({self.backpressure_low_ms:g}) must not exceed "
                             f"backpressure_high_ms ({self.backpressure_high_ms:g})")
        return self


class GeneratorSettings(_Section):
    precision: LmPrecision = setting(
        "fp32", "LM weights: fp32 (batched output equals alone) or int8 (faster, not batch-invariant, drifts from fp32)."
    )
    scheduler: Scheduler = setting("continuous", "continuous (step-level, sequences join and leave) or static batching.")
    max_tokens_per_step: int = setting(
        256, "Token budget of one model step (prefill chunks + one per decoding sequence).", ge=1
    )
    max_running: int = setting(8, "Most sequences holding KV state at once.", ge=1)
    max_prefill_chunk: int = setting(256, "Most prompt tokens of one sequence in one step (chunked prefill).", ge=1)
    stream_every_tokens: int = setting(1, "Send a token event every N tokens (fewer events, coarser streaming).", ge=1)
    prefix_cache_mb: int = setting(
        64, "Memory for reused prompt-prefix KV blocks; 0 turns the prefix cache off.", ge=0
    )
    max_queued: int = setting(
        64, "Most generate jobs one generator holds (running or waiting): past it, it stops fetching.", ge=1
    )
    done_retention_ms: int = setting(
        600_000, "How long a finished generation is remembered so a repeated job is not answered again.", ge=0
    )


class AssemblerSettings(_Section):
    sweep_interval_ms: int = setting(
        100, "How often the assembler looks for requests past their deadline: the deadline's resolution.", ge=1
    )
    retention_ms: int = setting(
        120_000, "How long a finished request is remembered so late duplicates cannot answer it twice.", ge=0
    )
    orphan_ttl_ms: int = setting(
        5_000, "How long parts that arrived before their manifest wait for it (the router sends the manifest first, so "
        "only a reordering or a forged part waits): longer tolerates more reordering, holds forged parts longer.", ge=1
    )
    max_orphans: int = setting(
        10_000, "Most parts without a manifest one assembler holds; past it new ones are dropped (never answered).", ge=0
    )
    max_pending: int = setting(
        100_000, "Most requests one assembler tracks; past it new manifests are answered overloaded.", ge=1
    )
    max_orphans: int = setting(
        10_000, "Most parts without a manifest (forged or stale) one assembler keeps; past it the oldest are dropped.",
        ge=1
    )


class DlqSettings(_Section):
    """The dead-letter topic: what it keeps of a record it parks, and for how long."""

    keep_payload: bool = setting(
        True, "Keep the record's value (cut to the size limit) in the DLQ copy; off, only its headers, the reason and "
        "the source: nothing a client sent stays on the DLQ, but a parked record cannot be replayed from it."
    )
    retention_ms: int = setting(
        3 * 24 * 3_600_000, "How long DLQ records are kept (the topic's retention.ms, set when it is created).", ge=60_000
    )
    retention_bytes: int = setting(
        1024 ** 3, "Most bytes the DLQ keeps per partition (retention.bytes, set when it is created); the oldest go first.",
        ge=1024 * 1024,
    )


class QuotaSettings(_Section):
    """Per-tenant limits at the router (``streams.policies.quota``): one tenant cannot take
    the whole pool. Each router replica counts on its own (a tenant's requests spread over
    the replicas by ingress partition), so the limits hold per replica."""

    rate_per_s: float = setting(
        0.0, "Requests per second one tenant may send (token bucket); 0: no rate limit. Over it: overloaded with "
        "retry_after_ms.", ge=0
    )
    burst: float = setting(0.0, "Requests a tenant may send at once above its rate; 0: one second's worth.", ge=0)
    overrides: str = setting(
        "", "Per-tenant rates, e.g. acme=50,batchco=5:20 (rate_per_s[:burst]); a tenant not named gets rate_per_s."
    )
    fair_share: float = setting(
        0.5, "While admission is turning some tenant away (overloaded, within window_ms), the largest share of a "
        "lane's queued-work limit (admission.max_queued_ms_<lane>) one other tenant's queued work may hold; a tenant "
        "alone, or among tenants that all get in, may use it all. 0: off.", ge=0, le=1,
    )
    max_queued_ms: float = setting(
        0.0, "Queued engine work (ms) one tenant may have, alone or not; 0: no such limit. A tenant's queued work is "
        "what the router sent for it, counted until its predicted end (queue wait + cost).", ge=0
    )
    window_ms: int = setting(
        10_000, "Longest time one job counts as a tenant's queued work, and how long a refused tenant makes the "
        "others keep to their fair share.", ge=100
    )
    max_tenants: int = setting(10_000, "Most tenants whose counts the router keeps (memory bound; idle ones go).", ge=1)
    metric_tenants: int = setting(
        20, "Tenants named in the shed metric's tenant label (the first ones shed); the rest count as `other`.", ge=0
    )

    @field_validator("overrides")
    @classmethod
    def _rates(cls, value: str) -> str:
        parse_overrides(value)
        return value


def parse_overrides(value: str) -> dict[str, tuple[float, float]]:
    """``acme=50,batchco=5:20`` -> {tenant: (rate_per_s, burst)} (burst 0: one second's worth).
    Raises ``ValueError`` naming the bad item."""
    out: dict[str, tuple[float, float]] = {}
    for item in _csv(value):
        tenant, sep, spec = item.partition("=")
        rate, _, burst = spec.partition(":")
        try:
            parsed = (float(rate), float(burst or 0))
        except ValueError:
            parsed = (-1.0, -1.0)
        if not sep or not tenant.strip() or min(parsed) < 0:
            raise ValueError(f"{item!r} is not tenant=rate_per_s[:burst] with numbers >= 0")
        out[tenant.strip()] = parsed
    return out


class MetricsSettings(_Section):
    port: int = setting(
        0, "Port of this worker's /metrics, /healthz and /readyz; 0 picks a free one (reported by `mmstream status`).",
        ge=0, le=65535,
    )
    bind: str = setting(
        "127.0.0.1", "Address /metrics listens on; 0.0.0.0 to let a remote Prometheus scrape.", min_length=1
    )
    lag_interval_s: float = setting(5.0, "How often the lag monitor reads offsets from the broker.", gt=0)


class LocalSettings(_Section):
    """Where `mmstream up` keeps its processes, data and downloads on this machine."""

    state_dir: UserPath = setting(
        Path.home() / ".local" / "state" / "mmstream",
        "Per-run broker data, pid files and logs of `mmstream up`.",
    )
    cache_dir: UserPath = setting(
        Path.home() / ".cache" / "mmstream",
        "Broker jars and exported models; kept across runs so later runs skip the work.",
    )
    kafka_version: str = setting(
        "4.1.1", "Apache Kafka broker version fetched from Maven Central.", pattern=r"^\d+\.\d+\.\d+$"
    )
    kafka_heap_mb: int = setting(512, "Heap of the local broker's JVM.", ge=64)
    kafka_controller_port: int = setting(9093, "Local broker's KRaft controller port.", ge=1, le=65535)
    kafka_secure_port: int = setting(
        9094, "Client port (SASL_SSL) of the secured local broker of `mmstream up --secure`; it runs beside the "
        "plaintext one, with its own state under <state_dir>/kafka-secure.", ge=1, le=65535
    )
    kafka_secure_internal_port: int = setting(
        9095, "Secured local broker's inter-broker port (mutual TLS, loopback only).", ge=1, le=65535
    )
    kafka_secure_controller_port: int = setting(
        9096, "Secured local broker's KRaft controller port (mutual TLS, loopback only).", ge=1, le=65535
    )
    redis_maxmemory_mb: int = setting(256, "Redis memory cap; keys are evicted LRU past it.", ge=1)
    metrics_base_port: int = setting(
        9400, "First Prometheus port handed to local workers; 0 lets each worker pick a free one.", ge=0, le=65535
    )


class ModelSettings(_Section):
    repository: UserPath = setting(
        Path.home() / ".cache" / "mmstream" / "models",
        "Model repository: <name>/<version>/model*.onnx plus config.json.",
    )
    text_model: str = setting("all-minilm-l6-v2", "Model served by the text encoder.", min_length=1)
    image_model: str = setting("efficientnet-lite0", "Model served by the image encoder.", min_length=1)
    lm_model: str = setting("smollm2-135m", "Language model of the generator.", min_length=1)
    audio_model: str = setting("whisper-base", "Model served by the audio encoder (transcript + embedding).", min_length=1)
    audio_precision: LmPrecision = setting(
        "int8", "Whisper weights to run: int8 (CTranslate2; its transcripts matched fp32 on the build set) or fp32."
    )


class ModalitiesSettings(_Section):
    plugins: str = setting(
        "", "Comma-separated Python modules that each register an extra modality when imported "
        "(see docs/adding-a-modality.md); every worker and the CLI load them at start."
    )


def _section(cls: type[_Section]) -> Any:
    return Field(default_factory=cls)


class SettingsError(ValueError):
    """An environment variable holds a value its setting cannot take, or names no setting."""


_ENV: ContextVar[Mapping[str, str] | None] = ContextVar("mmstream_settings_env", default=None)


class _MappingEnvSource(EnvSettingsSource):
    """pydantic-settings' environment source, reading a given mapping instead of os.environ."""

    def __init__(self, settings_cls: type[BaseSettings], env: Mapping[str, str]) -> None:
        self._env = env
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return parse_env_vars(self._env, self.case_sensitive, self.env_ignore_empty, self.env_parse_none_str)


class Settings(BaseSettings):
    """Every section; ``MMSTREAM_<SECTION>_<FIELD>`` sets a field (the first ``_`` after the
    section name separates it from the field, whose own name may contain ``_``)."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter="_", env_nested_max_split=1, case_sensitive=False,
        frozen=True, extra="forbid",
    )

    kafka: KafkaSettings = _section(KafkaSettings)
    redis: RedisSettings = _section(RedisSettings)
    limits: LimitsSettings = _section(LimitsSettings)
    router: RouterSettings = _section(RouterSettings)
    admission: AdmissionSettings = _section(AdmissionSettings)
    encoder: EncoderSettings = _section(EncoderSettings)
    assembler: AssemblerSettings = _section(AssemblerSettings)
    generator: GeneratorSettings = _section(GeneratorSettings)
    metrics: MetricsSettings = _section(MetricsSettings)
    dlq: DlqSettings = _section(DlqSettings)
    quota: QuotaSettings = _section(QuotaSettings)
    video: VideoSettings = _section(VideoSettings)
    cache: CacheSettings = _section(CacheSettings)
    local: LocalSettings = _section(LocalSettings)
    models: ModelSettings = _section(ModelSettings)
    modalities: ModalitiesSettings = _section(ModalitiesSettings)

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Only the mapping handed to from_env: no .env file, no secrets directory, and
        # Settings() alone is the defaults (tests and tools build it without the environment).
        env = _ENV.get()
        return (init_settings,) if env is None else (init_settings, _MappingEnvSource(settings_cls, env))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Settings":
        """Build the settings from the ``MMSTREAM_<SECTION>_<FIELD>`` variables of ``env``
        (default: the process environment).

        Raises ``SettingsError`` naming the variable when a value does not parse or is out
        of range, or when an ``MMSTREAM_*`` variable names no setting.
        """
        env = dict(os.environ if env is None else env)
        check_names(env)
        token = _ENV.set(env)
        try:
            return cls()
        except ValidationError as exc:
            raise SettingsError(_explain(exc, env)) from None
        finally:
            _ENV.reset(token)


def env_name(section: str, name: str) -> str:
    return f"{ENV_PREFIX}{section}_{name}".upper()


def env_names() -> dict[str, tuple[str, str]]:
    """Every setting's variable -> (section, field)."""
    return {env_name(section, name): (section, name)
            for section, sf in Settings.model_fields.items()
            for name in sf.default_factory.model_fields}  # type: ignore[union-attr]


def check_names(env: Mapping[str, str]) -> None:
    """Raise ``SettingsError`` for the first ``MMSTREAM_*`` variable that names no setting,
    with the closest known name."""
    known = env_names()
    for var in sorted(env):
        if var.upper().startswith(ENV_PREFIX) and var.upper() not in known:
            close = difflib.get_close_matches(var.upper(), known, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else "; `mmstream config` lists every setting"
            raise SettingsError(f"{var} is not a setting{hint}")


def _explain(exc: ValidationError, env: Mapping[str, str]) -> str:
    """One line per problem, each naming the variable, the value given and what is allowed."""
    lines = []
    for err in exc.errors(include_url=False):
        loc = [str(p) for p in err["loc"]]
        if len(loc) >= 2:
            var = env_name(loc[0], loc[1])
            given = next((v for k, v in env.items() if k.upper() == var), err.get("input"))
            lines.append(f"{var}={given!r}: {_lower_first(err['msg'])}")
        else:  # a check across fields of one section
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"{ENV_PREFIX}{'_'.join(loc).upper()}_*: {msg}")
    return "; ".join(lines)


def _lower_first(msg: str) -> str:
    msg = msg.removeprefix("Value error, ")
    return msg[:1].lower() + msg[1:]


_PASSWORD = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<user>[^:/@]*):(?P<password>[^@/]+)@", re.I)
_QUERY_PASSWORD = re.compile(r"(?P<key>[?&](password|pass|pwd)=)[^&#]*", re.I)


def redact(value: Any) -> Any:
    """``value`` with the password of any ``scheme://user:password@`` in it, and of a
    ``?password=`` query parameter (which redis-py reads too), replaced by ``***``."""
    if not isinstance(value, str):
        return value
    return _QUERY_PASSWORD.sub(r"\g<key>***", _PASSWORD.sub(r"\g<scheme>\g<user>:***@", value))


def describe(settings: Settings) -> list[tuple[str, Any, str]]:
    """Every setting as (environment variable, current value, doc), for `mmstream config`;
    passwords in URLs are masked."""
    rows = []
    for section_name in type(settings).model_fields:
        section = getattr(settings, section_name)
        for name, f in type(section).model_fields.items():
            rows.append((env_name(section_name, name), redact(getattr(section, name)), f.description or ""))
    return rows
