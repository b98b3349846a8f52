"""Taking over partitions of a stage that answers clients, without answering anything twice.

Such a stage (the assembler, the generator) writes a *done marker* — a small record keyed by
the request (``<tenant>/<id>``) on its own compacted topic, partitioned like its input — with
every answer, and finishes a request's input records only when both are with the broker. A
replica that takes over a partition calls ``recover`` before reading it:

1. the done markers of the partition (younger than ``retention_ms``): requests answered, so
   a replayed or late duplicate record of theirs is dropped;
2. the input records between the committed offset and the end (the ones the replay will
   bring back) whose requests are not marked done;
3. for those, the events already on their reply topics (an answer sent just before the last
   owner died, with its marker not yet written; tokens of a generation cut off midway).

The stage then replays, sending only events not found in step 3. ``AnswerLedger`` is what
such a stage (the generator, the retrieve stage) keeps of it between take-overs: the requests
it answered and the events a previous owner sent, with the done marker added to every last
answer; ``stage_timings`` is the timing breakdown of such an answer.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import msgpack
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import ConsumerRecord

from streams.runtime.produce import Out
from streams.runtime.replies import CLOCK_SKEW_MS, BrokerReader

log = logging.getLogger(__name__)

# record -> (request key, reply topic, the request's key on its reply topic: its id) when
# the record opens a request, else None
Opens = Callable[[ConsumerRecord], tuple[str, str, str] | None]


def done_marker(topic: str, key: str, reply_to: str, at_ms: float, digest: str | None = None) -> Out:
    """The done marker of request ``key``; ``digest`` names the ingress record answered."""
    value: dict[str, Any] = {"r": reply_to, "t": at_ms}
    if digest is not None:
        value["d"] = digest
    return Out(topic, key.encode(), msgpack.packb(value))


def stage_timings(job: Any, stage: str, started_ms: float, now_ms: float) -> dict[str, Any]:
    """The ``timings`` of an answer to ``job`` (a ``GenerateJob`` or ``RetrieveJob``: its trace
    so far, when it was sent to this stage, when the client sent it and when it was accepted)
    from a stage that started on it at ``started_ms``."""
    stages = [*job.trace, {"stage": stage, "queued_ms": round(max(0.0, started_ms - job.sent_at_ms), 3),
                           "service_ms": round(now_ms - started_ms, 3)}]
    return {"e2e_ms": round(now_ms - job.client_sent_at_ms, 3), "accepted_at_ms": job.accepted_at_ms,
            "stages": stages}


class AnswerLedger:
    """What a stage that answers clients remembers: the requests it answered (for
    ``retention_ms``, oldest forgotten first: a replayed or late duplicate record of theirs
    is dropped) and, for requests being replayed, the events a previous owner already sent."""

    def __init__(self, done_topic: str, retention_ms: float) -> None:
        self.done_topic, self.retention_ms = done_topic, retention_ms
        self.done: dict[str, float] = {}
        """Request key -> when it was answered (epoch ms), in that order."""
        self.sent: dict[str, set[tuple[str, int]]] = {}
        """Request key -> (kind, seq) of its events already on its reply topic."""

    def answered(self, key: str) -> bool:
        return key in self.done

    def already_sent(self, key: str, kind: str, seq: int) -> bool:
        """Whether a previous owner sent this event (``kind`` "terminal" for a result or error)."""
        return (kind, seq) in self.sent.get(key, ())

    def finish(self, key: str, reply_to: str, outs: list[Out], terminal_seq: int, now_ms: float) -> list[Out]:
        """The records of request ``key``'s last answer: ``outs`` less those to ``reply_to``
        when a previous owner already sent its terminal event, plus its done marker. From now
        the request counts as answered."""
        if ("terminal", terminal_seq) in self.sent.pop(key, set()):
            outs = [o for o in outs if o.topic != reply_to]  # sent before a take-over
        outs = [*outs, done_marker(self.done_topic, key, reply_to, now_ms)]
        self.done[key] = now_ms
        self.prune(now_ms)
        return outs

    def prune(self, now_ms: float) -> None:
        """Forget requests answered over ``retention_ms`` ago."""
        cutoff = now_ms - self.retention_ms
        while self.done:
            key, at = next(iter(self.done.items()))
            if at >= cutoff:
                break
            del self.done[key]

    def take_over(self, found: "Recovered") -> None:
        """What ``recover`` found for partitions this replica now owns."""
        for done in found.done.values():
            self.done.update(done)
        self.sent.update(found.sent)


@dataclass
class Recovered:
    done: dict[TopicPartition, dict[str, float]] = field(default_factory=dict)
    """Input partition -> request key -> when it was answered (epoch ms)."""
    digests: dict[str, str] = field(default_factory=dict)
    """Request key -> digest of the ingress record answered (markers that name one)."""
    sent: dict[str, set[tuple[str, int]]] = field(default_factory=dict)
    """Request key -> (kind, seq) of its events already on its reply topic ("terminal" for
    a result or error)."""
    ends: dict[TopicPartition, int] = field(default_factory=dict)
    """Input partition -> its end offset when read: the records below it are the replay."""
    unseen: set[TopicPartition] = field(default_factory=set)
    """Input partitions with records younger than the retention that a previous owner handled
    (below the committed offset): what it did with them is known only from its markers."""
    replayed: set[str] = field(default_factory=set)
    """Request keys of the records the replay brings back that were never answered: work a
    previous owner took on (a stage does not turn it away again)."""


async def recover(consumer: AIOKafkaConsumer, bootstrap: str, client_kwargs: dict[str, Any], max_bytes: int,
                  done_topic: str, tps: set[TopicPartition], opens: Opens, now_ms: float,
                  retention_ms: float, marker_partitions: int | None = None, find_unseen: bool = False) -> Recovered:
    """What a replica taking ``tps`` over must know (module doc). ``marker_partitions``: the
    done topic's partition count where it may have fewer partitions than an input topic (the
    router's: a tenant's ingress topic made after ``kafka.partitions`` grew); input partition
    ``p``'s markers are then on ``p % marker_partitions``. ``find_unseen``: also find the
    partitions with records younger than ``retention_ms`` below the committed offset
    (``Recovered.unseen``)."""
    out = Recovered()

    def index(p: int) -> int:
        return p % marker_partitions if marker_partitions else p

    clock = time.monotonic
    began = clock()
    async with BrokerReader(bootstrap, client_kwargs, max_bytes) as reader:
        connected = clock()
        # One round trip each for the beginning and end offsets of every partition read here
        # (markers and inputs together) and one for the committed offsets, not one per
        # partition: a take-over with nothing to replay cost ~0.4 s of such round trips.
        marker_tps = [TopicPartition(done_topic, p) for p in sorted({index(tp.partition) for tp in tps})]
        beginnings = await reader.consumer.beginning_offsets([*marker_tps, *tps])
        ends = await reader.consumer.end_offsets([*marker_tps, *tps])
        committed_at = await consumer._coordinator.fetch_committed_offsets(list(tps))  # noqa: SLF001 - one request
        # Markers older than the retention are passed over below, and the topic keeps them
        # far longer (DONE_RETENTION_MS): read each marker partition from its first record
        # younger than the retention (one request), not from its beginning. A marker's record
        # is stamped when it is sent, after the time it carries; CLOCK_SKEW_MS covers a
        # previous owner's clock.
        young = await reader.consumer.offsets_for_times(
            {mtp: max(0, int(now_ms - retention_ms - CLOCK_SKEW_MS)) for mtp in marker_tps})
        starts = {mtp: young[mtp].offset if young.get(mtp) is not None else ends[mtp] for mtp in marker_tps}
        markers = {mtp.partition: records for mtp, records in
                   (await reader.read_ranges({mtp: (max(beginnings[mtp], starts[mtp]), ends[mtp])
                                              for mtp in marker_tps})).items()}
        for tp in tps:
            done = out.done.setdefault(tp, {})
            for rec in markers.get(index(tp.partition), []):
                marker = _marker(rec.value)
                if rec.key and marker is not None and now_ms - marker[0] < retention_ms:
                    done[rec.key.decode()] = marker[0]
                    if marker[1] is not None:
                        out.digests[rec.key.decode()] = marker[1]
        read_markers = clock()
        wanted: list[tuple[str, bytes, float]] = []
        owners: dict[tuple[str, bytes], set[str]] = {}
        replay: dict[TopicPartition, tuple[int, int]] = {}
        for tp in tps:
            out.ends[tp] = ends[tp]
            at = committed_at.get(tp)
            committed = at.offset if at is not None and at.offset >= 0 else None
            if committed is None:  # nothing committed yet: the replay starts at the beginning
                committed = beginnings[tp]
            replay[tp] = (committed, ends[tp])
        inputs = await reader.read_ranges(replay)
        for tp in tps:
            for rec in inputs[tp]:
                opened = _safe(opens, rec)
                if opened is not None and opened[0] not in out.done[tp]:
                    key, reply_to, reply_key = opened
                    out.replayed.add(key)
                    wanted.append((reply_to, reply_key.encode(), float(rec.timestamp)))
                    owners.setdefault((reply_to, reply_key.encode()), set()).add(key)
        if find_unseen:  # one request: the first offset of each partition younger than the retention
            since = await reader.consumer.offsets_for_times({tp: max(0, int(now_ms - retention_ms)) for tp in tps})
            for tp in tps:
                at = committed_at.get(tp)
                first = since.get(tp)
                if at is not None and at.offset >= 0 and first is not None and first.offset < at.offset:
                    out.unseen.add(tp)
        read_inputs = clock()
        for (topic, reply_key), marks in (await reader.events_on_replies(wanted)).items():
            for key in owners.get((topic, reply_key), ()):
                out.sent.setdefault(key, set()).update(marks)
        read_replies = clock()
    # Where a take-over's time goes (docs/reliability.md, "Failover: where the seconds go").
    log.info("%s: %d requests to replay, %d with events already sent; took %.0f ms (connect %.0f, markers %.0f, "
             "inputs %.0f, replies %.0f)", done_topic, len(wanted), len(out.sent), (clock() - began) * 1000,
             (connected - began) * 1000, (read_markers - connected) * 1000, (read_inputs - read_markers) * 1000,
             (read_replies - read_inputs) * 1000)
    return out


def _safe(opens: Opens, rec: ConsumerRecord) -> tuple[str, str, str] | None:
    try:
        return opens(rec)
    except Exception:  # an undecodable record opens nothing; the stage dead-letters it on replay
        return None


def _marker(raw: bytes | None) -> tuple[float, str | None] | None:
    """(when, digest or None) of a done marker's value; None when it is unreadable."""
    try:
        m = msgpack.unpackb(raw) if raw else None
        digest = m.get("d")
        return float(m["t"]), digest if isinstance(digest, str) else None
    except Exception:
        return None
