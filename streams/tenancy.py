"""Tenant names and the topics a tenant owns (kept apart from ``streams.topics`` so the SDK
can name them without loading the modality registry).

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

import re

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
