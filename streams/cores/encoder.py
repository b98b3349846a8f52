"""The encoder core: one modality's jobs in, one answer per job out, with the engine kept busy.

It knows no Kafka; the encode stage (``streams.stages.encoder``) is the glue around it, as the
generator stage is around the ``GenerationCore``. Jobs come in with ``submit`` (a co-located
router's too, as placement decides), each with an ``origin`` the core never looks into and hands
back with the job's ``EncodeAnswer`` through ``on_answer``. One task runs ``step`` in a loop
(``run``); threads do the slow work, so the event loop that holds every queue never waits for
it:

- the prep thread fetches claim-checked bytes, does the CPU work before the model and asks the reuse
  cache (one MGET per submitted batch): hits and refusals are answered at once, misses are queued by
  lane with their real cost (tokens);
- a job whose preparation the router priced over ``heavy_prep_ms`` (a pixel-bound picture's decode) is
  prepared on a third thread, one job at a time in tenant-fair order of their prices (``FairOrder``: one
  tenant's batch of costly decodes holds another tenant's heavy job behind one decode, not all of them;
  a job whose turn comes past its deadline is answered without its decode), at lower CPU priority within
  this process
  (``lower_thread_priority``; between processes the kernel's autogroups or cgroups share the cores
  whatever a thread's nice value, so a runner that can hands the decode itself to a low-priority
  process of its own, ``Runner.prepare_heavy``: images, ``workers.offload``), then looked up in the
  cache on the prep thread: it holds no light job's preparation behind it. Which thread is decided by
  the router's price, not by the decode's real cost;
- the engine thread runs the batch the pure ``MicroBatcher`` picks (rt first, length-aware, its
  budget in ms predicted by a ``BatchCostModel`` that learns from every batch) from each lane's
  queue in tenant-fair order (``FairOrder``: one tenant's backlog never holds another's items behind
  it).

The direct path: while the engine is idle (nothing queued, running or being prepared, company worth
nothing) the engine thread prepares and runs a submitted batch in one call while the prep thread
asks the cache: two hand-offs fewer, most of what an idle stage adds.

What admission predicts is also enforced here: the rt job of a one-part request that waited in the
engine's queue past ``max_wait_rt_ms`` while that queue stands (it has not been empty for
``STANDING_QUEUE_S``) is answered ``overloaded`` before the next batch is picked, not run late
(``_refuse_late``; a model server's queue timeout, applied as CoDel tells a standing queue from a
burst).

Each rt job that carries the wait the router predicted for it (``EncodeJob.predicted_wait_ms``)
teaches ``waits`` how far such predictions run from the wait it had until the engine started it
(from the router's send: the hop and the intake included) or until it expired; the stage reports
it (``wait_scale``) and the router's admission scales its predictions by it.

Every job submitted is answered exactly once: its output, its error (refused, failed, or past its
deadline: such work never reaches the engine) or a cache hit. ``held`` counts jobs between
``submit`` and their answer; bounding intake on it is the caller's.

It shares the ``GenerationCore``'s shape (opaque keys in, one engine thread, a cost model learned
from measured service predicting the next job's wait), not code: their policies differ (a micro-
batcher over whole jobs, a step scheduler over sequences).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

from schemas.errors import ErrorCode, WireError
from schemas.jobs import EncodeJob
from schemas.settings_serving import EncoderSettings
from schemas.trace import now_ms
from streams.policies.batching import Batch, BatchLimits, MicroBatcher, Pending, Wait
from streams.policies.calibration import PredictionCalibration
from streams.policies.cost_model import BatchCostModel, Observation
from streams.policies.fair_order import FairOrder
from streams.policies.load import MAX_WAIT_SCALE, MIN_WAIT_SCALE, WAIT_FLOOR_MS
from workers import modalities
from workers.calibration import CalibrationCache
from workers.outputs import Encoded, EncoderRunner, Prepared

log = logging.getLogger(__name__)

LANES = ("rt", "bulk")
MIN_BATCHING_GAIN = 0.1
TEXT_LENGTHS = (8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# Engine ms one batch may take when the engine runs its rows alone: company saves it nothing
# and every row waits for the end of its batch, so batches stay short and in arrival order.
ROWS_ALONE_BATCH_MS = 10.0
MIN_RETRY_AFTER_MS = 200
"""What an rt job refused for its wait here is told to wait at least, beside the rt work queued."""
WAIT_FORGET_S = 10.0
"""A wait calibration that learned nothing for this long starts again from 1."""
STANDING_QUEUE_S = 1.0
"""How long the rt queue must have held work without a break before ``max_wait_rt_ms`` refuses
what waited in it (``_refuse_late``). A burst the engine drains within it (200 texts at once on
an idle box: their last waited about 0.4 s) is answered whole, as admission admitted it; a
queue that has not emptied for this long is the stage past its capacity. The interval of CoDel
(Nichols and Jacobson, 2012), in the form Facebook's servers use for their request queues
(Maurer, "Fail at Scale", 2015): while the queue emptied within the interval nothing in it can
have waited longer than the interval. A queue that only refusals emptied has not drained: work
that joins it within the interval finds it still standing. So the worst wait is about the
interval (the first second of a standing queue) plus the batch running, then the bound."""
STORE_AFTER_S = 0.005
"""How long after a batch's answers its outputs go to the reuse cache: the store (packing,
one Redis round trip) runs on the prep thread, and started at once it contends with the loop
that is sending those answers (about a millisecond per light-load request on a 2-core VM:
docs/capacity.md, "Stop 50")."""


@dataclass(frozen=True, slots=True)
class EncodeAnswer:
    """One job's end: its engine output (``Encoded``, ``cache`` set when the reuse cache was
    asked) or the error to answer it with."""

    job: EncodeJob
    origin: Any
    """What the caller submitted it with."""
    lane: str
    result: Encoded | Exception
    span: tuple[float, float] | None
    """(started, finished) wall ms of its engine call; for a cache hit or a refusal, (at, at)
    where ``at`` is when it was answered; None past its deadline."""


class EncoderObserver(Protocol):
    """What the core reports while it runs (to the stage's metrics)."""

    def queue_depth(self, lane: str, depth: int) -> None: ...  # items of ``lane`` queued now

    def batch(self, answers: list[EncodeAnswer], started: float, finished: float) -> None: ...  # one engine call


@dataclass(frozen=True, slots=True)
class _Held:
    """A prepared job waiting for the engine, at ``order`` in its lane (``FairOrder.tag``)."""

    prepared: Prepared
    origin: Any
    lane: str
    order: tuple[float, int] = (0.0, 0)


class EncoderCore:
    """``runner``: the modality's compute (``workers.encoders.EncoderFront``); ``limits``: the encoder
    settings; ``modality``: the pool's (``any`` serves several); ``on_answer``: called on the
    event loop with each job's answer, exactly once per job."""

    def __init__(self, runner: EncoderRunner, limits: EncoderSettings, modality: str,
                 on_answer: Callable[[EncodeAnswer], None], observer: EncoderObserver, max_frames: int = 1,
                 thread_nice: int = 0) -> None:
        self.runner, self.limits, self.modality = runner, limits, modality
        self.on_answer, self.max_frames = on_answer, max_frames
        self.observer = observer
        self.lengths = TEXT_LENGTHS if runner.variable_length else (1,)
        self.model = BatchCostModel(runner.cost_prior, max_batch_size=limits.max_batch_size,
                                    max_batch_ms=limits.max_batch_ms, rows_alone=runner.rows_alone)
        padded = runner.variable_length and not runner.rows_alone  # only padded batches gain from grouping
        self.batcher: MicroBatcher[_Held] = MicroBatcher(
            BatchLimits(limits.max_batch_size, limits.max_wait_ms / 1000.0,
                        min(limits.max_batch_ms, ROWS_ALONE_BATCH_MS) if runner.rows_alone else limits.max_batch_ms,
                        grouping=limits.grouping if padded else "fifo"),
            batch_cost=lambda cs: self.model.batch_ms(cs))
        self.fair = limits.order == "fair"
        self.order: dict[str, FairOrder[Pending[_Held]]] = {lane: FairOrder(key=_order_key) for lane in LANES}
        self.queues: dict[str, list[Pending[_Held]]] = {lane: o.items for lane, o in self.order.items()}
        self.held = self.held_bulk = 0  # jobs submitted, not yet answered (all, and bulk's)
        self.held_bytes = 0  # the payload bytes they carry (``EncodeJob.payload_bytes``)
        self.running_ms = 0.0  # predicted ms of the batch the engine thread runs now
        self.direct_ms = 0.0  # ... of the submitted batch it prepares and runs directly
        self.running_since = self.direct_since = 0.0  # when each began (monotonic s)
        self.preparing = 0  # submitted batches on the prep thread now
        self.preparing_heavy = 0  # ... of them on the heavy prep thread (the engine may be idle meanwhile)
        # Predicted ms of the jobs being prepared, by lane, from their size before tokenizing:
        # already this core's work, so ``queued_ms`` counts it.
        self.preparing_ms = {lane: 0.0 for lane in LANES}
        self.wake = asyncio.Event()
        # ``thread_nice``: these threads below the process's others (an encoder placed in the router).
        lowered = {"initializer": lower_thread_priority, "initargs": (thread_nice,)} if thread_nice > 0 else {}
        self.engine = ThreadPoolExecutor(1, thread_name_prefix=f"engine-{modality}", **lowered)
        self.prep = ThreadPoolExecutor(1, thread_name_prefix=f"prep-{modality}", **lowered)
        self.prep_heavy: ThreadPoolExecutor | None = None
        """Where jobs priced over ``limits.heavy_prep_ms`` are prepared, at lower CPU priority
        (made at the first such job)."""
        self.heavy_turns: FairOrder[_Turn] = FairOrder(key=_turn_key)  # heavy jobs waiting for that thread
        self.heavy_busy = False  # a heavy job has its turn now
        self.waits = self._new_waits()
        """How far the router's predicted waits (``EncodeJob.predicted_wait_ms``) ran from the
        waits rt jobs had until the engine started them, or until they expired waiting."""
        self.waits_at = 0.0  # when ``waits`` last learned (monotonic s)
        self.hold_background: Callable[[int], None] | None = None
        """Set by a pool (``quota.debt_nice``): told how many background jobs (``EncodeJob.background``,
        admitted over their tenant's compute bucket) the engine runs now, 0 when none: the process
        runs lower while it runs a batch of nothing else and no other job waits here."""
        self.background_running = 0
        self.late = 0  # rt jobs refused for waiting past ``limits.max_wait_rt_ms`` (``_refuse_late``)
        self.rt_busy_since = 0.0  # monotonic: when an rt job last joined an empty rt queue
        self.rt_refused_empty_at = float("-inf")  # monotonic: when refusals last emptied the rt queue

    # -- intake ---------------------------------------------------------------------------

    def submit(self, jobs: list[tuple[EncodeJob, str, Any]]) -> None:
        """Take ``(job, lane, origin)`` triples: a job already past its deadline is answered
        at once (``deadline_exceeded``), the rest are prepared and queued (or run directly).
        Call on the event loop; never raises for one job."""
        now, live = now_ms(), []
        for job, lane, origin in jobs:
            self.held += 1
            self.held_bulk += lane == "bulk"
            self.held_bytes += job.payload_bytes
            if job.deadline_at_ms <= now:
                self._answer(EncodeAnswer(job, origin, lane, deadline_error(), None))
            else:
                live.append((job, lane, origin))
        if live:
            if self.background_running and any(not job.background for job, _, _ in live):
                self._hold_background(0)  # it must not wait behind a lowered batch
            self._prepare(live)

    def queued_ms(self, lane: str) -> float:
        """Predicted engine time ahead of a new job of ``lane``: the batch running, the rt
        queue, and for bulk the bulk queue too (rt goes first)."""
        lanes = ("rt",) if lane == "rt" else LANES
        return (self.in_service_ms() + sum(self.preparing_ms[q] for q in lanes)
                + sum(self.model.per_item_ms(p.cost) for q in lanes for p in self.queues[q]))

    def in_service_ms(self) -> float:
        """Predicted ms left of what the engine runs now (the batch running, the batch run
        directly): what it was predicted at less how long it has run. 0 once it ran past its
        prediction: as far as the model knows it is done any moment, and counted whole it would
        stand ahead of new work after it finished, until the router reads the next report."""
        now = time.monotonic()
        return (max(0.0, self.running_ms - (now - self.running_since) * 1000.0)
                + max(0.0, self.direct_ms - (now - self.direct_since) * 1000.0))

    def queued(self) -> Iterator[tuple[str, str, Any, float]]:
        """(lane, tenant, origin, predicted ms) of every job queued for the engine."""
        return ((lane, p.item.prepared.job.tenant, p.item.origin, self.model.per_item_ms(p.cost))
                for lane, q in self.queues.items() for p in q)

    def item_costs(self) -> Iterator[tuple[float, float]]:  # (length, ms of one more) per length run
        return ((length, self.model.per_item_ms(length)) for length in self.lengths)

    def typical_ms(self) -> float:  # one item of a middling length (what an unread record is priced at)
        return self.model.per_item_ms(self.lengths[len(self.lengths) // 2])

    def engine_idle(self) -> bool:  # the direct path's condition
        return (self.direct_ms == 0.0 and self.running_ms == 0.0 and self.preparing == self.preparing_heavy
                and not self.queues["rt"] and not self.queues["bulk"] and self._wait_s() == 0.0)

    def _prepare(self, jobs: list[tuple[EncodeJob, str, Any]]) -> None:
        """Start preparing one submitted batch: on the prep thread, or, when the engine is
        idle, prepared and run in one call on the engine thread (the module docstring). Its
        heavy jobs (``heavy_prep_ms``) go to the heavy prep thread instead. Never raises: a group
        that cannot be started (a bug: a spec's ``units``, the executor) has each job answered."""
        light, heavy = [], []
        for t in jobs:
            (heavy if self._heavy(t[0]) else light).append(t)
        # Each heavy job a group of its own: it takes its turn on the heavy thread alone.
        groups = [(light, False, self.engine_idle())] + [([t], True, False) for t in heavy]
        for group, is_heavy, direct in groups:
            if not group:
                continue
            try:
                self._start_prep(group, direct=direct, heavy=is_heavy)
            except Exception as exc:  # a bug (a spec's ``units``, the executor): this group's jobs, answered once
                log.exception("encode.%s: starting to prepare %d jobs failed", self.modality, len(group))
                err = WireError(ErrorCode.INTERNAL, f"encode.{self.modality} failed: {type(exc).__name__}")
                for job, lane, origin in group:
                    self._answer(EncodeAnswer(job, origin, lane, err, None))

    def _heavy(self, job: EncodeJob) -> bool:
        return 0 < self.limits.heavy_prep_ms < (job.prep_ms or 0.0)

    async def _prepare_heavy(self, job: EncodeJob) -> list[Any]:
        """The prep thread's work for one heavy job: the decode on the heavy prep thread when its
        turn comes (``_heavy_turn``), the cache lookup back on the prep thread (the cache has one
        caller), waiting for no other worker's claim: a repeat is recomputed (an engine call of
        milliseconds) rather than holding the prep thread, and every light job behind it, for
        the claim's wait."""
        loop = asyncio.get_running_loop()
        if self.prep_heavy is None:
            self.prep_heavy = ThreadPoolExecutor(1, thread_name_prefix=f"prep-heavy-{self.modality}",
                                                 initializer=lower_thread_priority, initargs=(self.limits.heavy_prep_nice,))
        await self._heavy_turn(job)
        if job.deadline_at_ms <= now_ms():  # its turn came past its deadline: answered, not decoded
            self._end_heavy_turn()
            return [deadline_error()]
        try:
            decode = self.prep_heavy.submit(self.runner.prepare_items, [job], True)
        except BaseException:
            self._end_heavy_turn()
            raise
        # The turn ends with the decode, not with this task: a job cancelled mid-decode (a
        # revocation, a shutdown) must not let the next one in while its decode holds the thread.
        decode.add_done_callback(lambda _: loop.is_closed() or loop.call_soon_threadsafe(self._end_heavy_turn))
        items = await asyncio.wrap_future(decode)
        return await loop.run_in_executor(self.prep, self.runner.lookup, items, False)

    async def _heavy_turn(self, job: EncodeJob) -> None:
        """Wait until ``job`` may use the heavy prep thread: one job at a time, in fair order
        between tenants by the decode's price (start tags, as the engine's queues)."""
        turn = _Turn(self.heavy_turns.tag(job.tenant, job.prep_ms or 0.0), asyncio.get_running_loop().create_future())
        self.heavy_turns.push(turn)
        self._grant_heavy_turn()
        try:
            await turn.go
        except BaseException:  # cancelled: waiting, it leaves the queue; given the turn, it passes it on
            if turn in self.heavy_turns.items:
                self.heavy_turns.items.remove(turn)
            elif turn.go.done() and not turn.go.cancelled():
                self._end_heavy_turn()
            raise

    def _end_heavy_turn(self) -> None:
        self.heavy_busy = False
        self._grant_heavy_turn()

    def _grant_heavy_turn(self) -> None:
        """A free heavy thread goes to the first job in order still waiting (a turn cancelled
        whose task has not run its handler yet is passed over, never granted)."""
        while not self.heavy_busy and self.heavy_turns.items:
            turn = self.heavy_turns.items.pop(0)
            if turn.go.done():
                continue
            self.heavy_turns.taken([turn.order])
            self.heavy_busy = True
            turn.go.set_result(None)

    def _start_prep(self, jobs: list[tuple[EncodeJob, str, Any]], direct: bool = False, heavy: bool = False) -> None:
        loop = asyncio.get_running_loop()
        estimate = {lane: 0.0 for lane in LANES}
        for job, lane, _ in jobs:
            estimate[lane] += self.model.per_item_ms(self._length_before_prep(job))
        if direct:
            self._hold_background(self._background_only([j for j, _, _ in jobs]))
            work = loop.run_in_executor(self.engine, self._prepare_and_run, [j for j, _, _ in jobs])
            self.direct_ms, self.direct_since = max(0.001, estimate["rt"] + estimate["bulk"]), time.monotonic()
        else:
            work = (asyncio.ensure_future(self._prepare_heavy(jobs[0][0])) if heavy else
                    loop.run_in_executor(self.prep, self.runner.prepare_many, [j for j, _, _ in jobs]))
            self.preparing += 1
            self.preparing_heavy += heavy
            for lane, ms in estimate.items():
                self.preparing_ms[lane] += ms
        asyncio.ensure_future(self._prepared(jobs, work, direct, estimate, heavy))

    def _length_before_prep(self, job: EncodeJob) -> float:
        """A job's length from its size (as the router prices it), capped at the longest run."""
        if not self.runner.variable_length:
            return 1.0
        spec = modalities.get(self._modality(job))
        size = len(job.text) if job.text is not None else len(job.data or b"")
        units = spec.units(size, self.max_frames) if spec is not None else self.lengths[-1]
        return float(min(self.lengths[-1], max(1.0, units)))

    def _modality(self, job: EncodeJob) -> str:
        return job.modality if self.modality == "any" else self.modality

    async def _prepared(self, jobs: list[tuple[EncodeJob, str, Any]], work: asyncio.Future, direct: bool,
                        estimate: dict[str, float], heavy: bool = False) -> None:
        """Back on the loop: answer what needs no engine, queue the rest (or answer the batch
        the engine thread ran directly)."""
        ran: tuple[list[Any], list[float], float, float] | None = None
        try:
            if direct:
                try:
                    items, lookup, ran = await work
                finally:
                    self.direct_ms = 0.0
                    self._hold_background(0)
                ready = await self._looked_up(items, lookup)
            else:
                try:
                    ready = await work
                finally:
                    self.preparing -= 1
                    self.preparing_heavy -= heavy
                    for lane, ms in estimate.items():
                        self.preparing_ms[lane] = max(0.0, self.preparing_ms[lane] - ms)
        except Exception as exc:  # the runner isolates items; this is a bug
            log.exception("encode.%s: preparing %d jobs failed", self.modality, len(jobs))
            ready, ran = [exc] * len(jobs), None
        now, at = time.monotonic(), now_ms()
        done: list[_Held] = []
        for (job, lane, origin), item in zip(jobs, ready):
            if isinstance(item, (Exception, Encoded)):  # refused, or a reuse-cache hit: answered here
                self._answer(EncodeAnswer(job, origin, lane, item, (at, at)))
            elif ran is not None:
                done.append(_Held(item, origin, lane))
            else:
                self._enqueue(lane, item, origin, now)
        if ran is not None and done:
            outputs, ran_lengths, started, finished = ran
            results = [o for o, item in zip(outputs, ready) if not isinstance(item, (Exception, Encoded))]
            self._answer_batch(done, results, started, finished, ran_lengths)
        elif ran is not None and ran[1]:  # the engine ran, and the cache answered every job meanwhile:
            self._observe_run(ran[1], ran[3] - ran[2])  # what it ran still teaches the cost model
        self._report_depths()
        self.wake.set()

    def _enqueue(self, lane: str, item: Prepared, origin: Any, now: float) -> None:
        """Queue a job by tenant and predicted cost (``order=fair``), or last (``arrival``)."""
        order = self.order[lane]
        # A queue that refusals emptied did not drain: it stands still if work comes within the interval.
        if lane == "rt" and not order.items and now - self.rt_refused_empty_at > STANDING_QUEUE_S:
            self.rt_busy_since = now
        tag = order.tag(item.job.tenant, self.model.per_item_ms(item.length)) if self.fair else order.tag("", 0.0)
        order.push(Pending(_Held(item, origin, lane, tag), item.length, now))

    async def _looked_up(self, items: list[Any], lookup: Any) -> list[Any]:
        """What the lookup beside a direct run found (``items`` if it failed: that costs only time)."""
        if lookup is None:
            return items
        try:
            return await asyncio.wrap_future(lookup)
        except Exception:  # the runner isolates cache trouble; this is a bug: answer what ran
            log.exception("encode.%s: cache lookup failed", self.modality)
            return items

    def _prepare_and_run(self, jobs: list[EncodeJob]) -> tuple[list[Any], Any, tuple[list[Any], list[float], float, float] | None]:
        """Engine thread, engine idle: prepare ``jobs`` and run them while the prep thread asks
        the cache (a hit it finds wins; a miss claimed elsewhere is computed here anyway).
        Returns per job its exception or ``Prepared``, the lookup's future (None: nothing to
        look up), and (per job the output or None, the lengths run, started, finished)."""
        items = self.runner.prepare_items(jobs)
        todo = [i for i, item in enumerate(items) if not isinstance(item, Exception)]
        if not todo:
            return items, None, None
        lookup = self.prep.submit(self.runner.lookup, items, False)
        results, started, finished = self._timed_run([items[i] for i in todo])
        outputs: list[Any] = [None] * len(items)
        for i, r in zip(todo, results):
            outputs[i] = r
        return items, lookup, (outputs, [items[i].length for i in todo], started, finished)

    def _timed_run(self, items: list[Any]) -> tuple[list[Any], float, float]:
        """Engine thread: one engine call, timed where it runs; one output or exception per item."""
        started = now_ms()
        try:
            results = self.runner.run(items)
        except Exception as exc:  # the runner isolates items; this is a bug
            log.exception("encode.%s: engine call failed", self.modality)
            results = [exc] * len(items)
        if len(results) != len(items):
            log.error("encode.%s: engine returned %d outputs for %d inputs", self.modality, len(results), len(items))
            results = [RuntimeError("engine returned a wrong number of outputs")] * len(items)
        return results, started, now_ms()

    # -- the engine -----------------------------------------------------------------------

    async def calibrate(self, cache: CalibrationCache, intra_op_threads: int, max_age_s: float) -> str:
        """Fit the cost model to this engine's timings: a replica's on this machine, or timed now."""
        timed = cache.load(self.runner.identity, intra_op_threads, max_age_s)
        source = "reused from this machine"
        if timed is None:
            timed = await asyncio.get_running_loop().run_in_executor(self.engine, self.runner.calibrate)
            cache.store(self.runner.identity, intra_op_threads, timed)
            source = "timed"
        self.model.calibrate([Observation(int(n), length, ms) for n, length, ms in timed])
        return source

    async def step(self) -> Batch[Any] | Wait | None:
        """Run the next batch the batcher picks, if one is due. Returns the batch it ran, or
        when the next one is due with no new arrival (``Wait``), or None: nothing queued."""
        now = time.monotonic()
        if self.limits.max_wait_rt_ms > 0 and self.queues["rt"] and now - self.rt_busy_since > STANDING_QUEUE_S:
            self._refuse_late(now)
        decision = self.batcher.next_batch(self.queues["rt"], self.queues["bulk"], now, self._wait_s())
        if isinstance(decision, Batch):
            await self._run(decision)
        return decision

    async def run(self, should_stop: Callable[[], bool]) -> None:
        """``step`` until ``should_stop()``, sleeping until a batch is due or work arrives."""
        while not should_stop():
            self.wake.clear()
            try:
                decision = await self.step()
            except Exception:
                log.exception("encode.%s: batch failed", self.modality)
                await asyncio.sleep(0.01)  # a bug that repeats must not spin the loop
                continue
            if isinstance(decision, Batch):
                continue
            timeout = None if decision is None else max(0.0, decision.until - time.monotonic())
            try:
                await asyncio.wait_for(self.wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass

    def _wait_s(self) -> float:
        """How long an item waits for company: the setting where batches of the typical length
        are cheaper per item (by MIN_BATCHING_GAIN, as the cost model learned); else 0."""
        typical = self.lengths[len(self.lengths) // 2]
        return self.limits.max_wait_ms / 1000.0 if self.model.batching_gain(typical) >= MIN_BATCHING_GAIN else 0.0

    async def _run(self, batch: Batch[_Held]) -> None:
        chosen = {id(p) for p in batch.items}
        queue = self.queues[batch.lane]
        queue[:] = [p for p in queue if id(p) not in chosen]
        self.order[batch.lane].taken([p.item.order for p in batch.items])
        self._report_depths()
        now = now_ms()
        live = [p.item for p in batch.items if p.item.prepared.job.deadline_at_ms > now]
        for p in batch.items:
            if p.item.prepared.job.deadline_at_ms <= now:
                self._observe_wait(p.item.prepared.job, p.item.lane, now)  # it waited at least this long
                self._answer(EncodeAnswer(p.item.prepared.job, p.item.origin, p.item.lane, deadline_error(), None))
        if not live:
            return
        self.running_ms = max(0.001, self.model.batch_ms([h.prepared.length for h in live]))
        self.running_since = time.monotonic()
        self._hold_background(self._background_only([h.prepared.job for h in live]))
        try:
            results, started, finished = await asyncio.get_running_loop().run_in_executor(
                self.engine, self._timed_run, [h.prepared for h in live])
        except Exception as exc:  # the executor itself failed; a bug
            log.exception("encode.%s: engine call failed", self.modality)
            results, started, finished = [exc] * len(live), now_ms(), now_ms()
        finally:
            self.running_ms = 0.0
            self._hold_background(0)
        self._answer_batch(live, results, started, finished)

    def _background_only(self, jobs: list[EncodeJob]) -> int:
        """How many of the engine's ``jobs`` are background, where all of them are and no other
        job waits here; else 0 (a batch that another tenant's work waits behind runs at the level)."""
        if self.hold_background is None or not all(job.background for job in jobs):
            return 0
        waiting = (p.item.prepared.job for queue in self.queues.values() for p in queue)
        return 0 if any(not job.background for job in waiting) else len(jobs)

    def _hold_background(self, n: int) -> None:
        if self.hold_background is not None and n != self.background_running:
            self.background_running = n
            try:
                self.hold_background(n)
            except Exception:  # a priority is a preference: never a reason to fail a batch
                log.exception("encode.%s: could not change the CPU priority", self.modality)

    def _answer_batch(self, live: list[_Held], results: list[Any], started: float, finished: float,
                      ran_lengths: list[float] | None = None) -> None:
        """Answer one engine run's jobs, then account for it (the cost model, the observer;
        ``ran_lengths``: what the engine ran, when more than ``live``) and store its misses."""
        writes, answers = [], []
        for h, r in zip(live, results):
            self._observe_wait(h.prepared.job, h.lane, started)
            if isinstance(r, Encoded) and h.prepared.key is not None:
                writes.append((h.prepared.key, r))
                r = Encoded(r.embedding, r.extras, cache="miss")
            answer = EncodeAnswer(h.prepared.job, h.origin, h.lane, r, (started, finished))
            answers.append(answer)
            self._answer(answer)
        self._observe_run([h.prepared.length for h in live] if ran_lengths is None else ran_lengths,
                          finished - started)
        try:  # after the answers: accounting must never cost them
            self.observer.batch(answers, started, finished)
        except Exception:
            log.exception("encode.%s: accounting for a batch of %d failed", self.modality, len(live))
        if writes:  # on the prep thread, once the answers left: nothing awaits it, so its end wakes no loop
            asyncio.get_running_loop().call_later(STORE_AFTER_S, self._store, writes)

    def _store(self, writes: list[tuple[str, Any]]) -> None:
        try:
            self.prep.submit(self.runner.store, writes).add_done_callback(self._stored)
        except RuntimeError:  # the executor shut down meanwhile (the stage stopping): the cache only costs time
            pass

    def _stored(self, done: Future) -> None:
        """Prep thread: a store that raised (the runner keeps cache trouble to itself; a bug)."""
        if not done.cancelled() and done.exception() is not None:
            log.error("encode.%s: storing outputs in the reuse cache failed", self.modality,
                      exc_info=done.exception())

    def _observe_run(self, lengths: list[float], ms: float) -> None:
        try:
            self.model.observe_batch(lengths, ms)
        except Exception:  # accounting must never cost an answer
            log.exception("encode.%s: the cost model could not learn from a batch of %d", self.modality, len(lengths))

    def _observe_wait(self, job: EncodeJob, lane: str, reached_ms: float) -> None:
        """Learn from one rt job that reached the engine (or expired in its queue) at
        ``reached_ms``, against what was predicted for it plus its own preparation (the router
        priced it; the wait until the engine includes it). Not from a heavy job: its wait is
        mostly its turn for the heavy thread behind its own tenant's decodes, which a
        prediction for any other tenant's job does not share. Not from a job that expired
        before it was taken in (a replay after a rebalance, a stage that was down): no
        admission could have predicted that wait."""
        if lane == "rt" and job.predicted_wait_ms is not None and not self._heavy(job):
            self.waits.observe(job.predicted_wait_ms + (job.prep_ms or 0.0), max(0.0, reached_ms - job.sent_at_ms))
            self.waits_at = time.monotonic()

    def wait_scale(self) -> float:
        """What ``waits`` learned, or 1 once no rt job taught it anything for
        ``WAIT_FORGET_S`` (what a burst or a replay taught is not kept for an idle stage)."""
        if self.waits.observed and time.monotonic() - self.waits_at > WAIT_FORGET_S:
            self.waits = self._new_waits()
        return self.waits.factor

    @staticmethod
    def _new_waits() -> PredictionCalibration:
        return PredictionCalibration(floor_ms=WAIT_FLOOR_MS, low=MIN_WAIT_SCALE, high=MAX_WAIT_SCALE)

    def _refuse_late(self, now_s: float) -> None:
        """Answer ``overloaded`` every rt job of a one-part request that has waited in the
        engine's queue past ``limits.max_wait_rt_ms`` (admission's prediction ran short; called
        only while the queue stands: ``STANDING_QUEUE_S``), with
        the time the rt work queued here needs, rather than run it late; before the batch is
        picked, so a refused job takes no place in it. Not bounded: a part of a request of
        several (it waits for its own siblings too, and refused alone it would leave its
        request a partial answer), a video's chunk, bulk. Its preparation (a cold decode, its
        turn on the heavy thread behind its own tenant's) is not counted: the wait is from the
        queue it joined once prepared."""
        bound_s, at = self.limits.max_wait_rt_ms / 1000.0, now_ms()
        queue = self.queues["rt"]
        # A job past its deadline too is left to the batch, which answers it deadline_exceeded.
        late = [p for p in queue if now_s - p.enqueued_at > bound_s and p.item.prepared.job.n_parts == 1
                and p.item.prepared.job.chunk is None and p.item.prepared.job.deadline_at_ms > at]
        if not late:
            return
        gone = {id(p) for p in late}
        queue[:] = [p for p in queue if id(p) not in gone]
        if not queue:
            self.rt_refused_empty_at = now_s
        self.order["rt"].taken([p.item.order for p in late])
        self._report_depths()
        retry = self._retry_after_ms()
        for p in late:
            job = p.item.prepared.job
            self.late += 1
            self._observe_wait(job, "rt", at)  # it waited at least this long
            err = late_error(self.modality, (now_s - p.enqueued_at) * 1000.0, self.limits.max_wait_rt_ms, retry)
            self._answer(EncodeAnswer(job, p.item.origin, "rt", err, None))

    def _retry_after_ms(self) -> int:
        """How long a job refused here is told to wait: the rt work queued here, and at least
        ``MIN_RETRY_AFTER_MS``; never raises (a refusal must be answered)."""
        try:
            queued = self.queued_ms("rt")
            return MIN_RETRY_AFTER_MS + (int(min(queued, 60_000.0)) if queued > 0 else 0)
        except Exception:  # a bug in the cost model: the floor, not a lost answer
            log.exception("encode.%s: could not predict the rt work queued", self.modality)
            return MIN_RETRY_AFTER_MS

    def _answer(self, answer: EncodeAnswer) -> None:
        self.held -= 1
        self.held_bulk -= answer.lane == "bulk"
        self.held_bytes -= answer.job.payload_bytes
        try:
            self.on_answer(answer)
        except Exception:  # the caller's bug must not stop the answers after it
            log.exception("encode.%s: answering %s part %d failed", self.modality, answer.job.id, answer.job.part)

    def _report_depths(self) -> None:
        for lane, q in self.queues.items():
            self.observer.queue_depth(lane, len(q))


def late_error(modality: str, waited_ms: float, bound_ms: float, retry_after_ms: int) -> WireError:
    """The answer of an rt job refused for its wait (``EncoderCore._refuse_late``)."""
    return WireError(ErrorCode.OVERLOADED,
                     f"the part waited {waited_ms:.0f} ms for encode.{modality}'s engine, past its bound of "
                     f"{bound_ms:.0f} ms (the stage is past its capacity); retry later", None, retry_after_ms)


def _order_key(p: Pending[_Held]) -> tuple[float, int]:
    return p.item.order


@dataclass(eq=False, slots=True)
class _Turn:
    """A heavy job waiting for the heavy prep thread: ``go`` is set when its turn comes."""

    order: tuple[float, int]
    go: asyncio.Future


def _turn_key(t: _Turn) -> tuple[float, int]:
    return t.order


def deadline_error() -> WireError:
    return WireError(ErrorCode.DEADLINE_EXCEEDED, "the part reached its encoder after the request's deadline")


def lower_thread_priority(nice: int) -> None:
    """Thread initializer: the calling thread's CPU priority lowered by ``nice`` (on Linux a
    thread has a nice value of its own; elsewhere nothing is changed, since the call would
    lower the whole process). The scheduler then gives it what the other threads leave:
    nearly all of an idle core, about a tenth of a busy one at ``nice`` 10."""
    if not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as exc:  # not allowed here: the thread runs at the process's priority
        log.info("could not lower a prep thread's priority: %r", exc)
