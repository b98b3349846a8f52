"""The sweep that bounds what tenants keep in Redis as claim checks (the policy is
``streams.policies.claim_quota``): SCAN of ``mm:claim:*``, each key's size and TTL in
pipelined round trips, then the plan's EXPIREs and DELs. Run by every router replica every
``quota.claim_sweep_s`` as the workers' user; sweeps by two replicas agree, so running twice
costs only time. Best effort: a Redis that does not answer skips a sweep.
"""

from __future__ import annotations

import logging
from typing import Any

from schemas.request import TENANT_RE
from streams.policies.claim_quota import StoredClaim, SweepPlan, plan_sweep

log = logging.getLogger(__name__)
PATTERN = "mm:claim:*"
BATCH = 500


async def sweep(redis: Any, quota_bytes: int, max_ttl_s: int, max_keys: int = 200_000) -> SweepPlan:
    """One sweep over at most ``max_keys`` claim checks; returns what it did."""
    claims: list[StoredClaim] = []
    batch: list[str] = []
    async for raw in redis.scan_iter(match=PATTERN, count=BATCH):
        batch.append(raw.decode() if isinstance(raw, bytes) else str(raw))
        if len(batch) >= BATCH:
            claims += await _measure(redis, batch)
            batch = []
        if len(claims) + len(batch) >= max_keys:
            break
    if batch:
        claims += await _measure(redis, batch)
    plan = plan_sweep(claims, quota_bytes, max_ttl_s)
    if plan.expire or plan.delete:
        pipe = redis.pipeline(transaction=False)
        for key, ttl in plan.expire:
            pipe.expire(key, ttl, lt=True)  # never lengthens a life (one re-set meanwhile, one under 1 s)
        for i in range(0, len(plan.delete), BATCH):
            pipe.delete(*plan.delete[i:i + BATCH])
        await pipe.execute()
    for tenant, nbytes in plan.deleted_bytes.items():
        log.warning("claim sweep: tenant %s kept more than %d bytes of claim checks; deleted %d bytes of its newest",
                    tenant, quota_bytes, nbytes)
    return plan


async def _measure(redis: Any, keys: list[str]) -> list[StoredClaim]:
    pipe = redis.pipeline(transaction=False)
    for key in keys:
        pipe.strlen(key)
        pipe.ttl(key)
    answers = await pipe.execute(raise_on_error=False)
    out = []
    for i, key in enumerate(keys):
        nbytes, ttl = answers[2 * i], answers[2 * i + 1]
        tenant = key.split(":", 3)[2] if key.count(":") >= 3 else ""
        if isinstance(nbytes, int) and isinstance(ttl, int) and ttl != -2:
            # A key whose tenant segment is no tenant's (the shared clients' user could write
            # one) is capped too, all such keys under one bucket.
            out.append(StoredClaim(key, tenant if TENANT_RE.fullmatch(tenant) else "", nbytes, ttl))
    return out
