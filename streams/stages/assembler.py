"""The assembler stage: a Faust agent that is thin glue around ``assembly.step``. It handles
errors per message and never crashes on input."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Any

import faust

from schemas.codec import DecodeError, unpack
from schemas.errors import ErrorCode, WireError
from schemas.events import Event, EventKind
from schemas.jobs import DeadlineTick, Manifest, fan_in_from_wire
from schemas.settings import Settings
from schemas.trace import now_ms
from streams import topic_reader
from streams.app import raw_topic, topic_names
from streams.assembly import Assembly, AssemblyPolicy, due_at, step
from streams.lanes import install_lane_priority
from streams.lifecycle import RequestStatus
from streams.metrics import Metrics, request_modality
from streams.produce import Out, dead_letter, out_map, record_source, send_all
from streams.result_cache import ResultCache
from streams.topics import LANES

log = logging.getLogger(__name__)

TICK_RESEND_MS = 1000.0
RETRY_DELAYS_S = (0.2, 1.0, 3.0)


def install_assembler(app: faust.App, settings: Settings, metrics: Metrics) -> None:
    names = topic_names(settings)
    max_record = settings.kafka.max_message_bytes
    a = settings.assembler
    results = ResultCache(settings.redis.url, settings.cache.ttl_result_s) \
        if settings.cache.enabled and settings.cache.whole_result else None
    policy = AssemblyPolicy(retention_ms=float(a.retention_ms), orphan_ttl_ms=float(a.orphan_ttl_ms))
    table = app.Table("assembly", key_type=bytes, value_type=bytes, partitions=settings.kafka.partitions)
    # id -> (epoch ms when a tick is due, lane). Rebuilt from the table after every
    # rebalance; kept current by the agent in between.
    due: dict[str, tuple[float, str]] = {}
    source = raw_topic(app, *(names.encoded(lane) for lane in LANES))
    install_lane_priority(app, settings.kafka.bootstrap, settings.kafka.topic_prefix, names.encoded("rt"),
                          names.encoded("bulk"), settings.admission.rt_backlog_records)

    @table.on_recover
    async def rebuild_index() -> None:
        due.clear()
        for key, raw in table.items():
            try:
                state = Assembly.from_bytes(raw)
            except Exception:
                log.exception("assembler: unreadable state for %r; dropping it from the sweep", key)
                continue
            due[key.decode()] = (due_at(state, policy), state.lane)
        log.info("assembler: %d requests tracked after recovery", len(due))

    async def handle(event: Any) -> None:
        lane = event.message.topic.rsplit(".", 1)[-1]
        try:
            msg = fan_in_from_wire(unpack(event.value))
        except (DecodeError, ValueError) as exc:
            log.warning("assembler: to DLQ: %s", exc)
            metrics.to_dlq("assemble")
            await send_all(app.producer, [dead_letter(names.dlq, event.key, event.value,
                                                      f"undecodable fan-in message: {exc}", event.headers,
                                                      record_source(event), max_bytes=max_record)])
            return
        key = msg.id.encode()
        raw = table.get(key)
        state = Assembly.from_bytes(raw) if raw else None
        if state is not None and state.pending is not None:
            state = await finish_delivery(key, state)
        now = now_ms()
        if state is None and isinstance(msg, Manifest) and len(due) >= a.max_pending:
            err = WireError(ErrorCode.OVERLOADED, "the assembler is tracking its maximum of requests")
            await send_all(app.producer, [out_map(msg.reply_to, msg.id,
                                                  Event(msg.id, EventKind.ERROR, 1, now, error=err.to_wire()).to_wire())])
            return
        result = step(state, msg, now, policy, lane=lane)
        answer = None
        if result.forward is not None:  # a generate request goes on; the generator answers it
            answer = out_map(names.generate(result.forward.lane), msg.id, result.forward.to_wire())
        elif result.emit is not None and result.reply_to:
            answer = out_map(result.reply_to, msg.id, result.emit.to_wire())
        if answer is not None and result.state is not None:
            await deliver(key, result.state, answer)
            if result.emit is not None:
                _observe_terminal(metrics, result.emit, result.state)
                m = result.state.manifest
                if results is not None and m is not None and m.result_key and result.state.status == RequestStatus.FINISHED:
                    await results.put(m.result_key, result.emit.payload or {})  # a complete answer only
            else:
                metrics.request_done("assemble", "ok")
        if not result.changed:
            return
        if result.state is None:
            if key in table:
                del table[key]
            due.pop(msg.id, None)
        else:
            table[key] = result.state.to_bytes()
            due[msg.id] = (due_at(result.state, policy), result.state.lane)

    async def deliver(key: bytes, state: Assembly, answer: Out) -> None:
        """Exactly one answer per request, through crashes: record the intent and flush it
        to the changelog, then send, then (in the caller) record the tombstone."""
        table[key] = replace(state, pending=(answer.topic, answer.value)).to_bytes()
        await app.producer.flush()  # the intent is durable before the answer exists
        await send_all(app.producer, [answer])

    async def finish_delivery(key: bytes, state: Assembly) -> Assembly:
        """A request found mid-delivery (the assembler died between sending and recording):
        send its answer only if the topic does not hold it already."""
        topic, value = state.pending
        since = (state.done_at_ms or state.first_seen_ms) - 5_000.0  # clock skew margin
        if await topic_reader.contains(settings.kafka.bootstrap, topic, key, value, since):
            log.info("assembler: %s was answered before a restart; not answering again", key.decode())
        else:
            log.info("assembler: %s was not answered before a restart; answering now", key.decode())
            await send_all(app.producer, [Out(topic, key, value, out_map(topic, key, {}).headers)])
        done = replace(state, pending=None)
        table[key] = done.to_bytes()
        return done

    async def give_up(event: Any, exc: Exception) -> None:
        """A message that keeps failing: park it in the DLQ and, if it is a manifest,
        answer its client with `internal` so the request does not hang unanswered."""
        metrics.to_dlq("assemble")
        outs = [dead_letter(names.dlq, event.key, event.value, f"{ErrorCode.INTERNAL}: assembler failed: {exc!r}",
                            event.headers, record_source(event), max_bytes=max_record)]
        try:
            msg = fan_in_from_wire(unpack(event.value))
            if isinstance(msg, Manifest):
                err = WireError(ErrorCode.INTERNAL, "the assembler could not track this request")
                outs.append(out_map(msg.reply_to, msg.id,
                                    Event(msg.id, EventKind.ERROR, 1, now_ms(), error=err.to_wire()).to_wire()))
        except (DecodeError, ValueError):
            pass
        await send_all(app.producer, outs)

    @app.agent(source, name="assemble")
    async def assemble(stream: Any) -> None:
        async for event in stream.events():
            where = record_source(event)
            for delay in (*RETRY_DELAYS_S, None):
                try:
                    await handle(event)
                    break
                except Exception as exc:  # infrastructure trouble: retry, then never silently drop
                    if delay is None:
                        log.exception("assembler: giving up on %s", where)
                        await give_up(event, exc)
                    else:
                        log.warning("assembler: %s failed (%r); retrying in %.1fs", where, exc, delay)
                        await asyncio.sleep(delay)

    @app.timer(a.sweep_interval_ms / 1000.0, name="sweep")
    async def sweep() -> None:
        now = now_ms()
        outs = []
        for rid, (at, lane) in list(due.items()):
            if at <= now:
                outs.append(out_map(names.encoded(lane), rid, DeadlineTick(rid).to_wire()))
                due[rid] = (now + TICK_RESEND_MS, lane)
        if outs:
            await send_all(app.producer, outs)


def _observe_terminal(metrics: Metrics, event: Event, state: Assembly | None) -> None:
    manifest = state.manifest if state else None
    modality = request_modality(manifest.modalities) if manifest else "text"
    lane = manifest.lane if manifest else "rt"
    timings = event.timings or {}
    for st in timings.get("stages", []):
        if st["stage"] == "assemble":
            metrics.observe_span("assemble", modality, lane, st["queued_ms"], st["service_ms"])
    if "e2e_ms" in timings:
        metrics.observe_e2e(modality, lane, timings["e2e_ms"])
    if event.error:
        metrics.request_done("assemble", "error", event.error.get("code"))
    else:
        metrics.request_done("assemble", "ok")
