"""What a sweep of the stored claim checks does, per tenant (pure; ``streams.stores.claim_sweep``
reads Redis and applies it).

A tenant's Redis user may SET any value under its own prefix (``mm:claim:<tenant>:*``); Redis
has no per-user size limit. So the pipeline sweeps what is stored and bounds it after the
fact: every claim check lives at most ``max_ttl_s`` (one stored without an expiry, or with a
longer one, gets that), and one tenant keeps at most ``quota_bytes``; past it its newest
claim checks (those with the most life left: the writes that went over) are deleted until it
is back under. Between two sweeps a tenant can exceed its quota by what it writes in that
time; the Redis server's own bounds (``proto-max-bulk-len``, ``maxmemory``) hold meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class StoredClaim:
    key: str
    tenant: str
    nbytes: int
    ttl_s: int
    """Remaining life as Redis's TTL says: -1 without an expiry (-2, gone, is left out)."""


@dataclass(frozen=True)
class SweepPlan:
    expire: list[tuple[str, int]] = field(default_factory=list)
    """(key, seconds): claim checks whose life is capped."""
    delete: list[str] = field(default_factory=list)
    """Claim checks of tenants over their quota."""
    deleted_bytes: dict[str, int] = field(default_factory=dict)
    """Tenant -> bytes its deleted claim checks held."""
    stored_bytes: dict[str, int] = field(default_factory=dict)
    """Tenant -> bytes it keeps after the plan."""


def plan_sweep(claims: list[StoredClaim], quota_bytes: int, max_ttl_s: int) -> SweepPlan:
    """The plan for one sweep over ``claims`` (``quota_bytes`` 0: no byte quota)."""
    plan = SweepPlan()
    by_tenant: dict[str, list[StoredClaim]] = {}
    for c in claims:
        by_tenant.setdefault(c.tenant, []).append(c)
    for tenant, owned in sorted(by_tenant.items()):
        total = sum(c.nbytes for c in owned)
        dropped: set[str] = set()
        if quota_bytes > 0 and total > quota_bytes:
            # Newest first: most life left (no expiry counts as the longest), then the key.
            for c in sorted(owned, key=lambda c: (c.ttl_s < 0, c.ttl_s, c.key), reverse=True):
                if total <= quota_bytes:
                    break
                dropped.add(c.key)
                total -= c.nbytes
                plan.deleted_bytes[tenant] = plan.deleted_bytes.get(tenant, 0) + c.nbytes
            plan.delete.extend(sorted(dropped))
        plan.stored_bytes[tenant] = total
        plan.expire.extend((c.key, max_ttl_s) for c in owned
                           if c.key not in dropped and not 0 < c.ttl_s <= max_ttl_s)
    return plan
