"""Per-tenant quotas at the router: one tenant cannot take the pool from the others. Pure:
plain data in, a decision out; the router asks before admission and tells what it sent.

Two limits, each off at 0:

- **rate**: a token bucket per tenant (``rate_per_s`` refill, ``burst`` capacity; a tenant
  may have its own in ``overrides``). A request takes one token; with none left it is shed,
  ``retry_after_ms`` being the time until the next token.
- **queued work**: the router cannot see a tenant's share of the queues, so it counts the
  work it sent for the tenant (predicted engine ms) until, by its own prediction, that work
  is done: sent at ``t`` with a predicted queue wait ``w`` and cost ``c``, it counts until
  ``t + w + c`` (at most ``window_ms``). A tenant over ``max_queued_ms`` is shed; and while
  another tenant is kept out of a stage this request needs (refused by admission as
  ``overloaded`` for that stage's queue within the window, told by ``note_refused``), one over
  ``fair_share`` of the lane's admission limit is shed too: a tenant alone, or among tenants
  that all get in, may fill the pool; one that fills it while another is turned away is held
  back until that one gets its turn. A tenant kept out of the audio pool holds back no one
  whose requests never go there. ``retry_after_ms`` is
  when enough of its counted work is predicted done.

- **ref bytes**: a second token bucket per tenant, in bytes (``ref_bytes_per_s`` refill,
  ``ref_bytes_burst`` capacity): a request takes the stored size of what its refs name (the
  router sizes them first), so a small request cannot make the workers read gigabytes. A
  request bigger than the bucket waits for a full one and leaves it in debt.
- **compute**: a third bucket, in predicted engine milliseconds (``compute_ms_per_s`` refill,
  ``compute_burst_ms`` capacity): a request takes what the router priced all of its work at
  (every part's encode, by its length or its pixels; a generation by its prompt and output
  tokens). The other limits bound what a tenant has queued; this one bounds how much of the
  engines it takes per second, queued or not, so a tenant within its queued-work share
  cannot keep every core busy with admitted work. It is taken when the request is sent (a
  request admission refuses costs nothing), checked before: a request bigger than the bucket
  waits for a full one and leaves it in debt, as with ref bytes; or, with ``compute_debt``
  off, is refused outright (``retry_after_ms`` None: it would never fit), so no single
  request may cost more than the bucket holds.

Shed means ``overloaded`` with ``retry_after_ms`` (the router's ``Reject``). Memory is bounded:
a tenant's counts are dropped once idle longer than its bucket needs to refill and the
window to empty, and past ``max_tenants`` the least recently seen go first (a dropped tenant
starts again with a full bucket, which costs at most one burst).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import islice
from typing import Collection, Literal, Mapping, get_args

COMPUTE_BURST_S = 2.0
"""The compute bucket's default capacity, in seconds of its refill."""
SLOTS = 10
"""Counted work is kept in this many slots of ``window_ms / SLOTS`` (memory per tenant is
constant; a job counts until the end of the slot its predicted end falls in)."""


@dataclass(frozen=True, slots=True)
class QuotaLimits:
    rate_per_s: float = 0.0
    """Requests per second per tenant; 0: no rate limit."""
    burst: float = 0.0
    """Bucket capacity; 0: one second's worth (at least one request)."""
    overrides: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    """tenant -> (rate_per_s, burst) for tenants that differ from the default."""
    fair_share: float = 0.5
    """Largest share of a lane's queued-work limit one tenant's counted work may hold while
    another tenant is being refused; 0: off."""
    max_queued_ms: float = 0.0
    """Counted work (ms) past which a tenant is shed, alone or not; 0: off."""
    window_ms: float = 10_000.0
    max_tenants: int = 10_000
    ref_bytes_per_s: float = 0.0
    """Bytes per second a tenant's refs may name; 0: no byte limit."""
    ref_bytes_burst: float = 0.0
    """The byte bucket's capacity; 0: one second's worth."""
    compute_ms_per_s: float = 0.0
    """Predicted engine ms per second a tenant's requests may cause; 0: no compute limit."""
    compute_burst_ms: float = 0.0
    """The compute bucket's capacity; 0: ``COMPUTE_BURST_S`` seconds' worth."""
    compute_debt: bool = True
    """A request priced over the compute bucket is admitted on a full one, leaving it in debt;
    False: refused, as too costly for the tenant's quota."""

    @property
    def ref_capacity(self) -> float:
        return self.ref_bytes_burst if self.ref_bytes_burst > 0 else self.ref_bytes_per_s

    @property
    def compute_capacity(self) -> float:
        return self.compute_burst_ms if self.compute_burst_ms > 0 else COMPUTE_BURST_S * self.compute_ms_per_s

    def rate_of(self, tenant: str) -> tuple[float, float]:
        """(rate per second, bucket capacity) of ``tenant``."""
        rate, burst = self.overrides.get(tenant, (self.rate_per_s, self.burst))
        return rate, (burst if burst > 0 else max(1.0, rate))


ShedReason = Literal["rate", "queued", "ref_bytes", "compute"]
SHED_REASONS = frozenset(get_args(ShedReason))
"""Every limit a request can be shed by: the values of the router's shed metric's label."""


@dataclass(frozen=True, slots=True)
class Shed:
    """A request the tenant's quota refuses: answer ``overloaded`` with ``retry_after_ms``, or,
    where that is None, ``payload_too_large`` (it would never fit the quota)."""

    reason: ShedReason
    """Which limit refused it (a metric label)."""
    message: str
    retry_after_ms: int | None


@dataclass
class _Tenant:
    tokens: float
    updated_ms: float
    seen_ms: float
    refused_ms: float = -math.inf
    """When admission last refused this tenant (``overloaded``)."""
    slots: dict[int, float] = field(default_factory=dict)
    """Slot index (of the predicted end) -> ms of work counted until that slot ends."""
    sent_ms: float = 0.0
    """Sum of the slots."""
    ref_tokens: float = 0.0
    """Bytes left in the ref bucket (negative: in debt after a request bigger than it)."""
    compute_tokens: float = 0.0
    """Engine ms left in the compute bucket (negative: in debt, as the ref bucket)."""


class TenantQuotas:
    """The quota state of one router: ``check`` before admitting a request, ``note_sent``
    once its jobs are sent. Not thread-safe (the router's loop is its only caller)."""

    def __init__(self, limits: QuotaLimits) -> None:
        self.limits = limits
        self.slot_ms = limits.window_ms / SLOTS
        self._tenants: OrderedDict[str, _Tenant] = OrderedDict()
        """Least recently seen first."""
        self._refused: dict[str | None, OrderedDict[str, float]] = {}
        """Per stage whose queue it was refused for (None: not said), the last two tenants
        admission refused, and when (most recent last)."""

    @property
    def enabled(self) -> bool:
        q = self.limits
        return (q.rate_per_s > 0 or bool(q.overrides) or q.fair_share > 0 or q.max_queued_ms > 0
                or q.ref_bytes_per_s > 0 or q.compute_ms_per_s > 0)

    def check(self, tenant: str, *, lane_limit_ms: float, now_ms: float, ref_bytes: int = 0,
              cost_ms: float = 0.0, stages: Collection[str] | None = None) -> Shed | None:
        """Whether ``tenant`` may send one more request now (None) or is shed. Takes a token
        (and ``ref_bytes`` from its byte bucket) when it may; ``lane_limit_ms`` is the admission
        limit of the request's lane, ``ref_bytes`` what the request's refs name, ``cost_ms``
        the engine work it was priced at (taken from the compute bucket by ``note_sent``),
        ``stages`` the stages it needs (None: any may be contended)."""
        self._expire(now_ms)
        t = self._touch(tenant, now_ms)
        sent = self._window(t, now_ms)
        q = self.limits
        limit = q.max_queued_ms if q.max_queued_ms > 0 else math.inf
        if q.fair_share > 0 and lane_limit_ms > 0 and self._contended(tenant, now_ms, stages):
            limit = min(limit, q.fair_share * lane_limit_ms)
        if sent >= limit:
            return Shed("queued", f"tenant {tenant} has {sent:.0f} ms of work in the pipeline (its limit now: "
                        f"{limit:.0f} ms); retry later", self._drain_ms(t, limit, now_ms))
        self._refill(t, tenant, now_ms)
        if q.ref_bytes_per_s > 0 and ref_bytes > 0 and t.ref_tokens < min(float(ref_bytes), q.ref_capacity):
            wait = math.ceil((min(float(ref_bytes), q.ref_capacity) - t.ref_tokens) * 1000.0 / q.ref_bytes_per_s)
            return Shed("ref_bytes", f"tenant {tenant} is over its rate of {q.ref_bytes_per_s:.0f} bytes per "
                        "second read through refs; retry later", max(1, wait))
        if q.compute_ms_per_s > 0 and not q.compute_debt and cost_ms > q.compute_capacity:
            return Shed("compute", f"this request is priced at {cost_ms:.0f} engine ms; tenant {tenant}'s compute "
                        f"quota allows at most {q.compute_capacity:.0f} at once: split it", None)
        if q.compute_ms_per_s > 0 and cost_ms > 0 and t.compute_tokens < min(cost_ms, q.compute_capacity):
            wait = math.ceil((min(cost_ms, q.compute_capacity) - t.compute_tokens) * 1000.0 / q.compute_ms_per_s)
            return Shed("compute", f"tenant {tenant} is over its compute rate of {q.compute_ms_per_s:.0f} engine "
                        f"ms per second (this request: {cost_ms:.0f} ms); retry later", max(1, wait))
        shed = self._take_token(t, tenant)
        if shed is None and q.ref_bytes_per_s > 0:
            t.ref_tokens -= ref_bytes
        return shed

    def precheck(self, tenant: str, *, now_ms: float, has_refs: bool, costs_work: bool) -> Shed | None:
        """The shed ``check`` would answer whatever the request's price, known before it is
        priced (its refs sized in Redis, its parts' headers read): no rate token left, counted
        work at ``max_queued_ms``, a compute bucket at or under zero for a request that
        ``costs_work`` (one the reuse cache cannot answer whole), a ref bucket at or under zero
        for one ``has_refs``. A flood of requests past a tenant's quota then costs the router
        their parsing and their refusals, not their pricing. Takes nothing; None: price the
        request and ask ``check``. (A request whose every part turns out refused, priced at
        nothing, is shed here too rather than answered part by part: its tenant is past its
        quota either way.)"""
        t = self._tenants.get(tenant)
        if t is None:  # full buckets
            return None
        q = self.limits
        if q.max_queued_ms > 0 and self._window(t, now_ms) >= q.max_queued_ms:
            return Shed("queued", f"tenant {tenant} has {t.sent_ms:.0f} ms of work in the pipeline (its limit now: "
                        f"{q.max_queued_ms:.0f} ms); retry later", self._drain_ms(t, q.max_queued_ms, now_ms))
        self._refill(t, tenant, now_ms)
        if has_refs and q.ref_bytes_per_s > 0 and t.ref_tokens <= 0:
            return Shed("ref_bytes", f"tenant {tenant} is over its rate of {q.ref_bytes_per_s:.0f} bytes per "
                        "second read through refs; retry later",
                        1 + math.ceil(-t.ref_tokens * 1000.0 / q.ref_bytes_per_s))
        if costs_work and q.compute_ms_per_s > 0 and t.compute_tokens <= 0:
            return Shed("compute", f"tenant {tenant} is over its compute rate of {q.compute_ms_per_s:.0f} engine "
                        f"ms per second ({-t.compute_tokens:.0f} ms owed); retry later",
                        1 + math.ceil(-t.compute_tokens * 1000.0 / q.compute_ms_per_s))
        rate = q.rate_of(tenant)[0]
        return self._take_token(t, tenant) if rate > 0 and t.tokens < 1.0 else None

    def refund(self, tenant: str, cost_ms: float, now_ms: float) -> None:
        """Give back ``cost_ms`` the tenant was charged for work that was not done (a
        generation that ended before its ``max_tokens``): into its compute bucket, up to full.
        A tenant not held here (forgotten, or charged by another router replica) gets nothing."""
        t = self._tenants.get(tenant)
        if t is None or cost_ms <= 0 or self.limits.compute_ms_per_s <= 0:
            return
        self._refill(t, tenant, now_ms)
        t.compute_tokens = min(self.limits.compute_capacity, t.compute_tokens + cost_ms)

    @property
    def charges_compute(self) -> bool:
        """Whether requests are charged to a compute bucket (so unused work is worth giving back)."""
        return self.limits.compute_ms_per_s > 0

    def over_bucket(self, cost_ms: float) -> bool:
        """Whether a request priced at ``cost_ms`` is admitted in debt: over the whole compute
        bucket, so it cannot be paid for at once."""
        q = self.limits
        return q.compute_ms_per_s > 0 and q.compute_debt and cost_ms > q.compute_capacity

    def check_rate(self, tenant: str, *, now_ms: float) -> Shed | None:
        """``check`` for a request that causes no work (answered whole from the reuse cache): it
        takes a rate token, and neither queued work, ref bytes nor compute stands in its way."""
        self._expire(now_ms)
        t = self._touch(tenant, now_ms)
        self._refill(t, tenant, now_ms)
        return self._take_token(t, tenant)

    def note_refused(self, tenant: str, now_ms: float, stage: str | None = None) -> None:
        """Admission refused ``tenant`` (``overloaded``) now, for the queue of ``stage`` (None:
        not said): it is being kept out, so the tenants over their fair share whose requests
        need that stage are held back for a window."""
        if not self.enabled:
            return
        self._touch(tenant, now_ms).refused_ms = now_ms
        recent = self._refused.setdefault(stage, OrderedDict())
        recent[tenant] = now_ms
        recent.move_to_end(tenant)
        while len(recent) > 2:  # the two most recent are all `_contended` needs
            recent.popitem(last=False)

    def note_sent(self, tenant: str, cost_ms: float, now_ms: float, wait_ms: float = 0.0) -> None:
        """Count ``cost_ms`` of work the router sent for ``tenant`` now, predicted to wait
        ``wait_ms`` in its queue first: it counts until ``now + wait + cost`` (at most
        ``window_ms``), and is taken from the tenant's compute bucket. Nothing is kept while
        no quota is set."""
        if cost_ms <= 0 or not self.enabled:
            return
        t = self._touch(tenant, now_ms)
        if self.limits.compute_ms_per_s > 0:
            t.compute_tokens -= cost_ms
        self._window(t, now_ms)
        until = now_ms + min(self.limits.window_ms, max(0.0, wait_ms) + cost_ms)
        index = math.floor(until / self.slot_ms)
        t.slots[index] = t.slots.get(index, 0.0) + cost_ms
        t.sent_ms += cost_ms

    def sent_ms(self, tenant: str, now_ms: float) -> float:
        """Work counted for ``tenant`` now (sent and predicted not done yet)."""
        t = self._tenants.get(tenant)
        return self._window(t, now_ms) if t is not None else 0.0

    def __len__(self) -> int:
        return len(self._tenants)

    # -- internals ---------------------------------------------------------------------

    def _touch(self, tenant: str, now_ms: float) -> _Tenant:
        t = self._tenants.get(tenant)
        if t is None:
            t = self._tenants[tenant] = _Tenant(self.limits.rate_of(tenant)[1], now_ms, now_ms,
                                                ref_tokens=self.limits.ref_capacity,
                                                compute_tokens=self.limits.compute_capacity)
            while len(self._tenants) > self.limits.max_tenants:
                self._tenants.popitem(last=False)
        else:
            t.seen_ms = max(t.seen_ms, now_ms)
            self._tenants.move_to_end(tenant)
        return t

    def _take_token(self, t: _Tenant, tenant: str) -> Shed | None:
        """One request's token from the rate bucket (refilled), or the shed when there is none."""
        rate = self.limits.rate_of(tenant)[0]
        if rate <= 0:
            return None
        if t.tokens < 1.0:
            wait = math.ceil((1.0 - t.tokens) * 1000.0 / rate)
            return Shed("rate", f"tenant {tenant} is over its rate of {rate:g} requests per second; retry later",
                        max(1, wait))
        t.tokens -= 1.0
        return None

    def _refill(self, t: _Tenant, tenant: str, now_ms: float) -> None:
        """Refill every bucket of ``tenant`` for the time since it was last refilled."""
        q = self.limits
        elapsed_s = max(0.0, now_ms - t.updated_ms) / 1000.0
        t.updated_ms = max(t.updated_ms, now_ms)
        rate, capacity = q.rate_of(tenant)
        if rate > 0:
            t.tokens = min(capacity, t.tokens + elapsed_s * rate)
        if q.ref_bytes_per_s > 0:
            t.ref_tokens = min(q.ref_capacity, t.ref_tokens + elapsed_s * q.ref_bytes_per_s)
        if q.compute_ms_per_s > 0:
            t.compute_tokens = min(q.compute_capacity, t.compute_tokens + elapsed_s * q.compute_ms_per_s)

    def _window(self, t: _Tenant, now_ms: float) -> float:
        """The tenant's counted work now, after dropping the slots that have ended."""
        current = math.floor(now_ms / self.slot_ms)
        for index in [i for i in t.slots if i < current]:
            t.sent_ms -= t.slots.pop(index)
        if not t.slots:
            t.sent_ms = 0.0  # no float residue
        return t.sent_ms

    def _contended(self, tenant: str, now_ms: float, stages: Collection[str] | None = None) -> bool:
        """Whether admission refused a tenant other than ``tenant`` within the window, for one
        of ``stages`` (None: for any)."""
        for stage, recent in self._refused.items():
            if stages is not None and stage is not None and stage not in stages:
                continue
            for name, at in islice(reversed(recent.items()), 2):
                if name != tenant and now_ms - at < self.limits.window_ms:
                    return True
        return False

    def _drain_ms(self, t: _Tenant, limit: float, now_ms: float) -> int:
        """Milliseconds until the counted work falls under ``limit`` (slots end)."""
        left = t.sent_ms
        for index in sorted(t.slots):
            left -= t.slots[index]
            if left < limit:
                return max(1, math.ceil((index + 1) * self.slot_ms - now_ms))
        return max(1, math.ceil(self.limits.window_ms))

    def _expire(self, now_ms: float) -> None:
        """Drop the least recently seen tenants that hold nothing a new one would not."""
        while self._tenants:
            name, t = next(iter(self._tenants.items()))
            rate, capacity = self.limits.rate_of(name)
            q = self.limits
            refill_ms = capacity * 1000.0 / rate if rate > 0 else 0.0
            # A tenant with a bucket short of full (in debt, even) stays until it would be full again.
            if q.ref_bytes_per_s > 0 and t.ref_tokens < q.ref_capacity:
                refill_ms = max(refill_ms, (q.ref_capacity - t.ref_tokens) * 1000.0 / q.ref_bytes_per_s)
            if q.compute_ms_per_s > 0 and t.compute_tokens < q.compute_capacity:
                refill_ms = max(refill_ms, (q.compute_capacity - t.compute_tokens) * 1000.0 / q.compute_ms_per_s)
            if now_ms - max(t.seen_ms, t.refused_ms) < max(self.limits.window_ms, refill_ms):
                return
            del self._tenants[name]


class TenantLabels:
    """A bounded label for a per-tenant metric: the first ``n`` tenants named get their own
    value, every later one ``other`` (so a stream of tenant names cannot grow the series)."""

    OTHER = "other"

    def __init__(self, n: int) -> None:
        self.n = n
        self._named: set[str] = set()

    def __call__(self, tenant: str) -> str:
        if tenant in self._named:
            return tenant
        if len(self._named) < self.n and tenant != self.OTHER:
            self._named.add(tenant)
            return tenant
        return self.OTHER
