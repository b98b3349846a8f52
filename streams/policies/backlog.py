"""When the router refuses an rt request for the time it waited before the router read it.
Pure: the router tells it how long each rt record waited since the broker appended it, and
asks whether that record is late.

Admission predicts the work queued at the engines (``streams.policies.admission``) and each
encoder refuses what waited past its own bound (``streams.cores.encoder``); neither sees the
time a request spent in the router's own backlog, between the broker's append and the
router's read, which past capacity is a third of an admitted request's tail (docs/capacity.md,
"Stop 54"). The broker's append time (``message.timestamp.type=LogAppendTime`` on the
ingress topics) dates every record with a clock no client sets, so that wait can be bounded.

As the encoders', the bound holds only in a standing backlog (CoDel's good-queue/bad-queue
test): a burst that the router works off within ``interval_s`` is routed whole, however long
its last records waited; a record is refused only once no rt record in the last
``interval_s`` waited ``target_ms`` or less. A good record resets the test, so an idle router
never stands. Where the partitions were taken over, the wait counts from the take-over (the
stage passes that time): a backlog left by a stopped router is not refused for the time
nobody served it.

And only while the box is past its capacity as admission sees it: admission refused a
request for want of capacity (a stage's queued work past its lane's limit, not a tenant's
quota) within the interval. Records also wait with no overload: on a slow network (200 ms
to the broker and back, the network chaos scenario), or behind another tenant's flood that
its quota sheds. Refusing those would tell a client to come back later for what later does
not change, or refuse the tenant the quotas protect."""

from __future__ import annotations

STANDING_S = 1.0
"""How long every rt record must have waited over the target before the backlog stands."""


class StandingBacklog:
    """Tells a late rt record: waited past ``max_wait_ms`` in a backlog that stood for
    ``interval_s`` (no record waited ``target_ms`` or less meanwhile) while admission refused
    for want of capacity (within ``interval_s``). ``max_wait_ms`` 0: off."""

    def __init__(self, max_wait_ms: float, target_ms: float | None = None, interval_s: float = STANDING_S) -> None:
        if max_wait_ms < 0 or interval_s < 0:
            raise ValueError("a backlog bound needs max_wait_ms >= 0 and interval_s >= 0")
        self.max_wait_ms = max_wait_ms
        self.target_ms = max_wait_ms / 4.0 if target_ms is None else target_ms
        self.interval_s = interval_s
        self._good_at: float | None = None  # monotonic: the last rt record that waited target_ms or less
        self._refused_at = float("-inf")  # monotonic: admission's last refusal for want of capacity

    def capacity_refused(self, now_s: float) -> None:
        """Admission refused a request for want of capacity (the engines are full)."""
        self._refused_at = now_s

    def reset(self, now_s: float) -> None:
        """Partitions taken over: what follows is a backlog of its own, given its interval."""
        self._good_at = now_s

    def late(self, waited_ms: float, now_s: float) -> bool:
        """Note one rt record that waited ``waited_ms`` since its append (or the take-over),
        read at ``now_s`` (monotonic); True when it is to be refused."""
        if self.max_wait_ms <= 0:
            return False
        if waited_ms <= self.target_ms or self._good_at is None:
            self._good_at = now_s
            return False
        return waited_ms > self.max_wait_ms and self.standing(now_s)

    def standing(self, now_s: float) -> bool:
        """Whether the backlog stands now, on a box past its capacity."""
        return (self.max_wait_ms > 0 and self._good_at is not None and now_s - self._good_at > self.interval_s
                and now_s - self._refused_at <= self.interval_s)
