"""Keys of the reuse cache. A key changes whenever anything that could change the answer
changes: modality, model id, version, precision, preprocessing version, the normalized
content, and the tenant (unless the deployment opts into cross-tenant sharing). So the
cache can never change an answer, only skip recomputing it."""

from __future__ import annotations

import hashlib

from schemas.request import TENANT_RE

KEY_VERSION = "v1"


def content_digest(content: bytes) -> str:
    """sha256 of the normalized content, hex."""
    return hashlib.sha256(content).hexdigest()


def cache_key(*, modality: str, digest: str, model: str, version: str, precision: str,
              preprocessing: str, tenant: str | None) -> str:
    """The Redis key of one encoder output. ``tenant=None`` means shared across tenants."""
    scope = _scope(tenant)
    for name, value in (("modality", modality), ("model", model), ("version", version), ("precision", precision),
                        ("preprocessing", preprocessing)):
        if not value or "|" in value:
            raise ValueError(f"{name} {value!r} cannot be part of a cache key")
    return f"mm:enc:{KEY_VERSION}|{modality}|{model}|{version}|{precision}|{preprocessing}|{scope}|{digest}"


def result_key(*, tenant: str | None, task: str, parts: list[tuple[str, str]], models: dict[str, str]) -> str | None:
    """The key of a whole request's answer: its task, each part's (modality, content digest)
    in order, and the model identity (name/version/precision/preprocessing) the encoders
    publish for each modality. None when a modality has no published identity (then the
    answer is not cached: the key could not say which model made it)."""
    items = []
    for modality, digest in parts:
        identity = models.get(modality)
        if not identity:
            return None
        items.append(f"{modality}={identity}={digest}")
    scope = _scope(tenant)
    return f"mm:res:{KEY_VERSION}|{task}|{scope}|" + content_digest("\n".join(items).encode())


def _scope(tenant: str | None) -> str:
    """The tenant's part of a key; a name that is no tenant's (one that could end its own
    field and start another) raises ``ValueError`` rather than land in someone's scope."""
    if tenant is None:
        return "shared"
    if not TENANT_RE.fullmatch(tenant):
        raise ValueError(f"{tenant[:40]!r} is not a tenant name")
    return f"t={tenant}"
