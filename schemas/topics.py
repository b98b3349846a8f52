"""Topic names: the one place they are built and parsed, for the pipeline and its clients alike
(the names are part of the contract between them, as the wire formats are).

Names follow DESIGN.md with a configurable prefix (``mm`` by default; tests use a unique
one per run so they never see each other's records); ``streams.topics`` holds what each
topic is for, its partitions and configs.

With an authenticating broker each tenant has its own topics, guarded by ACLs that let only
that tenant's principal write its ingress and read its replies:

    <p>.ingress.<lane>.<tenant>   the tenant's requests (the router takes the tenant from here)
    <p>.results.<tenant>          its reply topic; ``<p>.results.<tenant>.*`` is the rest of
                                  its reply namespace
    <p>.docs.<tenant>.<collection>  one of its collections (compacted, keyed by document id;
                                  the indexing stage takes the tenant from here)

A tenant name has no dot, so one tenant's topic names never nest inside another's.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from schemas.request import COLLECTION_RE, Lane
from schemas.request import TENANT_RE as REQUEST_TENANT_RE

LANES = (Lane.RT, Lane.BULK)
ANY = "any"
"""The shared encode topic of the no-routing baseline (one generic pool for every modality)."""

TENANT_RE = r"[a-z0-9][a-z0-9_-]{0,47}"
"""A tenant name: lowercase letters, digits, ``_`` and ``-``, at most 48 characters."""


def valid_tenant(name: str) -> bool:
    return isinstance(name, str) and re.fullmatch(TENANT_RE, name) is not None


def tenant_ingress(prefix: str, lane: str, tenant: str) -> str:
    return f"{prefix}.ingress.{lane}.{tenant}"


def tenant_results(prefix: str, tenant: str) -> str:
    return f"{prefix}.results.{tenant}"


def tenant_docs(prefix: str, tenant: str, collection: str) -> str:
    """A collection's documents topic (``schemas.documents``)."""
    return f"{prefix}.docs.{tenant}.{collection}"


def tenant_docs_prefix(prefix: str, tenant: str) -> str:
    """Every collection topic of ``tenant`` starts with this (its ACLs are prefixed on it)."""
    return f"{prefix}.docs.{tenant}."


@dataclass(frozen=True, slots=True)
class TopicNames:
    prefix: str

    def ingress(self, lane: Lane | str) -> str:
        return f"{self.prefix}.ingress.{lane}"

    def encode(self, modality: str, lane: Lane | str) -> str:
        return f"{self.prefix}.encode.{modality}.{lane}"

    def encoded(self, lane: Lane | str) -> str:
        return f"{self.prefix}.encoded.{lane}"

    def generate(self, lane: Lane | str) -> str:
        return f"{self.prefix}.generate.{lane}"

    def retrieve(self, lane: Lane | str) -> str:
        return f"{self.prefix}.retrieve.{lane}"

    @property
    def vectors(self) -> str:
        return f"{self.prefix}.vectors"

    def docs(self, tenant: str, collection: str) -> str:
        return tenant_docs(self.prefix, tenant, collection)

    def docs_pattern(self) -> str:
        """A regular expression matching every tenant's collection topics."""
        return rf"^{re.escape(self.prefix)}\.docs\..+$"

    def parse_docs(self, topic: str) -> tuple[str, str] | None:
        """(tenant, collection) of a collection topic, None for any other topic or a name
        whose tenant or collection is not a valid one."""
        head = f"{self.prefix}.docs."
        if not topic.startswith(head):
            return None
        tenant, dot, collection = topic[len(head):].rpartition(".")
        if not dot or not REQUEST_TENANT_RE.fullmatch(tenant) or not COLLECTION_RE.fullmatch(collection):
            return None
        return tenant, collection

    @property
    def results(self) -> str:
        return f"{self.prefix}.results"

    @property
    def dlq(self) -> str:
        return f"{self.prefix}.dlq"

    def tenant_ingress(self, lane: Lane | str, tenant: str) -> str:
        return tenant_ingress(self.prefix, str(lane), tenant)

    def tenant_results(self, tenant: str) -> str:
        return tenant_results(self.prefix, tenant)

    def ingress_pattern(self) -> str:
        """A regular expression matching the shared ingress topics and every tenant's."""
        return _ingress_pattern(self.prefix)

    def parse_ingress(self, topic: str) -> tuple[str, str | None] | None:
        """(lane, tenant) of an ingress topic (tenant None for a shared one); None for any
        other topic. Called per record and per assigned partition: the pattern is compiled once."""
        m = _ingress_re(self.prefix).fullmatch(topic)
        if m is None:
            return None
        return m.group(1), (m.group(2)[1:] if m.group(2) else None)

    def in_reply_namespace(self, topic: str, tenant: str) -> bool:
        """Whether ``topic`` is ``<p>.results.<tenant>`` or under ``<p>.results.<tenant>.``."""
        own = self.tenant_results(tenant)
        return topic == own or topic.startswith(own + ".")

    def is_internal(self, topic: str) -> bool:
        """A topic no client may have answers written to: every ``<p>.*`` topic but the reply
        topics (``<p>.results`` and ``<p>.results.*``), Faust's ``<p>-*`` topics, changelogs,
        and Kafka's own ``__*`` topics."""
        if topic.startswith("__") or topic.endswith("-changelog") or topic.startswith(f"{self.prefix}-"):
            return True
        if topic.startswith(f"{self.prefix}."):
            return not (topic == self.results or topic.startswith(self.results + "."))
        return False

    @property
    def assembler_done(self) -> str:
        """Requests the assembler answered (compacted; partitioned like the encoded topics)."""
        return f"{self.prefix}.assembler.done"

    @property
    def router_done(self) -> str:
        """Requests the router answered itself (compacted; partitioned like the ingress topics)."""
        return f"{self.prefix}.router.done"

    @property
    def retrieve_done(self) -> str:
        """Searches the retrieve stage answered or forwarded (compacted; partitioned like its input)."""
        return f"{self.prefix}.retrieve.done"

    @property
    def generator_done(self) -> str:
        """Generations the generator finished (compacted; partitioned like the generate topics)."""
        return f"{self.prefix}.generator.done"


def _ingress_pattern(prefix: str) -> str:
    lanes = "|".join(str(lane) for lane in LANES)
    return rf"^{re.escape(prefix)}\.ingress\.({lanes})(\.{TENANT_RE})?$"


@functools.lru_cache(maxsize=16)
def _ingress_re(prefix: str) -> re.Pattern[str]:
    return re.compile(_ingress_pattern(prefix))
