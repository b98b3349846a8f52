"""How a client of mmstream connects: the one module both the stages and the client SDK take
their Kafka security (and their Redis connector) from.

``KafkaSecurity`` is the security of one client identity (protocol, SASL mechanism and
credentials, TLS CA and optional client certificate). It is built from the settings
(``from_settings``: the pipeline's service principal) or from a client properties file with
the standard librdkafka keys (``read_properties``: a tenant's file, as `mmstream tenant add`
writes it), and turned into what each client library takes:

- ``aiokafka_kwargs()``: keyword arguments for every aiokafka producer, consumer and admin
  client (PLAINTEXT gives ``{}``, so plaintext clients are built exactly as before);
- ``properties(bootstrap)``: the librdkafka keys (``bootstrap.servers``,
  ``security.protocol``, ``sasl.mechanism``, ``sasl.username``, ``sasl.password``,
  ``ssl.ca.location``) that any Kafka client reads;
- Faust's ``broker_credentials``: ``streams.app.faust_credentials`` (the SDK loads no Faust).

``client_kwargs(settings)`` is the one function every pipeline client gets its options from
(re-exported by ``streams.runtime.stage``). Passwords never appear in a ``repr``.
``connect_redis_async`` is ``workers.redisconn.connect_async``: every Redis client of the
project, the SDK's claim checks included, is made there.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from aiokafka.abc import AbstractTokenProvider
from aiokafka.helpers import create_ssl_context

from workers.redisconn import connect_async as connect_redis_async

__all__ = ["MECHANISMS", "PROTOCOLS", "REDIS_URL_KEY", "FileTokenProvider", "KafkaSecurity", "SecurityConfigError",
           "client_kwargs", "connect_redis_async", "format_properties", "parse_properties", "read_properties",
           "read_redis_url"]

if TYPE_CHECKING:  # the SDK imports this module: it need not load the settings' pydantic models
    from schemas.settings import KafkaSettings, Settings

PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
MECHANISMS = ("SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN", "OAUTHBEARER")


class SecurityConfigError(ValueError):
    """A security description that no client could connect with (names what is wrong)."""


class FileTokenProvider(AbstractTokenProvider):
    """OAUTHBEARER: the token is whatever ``path`` holds when a connection is opened, so a
    renewer (a sidecar, a cron job) rotates it by rewriting the file."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    async def token(self) -> str:
        return self.path.read_text().strip()


@dataclass(frozen=True)
class KafkaSecurity:
    """The security settings of one Kafka client identity."""

    protocol: str = "PLAINTEXT"
    mechanism: str = "SCRAM-SHA-512"
    """SASL mechanism (only read with a SASL_* protocol)."""
    username: str = ""
    password: str = field(default="", repr=False)
    ca_file: str = ""
    """PEM CA bundle that signed the brokers' certificates; empty: the system's CAs."""
    cert_file: str = ""
    key_file: str = field(default="", repr=False)
    check_hostname: bool = True
    oauth_token_file: str = ""

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise SecurityConfigError(f"security protocol {self.protocol!r} is not one of {', '.join(PROTOCOLS)}")
        if self.sasl and self.mechanism not in MECHANISMS:
            raise SecurityConfigError(f"SASL mechanism {self.mechanism!r} is not one of {', '.join(MECHANISMS)}")

    @property
    def sasl(self) -> bool:
        return self.protocol.startswith("SASL_")

    @property
    def tls(self) -> bool:
        return self.protocol in ("SSL", "SASL_SSL")

    @classmethod
    def from_settings(cls, kafka: KafkaSettings) -> "KafkaSecurity":
        return cls(protocol=kafka.security_protocol, mechanism=kafka.sasl_mechanism, username=kafka.username,
                   password=kafka.password.get_secret_value(), ca_file=kafka.ssl_ca_file,
                   cert_file=kafka.ssl_cert_file, key_file=kafka.ssl_key_file,
                   check_hostname=kafka.ssl_check_hostname, oauth_token_file=kafka.oauth_token_file)

    def ssl_context(self) -> ssl.SSLContext | None:
        """A TLS context that trusts ``ca_file`` (and presents ``cert_file``), or None without TLS."""
        if not self.tls:
            return None
        ctx = create_ssl_context(cafile=self.ca_file or None, certfile=self.cert_file or None,
                                 keyfile=self.key_file or None)
        ctx.check_hostname = self.check_hostname
        return ctx

    def aiokafka_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for an aiokafka producer, consumer or admin client."""
        if self.protocol == "PLAINTEXT":
            return {}
        kw: dict[str, Any] = {"security_protocol": self.protocol}
        if self.tls:
            kw["ssl_context"] = self.ssl_context()
        if self.sasl:
            kw["sasl_mechanism"] = self.mechanism
            if self.mechanism == "OAUTHBEARER":
                kw["sasl_oauth_token_provider"] = FileTokenProvider(self.oauth_token_file)
            else:
                kw["sasl_plain_username"] = self.username
                kw["sasl_plain_password"] = self.password
        return kw


    def properties(self, bootstrap: str) -> dict[str, str]:
        """The standard librdkafka client keys for this identity (no empty values)."""
        props = {"bootstrap.servers": bootstrap, "security.protocol": self.protocol}
        if self.sasl:
            props["sasl.mechanism"] = self.mechanism
            if self.mechanism != "OAUTHBEARER":
                props["sasl.username"] = self.username
                props["sasl.password"] = self.password
        if self.tls:
            if self.ca_file:
                props["ssl.ca.location"] = self.ca_file
            if self.cert_file:
                props["ssl.certificate.location"] = self.cert_file
                props["ssl.key.location"] = self.key_file
            if not self.check_hostname:
                props["ssl.endpoint.identification.algorithm"] = "none"
        return props

    @classmethod
    def from_properties(cls, props: Mapping[str, str]) -> "KafkaSecurity":
        """The identity a librdkafka properties mapping describes (its other keys ignored)."""
        protocol = props.get("security.protocol", "PLAINTEXT").upper()
        return cls(protocol=protocol, mechanism=props.get("sasl.mechanism", props.get("sasl.mechanisms",
                                                                                     "SCRAM-SHA-512")).upper(),
                   username=props.get("sasl.username", ""), password=props.get("sasl.password", ""),
                   ca_file=props.get("ssl.ca.location", ""), cert_file=props.get("ssl.certificate.location", ""),
                   key_file=props.get("ssl.key.location", ""),
                   check_hostname=props.get("ssl.endpoint.identification.algorithm", "https").lower() != "none")


def client_kwargs(settings: Settings) -> dict[str, Any]:
    """Options every Kafka client of the pipeline passes (security lives here): ``{}`` for
    PLAINTEXT, else protocol, SASL credentials and a TLS context from ``settings.kafka``."""
    return KafkaSecurity.from_settings(settings.kafka).aiokafka_kwargs()


# -- client properties files (the librdkafka format: key=value lines, # comments) ------------

def parse_properties(text: str) -> dict[str, str]:
    """``key=value`` (or ``key: value``) lines; blank lines and ``#``/``!`` comments skipped.
    Values are taken as written (no escapes: the files this project writes need none)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line[0] in "#!":
            continue
        cut = min((i for i in (line.find("="), line.find(":")) if i > 0), default=-1)
        if cut < 0:
            raise SecurityConfigError(f"not a key=value line: {line.split()[0][:40]!r}")
        out[line[:cut].strip()] = line[cut + 1:].strip()
    return out


REDIS_URL_KEY = "mmstream.redis.url"
"""The one key of a client properties file that is mmstream's own: the tenant's Redis user
for claim checks. It is written as a comment (``# mmstream.redis.url=...``), so librdkafka
clients, which refuse unknown keys, take the file as it is."""


def read_redis_url(path: Path) -> str | None:
    """The ``mmstream.redis.url`` comment line's URL of a client properties file, if any."""
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        body = line.strip().lstrip("#!").strip()
        if line.strip()[:1] in ("#", "!") and body.startswith(REDIS_URL_KEY + "="):
            return body[len(REDIS_URL_KEY) + 1:].strip() or None
    return None


def read_properties(path: Path) -> tuple[str, KafkaSecurity]:
    """(bootstrap servers, identity) from a client properties file.

    Raises ``SecurityConfigError`` when the file lacks ``bootstrap.servers`` or names an
    unknown protocol or mechanism, ``OSError`` when it cannot be read."""
    props = parse_properties(Path(path).read_text(encoding="utf-8"))
    bootstrap = props.get("bootstrap.servers", "")
    if not bootstrap:
        raise SecurityConfigError(f"{path} has no bootstrap.servers")
    return bootstrap, KafkaSecurity.from_properties(props)


def format_properties(props: Mapping[str, str], header: str = "") -> str:
    """A properties file's text: ``header`` as ``#`` comment lines, then one ``key=value`` each."""
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    lines += [f"{k}={v}" for k, v in props.items()]
    return "\n".join(lines) + "\n"
