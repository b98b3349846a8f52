"""What encoders tell the router through Redis: their load, and which model answers each
modality. Both sides are best effort: Redis down only means the router keeps its last
numbers (and, past their staleness, treats the pool as idle).

- ``publish_load`` / ``read_loads``: each encoder replica's load report (see
  ``streams.policies.load``), a field of the hash ``mm:load:<prefix>`` named by stage and replica,
  refreshed a few times a second.
- ``publish_identity`` / ``read_identities``: model identities, for the whole-result cache key.
- ``publish_gen_cost`` / ``read_gen_costs``: each generator replica's measured step cost
  (``streams.policies.gen_price.GenCost``), what the router prices generate requests with.
- ``add_gen_credits`` / ``take_gen_credits``: output tokens a tenant was charged for and did not
  get (a generation that ended before its ``max_tokens``), per tenant in
  ``mm:gencredit:<prefix>:<router replica>`` (the one that charged them): that router gives them
  back to the tenant's compute bucket.
"""

from __future__ import annotations

import json
import logging
from typing import Any

log = logging.getLogger(__name__)


def load_key(topic_prefix: str) -> str:
    return f"mm:load:{topic_prefix}"


async def publish_load(redis: Any, topic_prefix: str, replica: str, report: dict[str, Any]) -> None:
    await _publish(redis, load_key(topic_prefix), replica, report)


async def read_loads(redis: Any, topic_prefix: str) -> dict[str, dict[str, Any]]:
    """replica -> its last report; {} when Redis cannot be read."""
    return await _read(redis, load_key(topic_prefix))


async def _publish(redis: Any, key: str, replica: str, report: dict[str, Any]) -> None:
    await _hset(redis, key, replica, json.dumps(report, separators=(",", ":")))


async def _read(redis: Any, key: str) -> dict[str, dict[str, Any]]:
    """field -> its JSON object, the fields that hold none left out."""
    out = {}
    for k, v in (await _hgetall(redis, key)).items():
        try:
            value = json.loads(_text(v))
        except (TypeError, ValueError):
            continue
        if isinstance(value, dict):
            out[_text(k)] = value
    return out


def models_key(topic_prefix: str) -> str:
    return f"mm:models:{topic_prefix}"


async def publish_identity(redis: Any, topic_prefix: str, modality: str, identity: str) -> None:
    """Which model (name/version/precision/preprocessing) answers ``modality``: part of the
    whole-result cache key, so a new model never serves an old model's answers."""
    await _hset(redis, models_key(topic_prefix), modality, identity)


async def read_identities(redis: Any, topic_prefix: str) -> dict[str, str]:
    return {_text(k): _text(v) for k, v in (await _hgetall(redis, models_key(topic_prefix))).items()}


def gen_cost_key(topic_prefix: str) -> str:
    return f"mm:gencost:{topic_prefix}"


async def publish_gen_cost(redis: Any, topic_prefix: str, replica: str, report: dict[str, Any]) -> None:
    await _publish(redis, gen_cost_key(topic_prefix), replica, report)


async def read_gen_costs(redis: Any, topic_prefix: str) -> dict[str, dict[str, Any]]:
    """replica -> its last step cost report; {} when Redis cannot be read."""
    return await _read(redis, gen_cost_key(topic_prefix))


CREDIT_TTL_S = 600
"""How long a router replica's credits wait for it: a replica that went away (scaled in,
crashed) takes none, and its hash must not stay in Redis for ever. Its tenants' buckets went
with it, so nothing is lost that was owed to a live bucket."""


def gen_credit_key(topic_prefix: str, router: str | None = None) -> str:
    """The hash of credits owed to one router replica's buckets (``Manifest.charged_by``); without
    one, the shared hash (jobs whose manifest names no router), which any router takes."""
    return f"mm:gencredit:{topic_prefix}" if router is None else f"mm:gencredit:{topic_prefix}:{router}"


async def add_gen_credits(redis: Any, topic_prefix: str, tokens: dict[str | None, dict[str, int]]) -> bool:
    """Add output tokens each tenant was charged for and did not get (router replica -> tenant
    -> tokens; None: the shared hash); False when Redis could not take them (the caller keeps
    them for its next try)."""
    if not any(tokens.values()):
        return True
    try:
        pipe = redis.pipeline(transaction=False)
        for router, owed in tokens.items():
            key = gen_credit_key(topic_prefix, router)
            for tenant, n in owed.items():
                pipe.hincrby(key, tenant, int(n))
            if router is not None and owed:
                pipe.expire(key, CREDIT_TTL_S)
        await pipe.execute()
        return True
    except Exception as exc:
        log.debug("adding generation credits failed: %r", exc)
        return False


async def take_gen_credits(redis: Any, topic_prefix: str, router: str) -> dict[str, int]:
    """The tokens owed back per tenant to ``router``'s buckets, with those of the shared hash,
    taken (read and removed in one transaction, so two router replicas never give the same
    tokens back twice); {} when Redis cannot be read."""
    keys = (gen_credit_key(topic_prefix, router), gen_credit_key(topic_prefix))
    try:
        pipe = redis.pipeline(transaction=True)
        for key in keys:
            pipe.hgetall(key)
        pipe.delete(*keys)
        *got, _ = await pipe.execute()
    except Exception as exc:
        log.debug("taking generation credits failed: %r", exc)
        return {}
    out: dict[str, int] = {}
    for k, v in (item for owed in got for item in owed.items()):
        try:
            n = int(_text(v))
        except ValueError:
            continue
        if n > 0:
            out[_text(k)] = out.get(_text(k), 0) + n
    return out


async def _hset(redis: Any, key: str, field: str, value: str) -> None:
    """Best effort: Redis trouble only means the readers keep their last numbers."""
    try:
        await redis.hset(key, field, value)
    except Exception as exc:
        log.debug("publishing %s failed: %r", key, exc)


async def _hgetall(redis: Any, key: str) -> dict[Any, Any]:
    try:
        return await redis.hgetall(key)
    except Exception as exc:
        log.debug("reading %s failed: %r", key, exc)
        return {}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
