"""The two Kafka admin calls aiokafka lacks: create ACLs, and set SCRAM credentials.

Both go through an open ``AIOKafkaAdminClient`` (whose principal needs ALTER on the
cluster: the pipeline's service principal is a super user), as the wire requests of the
Kafka protocol: CreateAcls v1 (API 30), AlterUserScramCredentials v0 (API 51, KIP-554), and
AlterClientQuotas v0 / DescribeClientQuotas v0 (APIs 49 and 48, KIP-546).
The SCRAM credential is salted and hashed here (RFC 5802's ``Hi``: PBKDF2-HMAC), so the
password itself never travels.

``AclBinding`` is one (resource, pattern, principal, operation, allow) rule; the codes
below are Kafka's own (``org.apache.kafka.common.acl.AclOperation`` and friends).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any, Iterable, TypeAlias

from aiokafka.errors import for_code
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.types import (Array, Boolean, CompactArray, CompactBytes, CompactString, Float64, Int8, Int16,
                                     Int32, Schema, String, TaggedFields)

RESOURCE = {"topic": 2, "group": 3, "cluster": 4, "transactional_id": 5}
PATTERN = {"literal": 3, "prefixed": 4}
OPERATION = {"all": 2, "read": 3, "write": 4, "create": 5, "delete": 6, "alter": 7, "describe": 8,
             "cluster_action": 9, "describe_configs": 10, "alter_configs": 11, "idempotent_write": 12}
ALLOW, DENY = 3, 2
SCRAM = {"SCRAM-SHA-256": (1, "sha256"), "SCRAM-SHA-512": (2, "sha512")}
SCRAM_ITERATIONS = 8192
"""Within Kafka's bounds (4096..16384) for both SCRAM mechanisms."""


class KafkaAdminError(RuntimeError):
    """The broker refused an ACL or credential change; the message carries its error."""


@dataclass(frozen=True, slots=True)
class AclBinding:
    """Allow (or deny) ``principal`` (``User:<name>``) ``operation`` on a resource."""

    resource: str
    """``topic``, ``group``, ``cluster`` or ``transactional_id``."""
    name: str
    pattern: str
    """``literal`` (exactly ``name``) or ``prefixed`` (every name starting with it)."""
    principal: str
    operation: str
    allow: bool = True
    host: str = "*"

    def wire(self) -> tuple[Any, ...]:
        return (RESOURCE[self.resource], self.name, PATTERN[self.pattern], self.principal, self.host,
                OPERATION[self.operation], ALLOW if self.allow else DENY)


# -- CreateAcls v1 with several creations (aiokafka's own request sends one) ---------------

class _CreateAclsResponse_v1(Response):
    API_KEY = 30
    API_VERSION = 1
    SCHEMA = Schema(("throttle_time_ms", Int32),
                    ("creation_responses", Array(("error_code", Int16), ("error_message", String("utf-8")))))


class _CreateAclsRequest_v1(RequestStruct):
    API_KEY = 30
    API_VERSION = 1
    RESPONSE_TYPE = _CreateAclsResponse_v1
    SCHEMA = Schema(("creations", Array(
        ("resource_type", Int8), ("resource_name", String("utf-8")), ("resource_pattern_type", Int8),
        ("principal", String("utf-8")), ("host", String("utf-8")), ("operation", Int8), ("permission_type", Int8))))


class CreateAcls(Request[_CreateAclsRequest_v1]):
    API_KEY = 30

    def __init__(self, bindings: Iterable[AclBinding]) -> None:
        self.creations = [b.wire() for b in bindings]

    def build(self, request_struct_class: type[_CreateAclsRequest_v1]) -> _CreateAclsRequest_v1:
        return request_struct_class(self.creations)


# -- AlterUserScramCredentials v0 (flexible encoding) --------------------------------------

class _AlterScramResponse_v0(Response):
    API_KEY = 51
    API_VERSION = 0
    SCHEMA = Schema(("throttle_time_ms", Int32),
                    ("results", CompactArray(("user", CompactString("utf-8")), ("error_code", Int16),
                                             ("error_message", CompactString("utf-8")), ("tags", TaggedFields))),
                    ("tags", TaggedFields))


class _AlterScramRequest_v0(RequestStruct):
    FLEXIBLE_VERSION = True
    API_KEY = 51
    API_VERSION = 0
    RESPONSE_TYPE = _AlterScramResponse_v0
    SCHEMA = Schema(
        ("deletions", CompactArray(("name", CompactString("utf-8")), ("mechanism", Int8), ("tags", TaggedFields))),
        ("upsertions", CompactArray(("name", CompactString("utf-8")), ("mechanism", Int8), ("iterations", Int32),
                                    ("salt", CompactBytes), ("salted_password", CompactBytes), ("tags", TaggedFields))),
        ("tags", TaggedFields))


_Upsertion: TypeAlias = tuple[str, int, int, bytes, bytes, dict]


class AlterScram(Request[_AlterScramRequest_v0]):
    API_KEY = 51

    def __init__(self, upsertions: list[_Upsertion]) -> None:
        self.upsertions = upsertions

    def build(self, request_struct_class: type[_AlterScramRequest_v0]) -> _AlterScramRequest_v0:
        return request_struct_class([], self.upsertions, {})


def scram_upsertion(user: str, password: str, mechanism: str = "SCRAM-SHA-512",
                    iterations: int = SCRAM_ITERATIONS, salt: bytes | None = None) -> _Upsertion:
    """What AlterUserScramCredentials sends for ``user``: the salted password (``Hi``)."""
    code, digest = SCRAM[mechanism]
    salt = os.urandom(32) if salt is None else salt
    salted = hashlib.pbkdf2_hmac(digest, password.encode("utf-8"), salt, iterations)
    return (user, code, iterations, salt, salted, {})


# -- AlterClientQuotas v0 and DescribeClientQuotas v0 -------------------------------------

_ENTITY = Array(("entity_type", String("utf-8")), ("entity_name", String("utf-8")))


class _AlterQuotasResponse_v0(Response):
    API_KEY = 49
    API_VERSION = 0
    SCHEMA = Schema(("throttle_time_ms", Int32),
                    ("entries", Array(("error_code", Int16), ("error_message", String("utf-8")), ("entity", _ENTITY))))


class _AlterQuotasRequest_v0(RequestStruct):
    API_KEY = 49
    API_VERSION = 0
    RESPONSE_TYPE = _AlterQuotasResponse_v0
    SCHEMA = Schema(("entries", Array(("entity", _ENTITY), ("ops", Array(("key", String("utf-8")), ("value", Float64),
                                                                          ("remove", Boolean))))),
                    ("validate_only", Boolean))


class AlterQuotas(Request[_AlterQuotasRequest_v0]):
    API_KEY = 49

    def __init__(self, user: str, values: dict[str, float]) -> None:
        # A value of 0 removes the quota (Kafka refuses a rate of 0).
        self.entries = [([("user", user)], [(k, float(v), v <= 0) for k, v in sorted(values.items())])]

    def build(self, request_struct_class: type[_AlterQuotasRequest_v0]) -> _AlterQuotasRequest_v0:
        return request_struct_class(self.entries, False)


class _DescribeQuotasResponse_v0(Response):
    API_KEY = 48
    API_VERSION = 0
    SCHEMA = Schema(("throttle_time_ms", Int32), ("error_code", Int16), ("error_message", String("utf-8")),
                    ("entries", Array(("entity", _ENTITY), ("values", Array(("key", String("utf-8")),
                                                                             ("value", Float64))))))


class _DescribeQuotasRequest_v0(RequestStruct):
    API_KEY = 48
    API_VERSION = 0
    RESPONSE_TYPE = _DescribeQuotasResponse_v0
    SCHEMA = Schema(("components", Array(("entity_type", String("utf-8")), ("match_type", Int8),
                                         ("match", String("utf-8")))),
                    ("strict", Boolean))


class DescribeQuotas(Request[_DescribeQuotasRequest_v0]):
    API_KEY = 48

    def __init__(self, user: str) -> None:
        self.user = user

    def build(self, request_struct_class: type[_DescribeQuotasRequest_v0]) -> _DescribeQuotasRequest_v0:
        return request_struct_class([("user", 0, self.user)], True)  # match type 0: exactly this name


# -- the calls -----------------------------------------------------------------------------

async def create_acls(admin: Any, bindings: list[AclBinding]) -> None:
    """Create every binding (existing identical ones are kept: creation is idempotent).
    Raises ``KafkaAdminError`` naming the first one the broker refused."""
    if not bindings:
        return
    response = await admin._send_request(CreateAcls(bindings))  # noqa: SLF001 - aiokafka's only request path
    for binding, (code, message) in zip(bindings, response.creation_responses):
        if code:
            raise KafkaAdminError(f"ACL {binding.operation} on {binding.resource} {binding.name!r} for "
                                  f"{binding.principal}: {for_code(code).__name__} {message or ''}".rstrip())


async def set_scram_password(admin: Any, user: str, password: str, mechanism: str = "SCRAM-SHA-512") -> None:
    """Create or replace ``user``'s SCRAM credential. Raises ``KafkaAdminError`` if refused."""
    response = await admin._send_request(AlterScram([scram_upsertion(user, password, mechanism)]))  # noqa: SLF001
    for name, code, message, _ in response.results:
        if code:
            raise KafkaAdminError(f"SCRAM credential of {name!r}: {for_code(code).__name__} {message or ''}".rstrip())


async def set_user_quotas(admin: Any, user: str, values: dict[str, float]) -> None:
    """Set client quotas of principal ``User:<user>`` (``producer_byte_rate``,
    ``consumer_byte_rate``, ``request_percentage``: the broker throttles the user's clients
    past them; 0 removes one). Raises ``KafkaAdminError`` if refused."""
    if not values:
        return
    response = await admin._send_request(AlterQuotas(user, values))  # noqa: SLF001
    for code, message, _ in response.entries:
        if code:
            raise KafkaAdminError(f"client quotas of {user!r}: {for_code(code).__name__} {message or ''}".rstrip())


async def user_quotas(admin: Any, user: str) -> dict[str, float]:
    """The client quotas set for exactly ``User:<user>`` ({} when none)."""
    response = await admin._send_request(DescribeQuotas(user))  # noqa: SLF001
    if response.error_code:
        raise KafkaAdminError(f"client quotas of {user!r}: {for_code(response.error_code).__name__}")
    return {k: v for _, values in (response.entries or []) for k, v in values}
