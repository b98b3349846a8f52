"""How many replicas each stage's pool should run, from its lag and its queued work. Pure.

Every ``interval_s`` the scaler hands ``ScalePolicy.decide`` one ``PoolSignal`` per pool:
the replicas alive, the consumer lag per lane (read from the broker) and the engine work the
replicas report queued (predicted ms, ``streams.policies.load``). Per pool:

- **demand** is the replicas that signal needs: ``ceil(max(lag[lane] / lag_per_replica[lane],
  held / target_queued_ms))``; 0 with no lag and nothing queued. ``held`` is the queued work
  with each replica's batch in service counted at most ``target_queued_ms``: a replica busy
  with one 850 ms audio clip and nothing behind it needs no second replica (another would
  take nothing from it), while one clip waiting behind it does; and never more replicas
  than the jobs the pool holds (``items``: a job runs on one replica).
- **wanted** is demand within ``[min, max]``, except that a pool with work never wants 0,
  and an idle pool whose min is 0 keeps one replica until it has been idle ``idle_s``; then
  it stops at once (``reason="idle"``: ``idle_s`` was its window).
- **wake**: a pool at 0 replicas with any demand goes to 1 at once: a record waits on it.
- **up** (Kubernetes' HPA stabilisation, read the same way): when every wanted of the last
  ``up_window_s`` was above the current count, to the *least* of them: a burst shorter than
  the window costs no replica.
- **down**: when every wanted of the last ``down_window_s`` was below the current count and
  the last change is that long ago, to the *most* of them.
- **cores**: a replica beyond a pool's first is started only where the box has cores for it
  and the pool uses the cores it has. With CPU measured (``decide(..., cpu=)``: the box's idle
  cores and each pool's used cores, averaged over the up window), each added replica needs
  half of its threads' cores idle (``MIN_IDLE_SHARE``), what one pool's growth takes is gone
  for the next pool in the same call, and the pool's replicas must keep ``MIN_BUSY_SHARE`` of
  their threads' cores busy: a pool whose work waits on something else (a consumer-group
  rebalance after its last change, the broker) gains nothing from another process, and the
  cores a rebalance leaves idle are not free for long. Without a measurement, the threads of
  every busy replica (one with work to do, counted by each pool's demand) and its own must
  fit in ``cpu_cores``. On a box whose cores are already busy, another replica only splits
  the same cores and adds a context switch, so the policy holds (``reason="cpu"``) instead.

Each call returns a ``Decision`` per pool whose count should change, and one with
``held=True`` per pool that wanted more and was refused by cores or by its max: the scaler
logs and exports both, so nobody has to guess why a pool did not grow.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Mapping


@dataclass(frozen=True)
class PoolRule:
    min: int
    max: int
    lag_per_replica: Mapping[str, int]
    """Lane -> records of lag one replica is expected to carry."""
    target_queued_ms: float
    threads: int = 1
    """Cores one busy replica keeps busy (its engine's threads)."""


@dataclass(frozen=True)
class PoolSignal:
    stage: str
    replicas: int
    lag: Mapping[str, int] = field(default_factory=dict)
    """Lane -> records of consumer lag over the pool's topics."""
    queued_ms: float = 0.0
    """Engine work the pool's replicas report queued (ms), summed: the batches in service too."""
    running_ms: tuple[float, ...] = ()
    """Per replica reporting one, the part of ``queued_ms`` that is its batch in service (ms)."""
    items: int | None = None
    """Jobs the replicas hold or have not read yet, summed (None: not every replica says):
    the queued work cannot ask for more replicas than this, one job runs on one replica."""


def held_ms(sig: PoolSignal, target_ms: float) -> float:
    """The queued work that asks for replicas: each batch in service counts at most ``target_ms``
    (one replica's worth: a batch cannot be split over replicas), what waits counts whole."""
    return sig.queued_ms - sum(max(0.0, r - target_ms) for r in sig.running_ms)


@dataclass(frozen=True)
class Decision:
    stage: str
    current: int
    target: int
    reason: str
    """``wake``, ``lag``, ``queued``, ``calm``, ``idle``, ``min``, ``max``; held: ``cpu`` or ``max``."""
    demand: int
    held: bool = False


MIN_IDLE_SHARE = 0.5
"""With CPU measured, a replica beyond a pool's first starts only while at least this share of
its threads' cores is idle: a process that would get less only slows the others."""
MIN_BUSY_SHARE = 0.75
"""... and only while the pool's replicas keep at least this share of their threads' cores busy."""


@dataclass(frozen=True)
class CpuReading:
    """The box's CPU over the last interval, measured (``mmstream.autoscaler.BoxCpu``)."""

    idle_cores: float
    used_cores: Mapping[str, float] = field(default_factory=dict)
    """Pool -> cores its replicas used."""


def demand(rule: PoolRule, sig: PoolSignal) -> tuple[int, str]:
    """Replicas the signal needs, and which part of it asked (``lag`` or ``queued``)."""
    by_lag = max((sig.lag.get(lane, 0) / per for lane, per in rule.lag_per_replica.items() if per > 0), default=0.0)
    by_queue = held_ms(sig, rule.target_queued_ms) / rule.target_queued_ms if rule.target_queued_ms > 0 else 0.0
    if sig.items is not None:
        by_queue = min(by_queue, float(sig.items))
    need = max(by_lag, by_queue)
    return (math.ceil(need) if need > 0 else 0), ("lag" if by_lag >= by_queue else "queued")


class ScalePolicy:
    def __init__(self, rules: Mapping[str, PoolRule], *, up_window_s: float, down_window_s: float, idle_s: float,
                 cpu_cores: int) -> None:
        self.rules = dict(rules)
        self.up_window_s, self.down_window_s, self.idle_s = up_window_s, down_window_s, idle_s
        self.cpu_cores = cpu_cores
        self._wanted: dict[str, deque[tuple[float, int]]] = {s: deque() for s in self.rules}
        self._since: dict[str, float] = {}
        """Stage -> when the policy first saw it (windows count from there)."""
        self._changed: dict[str, float] = {}
        self._busy_at: dict[str, float] = {}
        self._free: float | None = None
        """Idle cores not yet given to a pool in the current call (None: not measured)."""
        self._cpu: deque[tuple[float, CpuReading]] = deque()
        """(when, what was measured then), over the last up window."""
        self._used: dict[str, float] = {}
        """Pool -> cores it used, the mean over the up window (with ``_free``)."""

    def changed(self, stage: str, now: float) -> None:
        """Tell the policy a pool's count was changed (by it or by hand) at ``now``."""
        self._changed[stage] = now

    def decide(self, now: float, signals: Iterable[PoolSignal], cpu: CpuReading | None = None) -> list[Decision]:
        """``cpu``: the box's CPU since the last call, measured (None: not known; then the
        cores rule counts the busy pools' threads instead)."""
        sigs = {s.stage: s for s in signals if s.stage in self.rules}
        needs = {st: demand(self.rules[st], s) for st, s in sigs.items()}
        busy = {st: min(sigs[st].replicas, n) * self.rules[st].threads for st, (n, _) in needs.items()}
        self._free = self._cpu_mean(now, cpu)
        out = []
        for stage, sig in sigs.items():
            rule, (need, why) = self.rules[stage], needs[stage]
            self._since.setdefault(stage, now)
            if need > 0:
                self._busy_at[stage] = now
            wanted = self._wanted_now(stage, rule, sig, need, now)
            history = self._wanted[stage]
            history.append((now, wanted))
            horizon = now - max(self.up_window_s, self.down_window_s) - 1.0
            while history and history[0][0] < horizon:
                history.popleft()
            d = self._one(stage, rule, sig, need, why, wanted, now, sum(v for k, v in busy.items() if k != stage))
            if d is not None:
                out.append(d)
                if not d.held:
                    self._changed[stage] = now
        return out

    def _cpu_mean(self, now: float, cpu: CpuReading | None) -> float | None:
        """The mean idle cores over the up window (None: not measured); sets ``_used``."""
        if cpu is None:
            self._cpu.clear()
            self._used = {}
            return None
        self._cpu.append((now, cpu))
        while self._cpu and self._cpu[0][0] < now - self.up_window_s:
            self._cpu.popleft()
        n = len(self._cpu)
        pools = {p for _, c in self._cpu for p in c.used_cores}
        self._used = {p: sum(c.used_cores.get(p, 0.0) for _, c in self._cpu) / n for p in pools}
        return sum(max(0.0, c.idle_cores) for _, c in self._cpu) / n

    def _fits(self, stage: str, rule: PoolRule, cur: int, others_busy: int) -> int:
        """The most replicas the pool may have now by the cores rule."""
        threads = max(1, rule.threads)
        if self._free is None:
            return (self.cpu_cores - others_busy) // threads
        if self._used.get(stage, 0.0) < MIN_BUSY_SHARE * cur * threads:
            return cur
        return cur + math.floor(self._free / threads + (1.0 - MIN_IDLE_SHARE))

    def _wanted_now(self, stage: str, rule: PoolRule, sig: PoolSignal, need: int, now: float) -> int:
        if need > 0:
            return max(rule.min, min(rule.max, need), 1)
        if rule.min > 0:
            return rule.min
        idle_for = now - self._busy_at.get(stage, self._since[stage])
        return 0 if sig.replicas == 0 or idle_for >= self.idle_s else 1

    def _window(self, stage: str, now: float, span: float) -> list[int] | None:
        """Every wanted of the last ``span`` seconds, or None while the policy has not watched
        the pool that long."""
        if now - self._since[stage] < span:
            return None
        return [w for t, w in self._wanted[stage] if t >= now - span]

    def _one(self, stage: str, rule: PoolRule, sig: PoolSignal, need: int, why: str, wanted: int, now: float,
             others_busy: int) -> Decision | None:
        cur = sig.replicas
        if cur < rule.min:
            return Decision(stage, cur, rule.min, "min", need)
        if cur > rule.max:
            return Decision(stage, cur, rule.max, "max", need)
        if cur == 0:
            return Decision(stage, 0, 1, "wake", need) if need > 0 else None
        if wanted == 0:  # idle for idle_s already: that was its window
            return Decision(stage, cur, 0, "idle", need)
        if need > cur and cur >= rule.max:
            return Decision(stage, cur, cur, "max", need, held=True)
        up = self._window(stage, now, self.up_window_s)
        if up and min(up) > cur:
            target = min(up)
            fits = self._fits(stage, rule, cur, others_busy)
            if target > fits:
                if fits <= cur:
                    return Decision(stage, cur, cur, "cpu", need, held=True)
                target = fits
            if self._free is not None:  # taken: the next pool of this call sees the rest
                self._free = max(0.0, self._free - (target - cur) * max(1, rule.threads))
            return Decision(stage, cur, target, why, need)
        down = self._window(stage, now, self.down_window_s)
        cooled = now - self._changed.get(stage, self._since[stage]) >= self.down_window_s
        if down and max(down) < cur and cooled:
            target = max(down)
            return Decision(stage, cur, max(1, target), "calm", need)
        return None
