"""Holding a tenant's ingress while its quota sheds it: backpressure through consumer lag.

Where the broker authenticates tenants, each has its own ingress topics, and the router can
stop reading one tenant without slowing any other. A tenant its quota just shed will be shed
again until ``retry_after_ms`` has passed, so reading its records meanwhile only costs the
router and the broker (fetching megabytes over TLS, unpacking and pricing them) for answers
that are known in advance, in the same polls as every other tenant's records. So the router
pauses that tenant's partitions for the retry-after (at most ``max_hold_ms``): its records
wait in its own topics (its consumer lag says so on the dashboards), and are read once the
hold ends, admitted if its quota has room by then, else shed with a retry-after again and
held again. A request is still answered exactly once: late, not lost; past its deadline it
is answered ``deadline_exceeded``.

Pure: the router tells it about each shed and asks, before each poll, which tenants to hold
and which to release.
"""

from __future__ import annotations


class TenantHolds:
    """Which tenants' ingress the router holds now. Memory: one entry per held tenant."""

    def __init__(self, max_hold_ms: float) -> None:
        self.max_hold_ms = max_hold_ms
        self._until: dict[str, float] = {}

    @property
    def enabled(self) -> bool:
        return self.max_hold_ms > 0

    def note_shed(self, tenant: str, retry_after_ms: float, now_ms: float) -> None:
        """The quota shed ``tenant`` now, saying to retry in ``retry_after_ms``."""
        if not self.enabled or retry_after_ms <= 0:
            return
        until = now_ms + min(retry_after_ms, self.max_hold_ms)
        self._until[tenant] = max(until, self._until.get(tenant, 0.0))

    def due(self, now_ms: float) -> tuple[set[str], set[str]]:
        """(the tenants to hold now, the tenants whose hold just ended: to read again)."""
        ended = {t for t, until in self._until.items() if until <= now_ms}
        for t in ended:
            del self._until[t]
        return set(self._until), ended

    def __contains__(self, tenant: str) -> bool:
        return tenant in self._until
