"""What the router knows of the load downstream, from the encoders' own reports. Pure.

Every encoder replica reports a few times a second (``streams.stores.load_reports.publish_load``) what it
holds: the engine work queued in it (milliseconds, predicted by its batch cost model, plus
the records not yet fetched), per partition, and what one more item costs it by length. It
knows this exactly; the router could only guess it from consumer lag. On top of a report the
router adds what it sent itself after that report was made (less ``fetch_lag_ms``: what the
encoder has surely fetched by then is in its report), so a burst cannot all be admitted on
one stale number. A report itself counts as worked down since it was made (``drained_ms``):
read whole, a batch that finished meanwhile would still be ahead of every new request.

``wait_ms(stage, lane)`` is what a new part would wait: the least-loaded replica's queue (the
partitioner sends the part there) — for ``rt``, only the rt work queued there and the batch
running (an encoder serves rt before bulk); for ``bulk``, all of it. An encoder that serves
its rt queue in tenant-fair order (``streams.policies.fair_order``) also reports each
tenant's share of it; then ``wait_ms(stage, "rt", tenant, own)`` is what that tenant's new
part waits (``fair_wait_ms``): its own tenant's queue, and from every other tenant at most
as much again plus the part, not the other tenants' whole backlog. ``item_ms(stage, length)`` is what the part itself
costs. Reports older than ``stale_ms`` are ignored (a replica gone, Redis away): with none
left, a stage counts as idle and the encoders' own deadline checks remain.

What the reports cannot know (the hop to the encoder, its intake, cores shared with other
stages) each encoder learns from its own rt jobs: how far the wait predicted for them (carried
in the job) ran from the wait they had until the engine started them. ``calibrated(stage,
wait)`` applies what it reports (``wait_scale``), so admission holds the wait requests see to
its bound, not only the wait the cost model predicts.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from streams.policies.calibration import scaled


@dataclass
class Report:
    stage: str
    replica: str
    at_ms: float
    queued_ms: float
    """All the work this replica holds (ms)."""
    queued_rt_ms: float
    """What an rt item waits behind here: the batch running plus the rt work queued (ms)."""
    partitions: dict[str, dict[int, float]]
    """Topic -> partition -> ms queued from it."""
    item_ms: list[tuple[float, float]]
    """(length, ms one item of that length costs), sorted by length."""
    tenants_rt: dict[str, float] | None = None
    """Tenant -> ms of rt work queued for it (the largest ``MAX_REPORTED_TENANTS``); None: the
    replica serves in arrival order."""
    rest_rt: tuple[float, int] = (0.0, 0)
    """(ms, tenants) of the rt work of the tenants not named in ``tenants_rt``."""
    assigned: frozenset[tuple[str, int]] | None = None
    """The (topic, partition)s the replica reads; None: not reported (then those it holds work from)."""
    wait_scale: float = 1.0
    """How far the waits the router predicted for this replica's rt jobs ran from the waits
    they had (``streams.policies.calibration``, floor ``WAIT_FLOOR_MS``): 1 until it learned."""

    @classmethod
    def from_map(cls, key: str, m: Mapping[str, Any]) -> "Report":
        parts: dict[str, dict[int, float]] = {}
        for tp, ms in (m.get("partitions") or {}).items():
            topic, _, p = str(tp).rpartition(":")
            parts.setdefault(topic, {})[int(p)] = float(ms)
        tenants = m.get("tenants_rt")
        assigned = m.get("assigned")
        rest = m.get("rest_rt") or (0.0, 0)
        return cls(stage=str(m["stage"]), replica=key, at_ms=float(m["at"]), queued_ms=float(m["queued_ms"]),
                   queued_rt_ms=float(m.get("queued_rt_ms", m["queued_ms"])), partitions=parts,
                   item_ms=sorted((float(k), float(v)) for k, v in (m.get("item_ms") or {}).items()),
                   tenants_rt=None if tenants is None else {str(k): float(v) for k, v in dict(tenants).items()},
                   rest_rt=(float(rest[0]), int(rest[1])),
                   assigned=None if assigned is None else frozenset(_topic_partition(x) for x in assigned),
                   wait_scale=_scale(m.get("wait_scale", 1.0)))

    def cost(self, length: float) -> float | None:
        if not self.item_ms:
            return None
        lengths = [k for k, _ in self.item_ms]
        i = min(bisect.bisect_left(lengths, length), len(lengths) - 1)
        return self.item_ms[i][1] * max(1.0, length / lengths[i]) if length > lengths[-1] else self.item_ms[i][1]


@dataclass(frozen=True, slots=True)
class Sent:
    at_ms: float
    topic: str
    partition: int
    ms: float
    tenant: str = ""
    stage: str = ""
    """``stage_of(topic)``, worked out once when it is sent (read for every later request)."""


@dataclass
class LoadView:
    stale_ms: float = 3_000.0
    fetch_lag_ms: float = 100.0
    """Records sent this long before a report are assumed to be in it (fetched by then)."""
    reports: dict[str, Report] = field(default_factory=dict)
    sent: list[Sent] = field(default_factory=list)
    """What the router sent and no report can have counted yet, oldest first."""

    def update_reports(self, raw: Mapping[str, Mapping[str, Any]], now_ms: float) -> None:
        fresh = {}
        for key, m in raw.items():
            try:
                report = Report.from_map(key, m)
            except (KeyError, TypeError, ValueError):
                continue
            if now_ms - report.at_ms <= self.stale_ms:
                fresh[key] = report
        self.reports = fresh
        oldest = min((r.at_ms for r in fresh.values()), default=now_ms - self.stale_ms)
        self.sent = [x for x in self.sent if x.at_ms > oldest - self.fetch_lag_ms]

    def note_sent(self, topic: str, partition: int | None, ms: float, now_ms: float, tenant: str = "") -> None:
        self.sent.append(Sent(now_ms, topic, -1 if partition is None else partition, ms, tenant, stage_of(topic)))

    @property
    def sent_ms(self) -> dict[str, dict[int, float]]:
        """Topic -> partition -> ms sent that no report holds yet."""
        out: dict[str, dict[int, float]] = {}
        for x in self.sent:
            by = out.setdefault(x.topic, {})
            by[x.partition] = by.get(x.partition, 0.0) + x.ms
        return out

    def _sent_since(self, report: Report | None, counted: list[Sent]) -> list[Sent]:
        """Of ``counted`` (sends to the report's stage and lane), those no report can hold yet."""
        since = -float("inf") if report is None else report.at_ms - self.fetch_lag_ms
        # What it reads: sends to a partition it holds no work from yet are its too.
        mine = None if report is None else report.assigned if report.assigned is not None else \
            {(t, p) for t, by in report.partitions.items() for p in by}
        return [x for x in counted if x.at_ms > since
                and (mine is None or (x.topic, x.partition) in mine or x.partition < 0)]

    def _replicas(self, stage: str) -> list[Report]:
        return [r for r in self.reports.values() if r.stage == stage]

    def wait_ms(self, stage: str, lane: str = "bulk", tenant: str | None = None, own_ms: float = 0.0,
                now_ms: float | None = None) -> float:
        """What a new part of ``lane`` waits at ``stage``; with ``tenant`` (rt), by fair order
        where the replica reports its tenants (``own_ms``: what the part itself costs). With
        ``now_ms``, each report counts as worked down since it was made (``drained_ms``)."""
        counted = [x for x in self.sent if x.stage == stage and (lane != "rt" or x.topic.endswith(".rt"))]
        replicas = self._replicas(stage)
        if not replicas:
            return sum(x.ms for x in counted)
        return min(self._replica_wait(r, self._sent_since(r, counted), lane, tenant, own_ms,
                                      0.0 if now_ms is None else drained_ms(r, now_ms)) for r in replicas)

    @staticmethod
    def _replica_wait(r: Report, sent: list[Sent], lane: str, tenant: str | None, own_ms: float,
                      drained: float = 0.0) -> float:
        if lane != "rt" or tenant is None or r.tenants_rt is None:
            reported = r.queued_rt_ms if lane == "rt" else r.queued_ms
            return max(0.0, reported - drained) + sum(x.ms for x in sent)
        tenants = dict(r.tenants_rt)
        for x in sent:
            tenants[x.tenant] = tenants.get(x.tenant, 0.0) + x.ms
        # The drain comes off the batch running and the work not yet sorted (what the engine
        # works on first); the tenants' queues are left whole (the wait stays an upper bound).
        base = max(0.0, r.queued_rt_ms - sum(r.tenants_rt.values()) - r.rest_rt[0] - drained)
        return fair_wait_ms(base, tenants, r.rest_rt, tenant, own_ms)

    def calibrated(self, stage: str, wait_ms: float) -> float:
        """``wait_ms`` predicted at ``stage`` corrected by how far such predictions ran there:
        the largest ``wait_scale`` its fresh replicas report (one replica running late is
        where the least-loaded choice may send the part)."""
        factor = max((r.wait_scale for r in self._replicas(stage)), default=1.0)
        return scaled(wait_ms, factor, WAIT_FLOOR_MS) if factor != 1.0 else wait_ms

    def item_ms(self, stage: str, length: float) -> float | None:
        """What one item of ``length`` costs at ``stage``, from its freshest report; None
        before any report (the caller falls back to the modality's default cost)."""
        for r in sorted(self._replicas(stage), key=lambda r: -r.at_ms):
            cost = r.cost(length)
            if cost is not None:
                return cost
        return None

    def queued_ms(self, lane: str = "bulk", tenant: str | None = None,
                  own_ms: Mapping[str, float] | None = None, only: Iterable[str] | None = None,
                  now_ms: float | None = None) -> dict[str, float]:
        """Stage -> what a new ``lane`` part (of ``tenant``, costing ``own_ms[stage]``) would
        wait there (ms): at every stage known, or at the stages ``only`` names (what a
        request needs: the router asks per request, so this is on every request's path).
        ``now_ms``: see ``wait_ms``."""
        stages = set(only) if only is not None else \
            {r.stage for r in self.reports.values()} | {x.stage for x in self.sent}
        own = own_ms or {}
        return {s: self.wait_ms(s, lane, tenant, own.get(s, 0.0), now_ms) for s in stages}

    @property
    def total_ms(self) -> float:
        return sum(r.queued_ms for r in self.reports.values()) + sum(x.ms for x in self.sent)

    @property
    def partition_ms(self) -> dict[str, dict[int, float]]:
        """Topic -> partition -> ms waiting there (for the least-loaded partitioner)."""
        out: dict[str, dict[int, float]] = {}
        for r in self.reports.values():
            for topic, by in r.partitions.items():
                for p, ms in by.items():
                    out.setdefault(topic, {})[p] = out.get(topic, {}).get(p, 0.0) + ms
        for topic, by in self.sent_ms.items():
            for p, ms in by.items():
                if p >= 0:
                    out.setdefault(topic, {})[p] = out.get(topic, {}).get(p, 0.0) + ms
        return out


def drained_ms(r: Report, now_ms: float) -> float:
    """The report's predicted work its replica has worked off since it was made: its engine
    works one predicted ms per real ms (how far predictions run late, ``wait_scale``, is
    applied to what is left: ``calibrated``). A report is up to two refreshes old when it is
    read (the encoder's and the router's, 250 ms each); read whole, the batch that was running
    then still counts after it is done, and a request sent right after its own answer is
    refused behind a phantom."""
    return max(0.0, now_ms - r.at_ms)


WAIT_FLOOR_MS = 50.0
"""Waits are compared as (actual + this) / (predicted + this): a few milliseconds off on a
nearly empty queue teach nothing."""
MIN_WAIT_SCALE, MAX_WAIT_SCALE = 0.5, 4.0
"""The range a reported ``wait_scale`` is held to (a report is the encoders' word, not law)."""


def _scale(raw: Any) -> float:
    scale = float(raw)
    if not math.isfinite(scale):
        raise ValueError(f"wait_scale {raw!r} is not a number")
    return min(MAX_WAIT_SCALE, max(MIN_WAIT_SCALE, scale))


def _topic_partition(s: Any) -> tuple[str, int]:
    topic, _, p = str(s).rpartition(":")
    return topic, int(p)


MAX_REPORTED_TENANTS = 32


def tenant_shares(queued: Mapping[str, float]) -> dict[str, Any]:
    """A report's ``tenants_rt`` (the ``MAX_REPORTED_TENANTS`` largest) and ``rest_rt``."""
    ranked = sorted(queued.items(), key=lambda kv: -kv[1])
    named, rest = ranked[:MAX_REPORTED_TENANTS], ranked[MAX_REPORTED_TENANTS:]
    return {"tenants_rt": {t: round(ms, 3) for t, ms in named},
            "rest_rt": [round(sum(ms for _, ms in rest), 3), len(rest)]}


def fair_wait_ms(base_ms: float, tenants: Mapping[str, float], rest: tuple[float, int], tenant: str,
                 own_ms: float) -> float:
    """What a new item of ``tenant`` costing ``own_ms`` waits at an engine that serves
    tenants in fair order (``streams.policies.fair_order``), ``base_ms`` (the batch running,
    work not yet sorted) aside: its own tenant's queued work, and from each other tenant at
    most as much as that plus the item (each gets its turn meanwhile, no more). The tenants
    not named (``rest``: their ms and count) are counted the same way, each at most that."""
    mine = tenants.get(tenant, 0.0)
    cap = mine + own_ms
    others = sum(min(ms, cap) for t, ms in tenants.items() if t != tenant)
    others += min(rest[0], rest[1] * cap)
    return base_ms + mine + others


def stage_of(topic: str) -> str:
    """``<prefix>.encode.<modality>.<lane>`` -> ``encode.<modality>``."""
    parts = topic.split(".")
    return f"encode.{parts[-2]}" if len(parts) >= 3 and parts[-3] == "encode" else topic


def merge_item_costs(rows: Iterable[tuple[float, float]]) -> dict[str, float]:
    """A report's ``item_ms`` map from (length, ms) rows."""
    return {f"{length:g}": round(ms, 4) for length, ms in rows}
