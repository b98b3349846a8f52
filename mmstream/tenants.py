"""`mmstream tenant add`: a tenant's credentials, topics and ACLs, and its client file.

A tenant is a SASL (SCRAM) user of an authenticating broker. What it may do is exactly what
``tenant_acls`` grants, nothing else (the broker refuses whatever no ACL allows):

- WRITE its ingress topics ``<p>.ingress.<lane>.<tenant>``, one per lane it is given (literal
  names: a prefix would also match a tenant whose name merely starts the same);
- READ its reply topic ``<p>.results.<tenant>`` and its reply namespace
  ``<p>.results.<tenant>.*`` (prefixed, ending in the dot);
- READ consumer groups named ``<tenant>.*`` (for clients that consume in a group; the SDK
  reads by assignment and needs none);
- WRITE its collections ``<p>.docs.<tenant>.*`` (prefixed, ending in the dot; the operator
  creates each one with `mmstream collection add --tenant`).

No internal topic (encode, encoded, generate, done markers, DLQ, the shared ingress and
results) and no cluster operation: those are the service principal's alone.

``add_tenant`` sets the credential (Admin API, salted here), creates the tenant's topics,
its ACLs and its client quotas on the broker (``broker_quotas``: the bytes per second its
clients may produce, so a flooding tenant is throttled by the broker before the router reads it); ``properties_text`` is the client properties file with the standard
librdkafka keys (``bootstrap.servers``, ``security.protocol``, ``sasl.mechanism``,
``sasl.username``, ``sasl.password``, ``ssl.ca.location``) and, as comments, the topics to use.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from mmstream.kafka_admin import AclBinding, create_acls, set_scram_password, set_user_quotas
from mmstream.localstack.secure import BROKER_USER
from schemas.settings import Settings
from streams.connection import REDIS_URL_KEY, KafkaSecurity, client_kwargs, format_properties
from schemas.topics import tenant_docs_prefix, valid_tenant
from schemas.topics import LANES, TopicNames
from streams.topics import ensure_topics, tenant_topic_specs


LOGIN_WAIT_S = 30.0
RESERVED_NAMES = frozenset({"default", "other", "mmadmin", "mmworker", "mmclient"})
"""Names a tenant may not take: ``default`` is whom the shared ingress topics and unreadable
requests are answered as (the operators' namespace), ``other`` the shed metric's label for
every tenant past the named ones, and the rest the local Redis's own users."""


class TenantError(ValueError):
    """A tenant that cannot be added as asked (the message says why)."""


@dataclass(frozen=True)
class Tenant:
    """A tenant as added: its name, lanes and the identity its clients use."""

    name: str
    lanes: tuple[str, ...]
    bootstrap: str
    security: KafkaSecurity


def check_name(name: str, settings: Settings) -> None:
    """Raise ``TenantError`` unless ``name`` is a valid tenant name that is not one of the
    pipeline's own principals."""
    if not valid_tenant(name):
        raise TenantError(f"{name!r} is not a tenant name: lowercase letters, digits, _ and -, starting with a "
                          "letter or digit, at most 48 characters")
    if name in {settings.kafka.username, BROKER_USER}:
        raise TenantError(f"{name!r} is one of the pipeline's own principals, not a tenant")
    if name in RESERVED_NAMES:
        raise TenantError(f"{name!r} is reserved ({', '.join(sorted(RESERVED_NAMES))} are the pipeline's own "
                          "names); choose another")


def parse_lanes(lanes: Sequence[str] | None) -> tuple[str, ...]:
    """The lanes asked for (default: all), checked; raises ``TenantError``."""
    known = tuple(str(lane) for lane in LANES)
    wanted = tuple(dict.fromkeys(l.strip() for item in (lanes or known) for l in item.split(",") if l.strip()))
    unknown = [l for l in wanted if l not in known]
    if unknown or not wanted:
        raise TenantError(f"unknown lane {', '.join(unknown) or '(none)'}; lanes: {', '.join(known)}")
    return wanted


def tenant_acls(prefix: str, tenant: str, lanes: Sequence[str]) -> list[AclBinding]:
    """Every ACL a tenant gets (see the module docstring)."""
    names = TopicNames(prefix)
    user = f"User:{tenant}"
    acls = [AclBinding("topic", names.tenant_ingress(lane, tenant), "literal", user, "write") for lane in lanes]
    acls.append(AclBinding("topic", names.tenant_results(tenant), "literal", user, "read"))
    acls.append(AclBinding("topic", names.tenant_results(tenant) + ".", "prefixed", user, "read"))
    acls.append(AclBinding("group", f"{tenant}.", "prefixed", user, "read"))
    # Its collections (`mmstream collection add` creates them): it writes documents there.
    acls.append(AclBinding("topic", tenant_docs_prefix(prefix, tenant), "prefixed", user, "write"))
    return acls


def broker_quotas(settings: Settings) -> dict[str, float]:
    """The client quotas a tenant's principal gets on the broker (0: none, and one set by an
    earlier `tenant add` is removed)."""
    q = settings.quota
    return {"producer_byte_rate": float(q.produce_bytes_per_s), "consumer_byte_rate": float(q.fetch_bytes_per_s),
            "request_percentage": float(q.request_percentage)}


async def add_tenant(settings: Settings, name: str, lanes: Sequence[str] | None = None,
                     password: str | None = None) -> Tenant:
    """Create (or update: the password is replaced, ACLs and topics kept) tenant ``name`` on
    the configured broker, as the service principal of ``settings``.

    Raises ``TenantError`` for a bad name or lanes, or a broker that does not authenticate;
    ``KafkaAdminError`` or ``KafkaError`` when the broker refuses."""
    check_name(name, settings)
    chosen = parse_lanes(lanes)
    k = settings.kafka
    if not k.authenticated or not k.security_protocol.startswith("SASL_"):
        raise TenantError("tenants need a SASL broker: set MMSTREAM_KAFKA_SECURITY_PROTOCOL=SASL_SSL and the "
                          "service principal's credentials (`mmstream up --secure` starts a local one and says how)")
    mechanism = k.sasl_mechanism if k.sasl_mechanism.startswith("SCRAM-") else "SCRAM-SHA-512"
    password = password or secrets.token_urlsafe(24)
    specs = tenant_topic_specs(k, name, chosen)
    admin = AIOKafkaAdminClient(bootstrap_servers=k.bootstrap, **client_kwargs(settings))
    await admin.start()
    try:
        await set_scram_password(admin, name, password, mechanism)
        await create_acls(admin, tenant_acls(k.topic_prefix, name, chosen))
        await set_user_quotas(admin, name, broker_quotas(settings))
    finally:
        await admin.close()
    await ensure_topics(k.bootstrap, specs, k.replication_factor, client_kwargs(settings))
    security = KafkaSecurity(protocol=k.security_protocol, mechanism=mechanism, username=name, password=password,
                             ca_file=str(Path(k.ssl_ca_file).resolve()) if k.ssl_ca_file else "",
                             check_hostname=k.ssl_check_hostname)
    await wait_until_login(k.bootstrap, security)
    return Tenant(name, chosen, k.bootstrap, security)


async def wait_until_login(bootstrap: str, security: KafkaSecurity, timeout_s: float = LOGIN_WAIT_S) -> None:
    """Return once ``security`` can log in (a new SCRAM credential reaches the brokers
    through the metadata log a moment after it was accepted); raises ``TenantError`` when it
    still cannot after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5000, **security.aiokafka_kwargs())
        try:
            await admin.start()
            return
        except KafkaError as exc:
            if time.monotonic() >= deadline:
                raise TenantError(f"the new credential of {security.username!r} still cannot log in after "
                                  f"{timeout_s:.0f} s: {exc}") from None
        finally:
            await admin.close()
        await asyncio.sleep(0.25)


def properties_text(tenant: Tenant, prefix: str, redis_url: str = "") -> str:
    """The tenant's client properties file (standard librdkafka keys; topics as comments;
    the tenant's own Redis user for claim checks, when it has one, as the comment line
    ``mmstream.redis.url=...`` that ``Client.from_properties`` reads and librdkafka skips)."""
    names = TopicNames(prefix)
    header = "\n".join([
        f"mmstream tenant {tenant.name}: any Kafka client reads the keys below.",
        *[f"send {lane} requests to: {names.tenant_ingress(lane, tenant.name)}" for lane in tenant.lanes],
        f"read answers from:     {names.tenant_results(tenant.name)}",
        *(["claim checks (parts over the inline limit) go to Redis as the tenant's own user:",
           f"{REDIS_URL_KEY}={redis_url}"] if redis_url else []),
        "Keep this file private: it holds the tenant's password.",
    ])
    return format_properties(tenant.security.properties(tenant.bootstrap), header)
