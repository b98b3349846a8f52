"""Typed, frozen settings for every component, read once from the environment.

Each component has one ``*Settings`` section (a frozen pydantic model): the infrastructure's
here, the serving policies' in ``schemas.settings_serving``, their building blocks in
``schemas.settings_base``. A field ``name`` of
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
from typing import Any, Literal, Mapping

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict
from pydantic_settings.sources.utils import parse_env_vars

# The sections and value sets other modules import from here live in two modules of their own.
from schemas.settings_base import (ENGINE_PRECISIONS, ENV_PREFIX, Bootstrap, EnginePrecision, LmPrecision, Partitioner,
                                   SaslMechanism, Section, SecurityProtocol, UserPath, nice_value, parse_assignments,
                                   setting)
from schemas.settings_serving import (AdmissionSettings, AssemblerSettings, CacheSettings, DlqSettings, EncoderSettings,
                                      GeneratorSettings, LimitsSettings, QuotaSettings, RouterSettings, VideoSettings,
                                      parse_quota_overrides)
from schemas.settings_autoscale import AutoscaleSettings
from schemas.settings_retrieval import RetrievalSettings

__all__ = ["ENGINE_PRECISIONS", "EnginePrecision", "Partitioner", "DlqSettings", "parse_quota_overrides", "Settings",
           "SettingsError", "KafkaSettings", "LocalSettings", "ModelSettings", "describe", "env_name", "env_names",
           "redact"]


class KafkaSettings(Section):
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
    fetch_max_bytes: int = setting(
        1024 * 1024, "Most bytes one fetch response of a stage's consumer carries (fetch.max.bytes), at least one "
        "record batch whatever its size: a smaller response reaches the stage sooner, so a small record is not held up "
        "behind megabytes of other records fetched with it. Per partition the limit is max_message_bytes (a "
        "partition whose first batch is over the response's room is fetched when it comes first: the client shuffles "
        "the partitions of every fetch, unless fetch_small_first).", ge=1024
    )
    fetch_small_first: bool = setting(
        True, "A stage's fetch requests name the partitions whose recent records are smallest first "
        "(streams/runtime/fetch_order.py): a small record on the broker goes out in the next response instead of "
        "waiting for the fetch that names its partition first while another partition holds megabyte records. One "
        "request in eight keeps the client's shuffled order, so no partition starves. false: the client's order.",
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
        6_000, "How long the broker keeps a silent stage replica's partitions: a killed replica's work moves after "
        "this, and a replica paused this long (GC, a stall) costs a rebalance. A stage stops sending a third of it "
        "earlier. 6000 is the least a stock broker accepts (group.min.session.timeout.ms); the local and chaos "
        "brokers accept 1000, and the chaos scenarios run at 3000.", ge=1_000
    )
    heartbeat_interval_ms: int = setting(
        500, "How often a stage replica tells the broker it is alive (at most a third of the session timeout); it is "
        "also how late a replica learns that a rebalance started, so a new replica's join waits up to this for the "
        "others.", ge=100
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


class RedisSettings(Section):
    url: str = setting(
        "redis://127.0.0.1:6379/0", "Redis of the workers (reuse cache, load reports, claim checks), as "
        "redis://[user:password@]host:port/db; rediss:// for TLS. A password in it is never printed.",
        pattern=r"^(redis|rediss|unix)://",
    )
    client_url: str = setting(
        "", "Redis the SDK and `mmstream send` store claim checks in, usually as a user that may only SET and GET "
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


class MetricsSettings(Section):
    port: int = setting(
        0, "Port of this worker's /metrics, /healthz and /readyz; 0 picks a free one (reported by `mmstream status`).",
        ge=0, le=65535,
    )
    bind: str = setting(
        "127.0.0.1", "Address /metrics listens on; 0.0.0.0 to let a remote Prometheus scrape.", min_length=1
    )
    lag_interval_s: float = setting(5.0, "How often the lag monitor reads offsets from the broker.", gt=0)


class LocalSettings(Section):
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
    kafka_jit: Literal["auto", "c1", "tiered"] = setting(
        "auto", "How the local broker's JVM compiles: c1 (its quick compiler only), tiered (the JVM's default, C1 "
        "then C2) or auto: c1 for the plaintext broker, tiered for the TLS one of `up --secure`. Measured on 2 "
        "cores (docs/capacity.md): c1 spent 40% less broker CPU per request in the broker's first minute under "
        "load and about the same after, and 2.6x more under a TLS flood (AES-GCM is fast only in C2's code)."
    )
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
    redis_secure_port: int = setting(
        6380, "Port of the secured local Redis of `mmstream up --secure` (ACL users, the default user off; it runs "
        "beside the plain one).", ge=1, le=65535
    )
    redis_maxmemory_mb: int = setting(256, "Redis memory cap; keys are evicted LRU past it.", ge=1)
    parent_pid: int = setting(
        0, "The process a worker belongs to: the worker stops (SIGTERM to itself, SIGKILL 30 s later if it still "
        "runs) once that process is no longer its parent. Set by what starts a pipeline for itself (`mmstream bench "
        "--own-pipeline`, chaos runs, the integration tests), so that one killed without its cleanup leaves no "
        "workers running; 0, the default, for `mmstream up`, whose workers outlive the command.", ge=0
    )
    metrics_base_port: int = setting(
        9400, "First Prometheus port handed to local workers; 0 lets each worker pick a free one.", ge=0, le=65535
    )
    nice: str = setting(
        "router=-10", "CPU priority (Linux nice, -20 first to 19 last) of the processes `mmstream up` starts, as "
        "name=nice pairs: a stage (router, assembler, encode.image...), broker or redis; the rest run at 0 (empty: "
        "all at 0). Each process runs in a session of its own: this is its autogroup's value and its threads'. A "
        "negative value needs root or CAP_SYS_NICE; without, the process runs at 0 with a warning. The router runs "
        "ahead by default: its own encoder answers short texts, and another tenant's flood then cannot push it off "
        "the cores (B's rt p99 under the fairness flood 40-65 ms raised against 64-88 at 0, stop 56). A raised "
        "router steps back to 0 while admission refuses for want of capacity (router.step_back_rate): stop 44 found "
        "a router raised past capacity leaving the pools too few cores; with the step back and the encoders' wait "
        "bound the admitted text p99 at 2x was under 1 s in 8 of 9 runs raised (1,244 ms once) and 11 of 11 at 0, "
        "with more answered raised (docs/isolation.md, docs/capacity.md \"Stop 56\")."
    )

    @field_validator("nice")
    @classmethod
    def _nice_pairs(cls, value: str) -> str:
        parse_assignments(value, nice_value, "name=nice with nice -20..19")
        return value

    def nice_of(self, name: str) -> int:
        """The CPU priority ``nice`` gives process ``name`` (a stage, broker or redis; 0 if not named)."""
        return parse_assignments(self.nice, nice_value, "name=nice").get(name, 0)


class ModelSettings(Section):
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


class ModalitiesSettings(Section):
    plugins: str = setting(
        "", "Comma-separated Python modules that each register an extra modality when imported "
        "(see docs/adding-a-modality.md); every worker and the CLI load them at start."
    )


def _section(cls: type[Section]) -> Any:
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
    retrieval: RetrievalSettings = _section(RetrievalSettings)
    autoscale: AutoscaleSettings = _section(AutoscaleSettings)

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
