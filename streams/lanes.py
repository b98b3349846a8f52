"""rt before bulk at stages that read both lanes in one stream (the assembler, the video
stage): while the stage's own rt topic has a backlog, it stops fetching its bulk topic.

The encoders order work themselves (their batcher serves rt first); the router folds the
same rule into its backpressure. Here the rule alone: pause the bulk partitions when the
rt backlog passes ``pause_records``, resume when it is back under ``resume_records``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from streams.lagmon import LagReader

log = logging.getLogger(__name__)


@dataclass
class LaneGate:
    """Hysteresis on the rt backlog (records). Pure: ``update`` says what to do."""

    pause_records: int = 100
    resume_records: int = 20
    paused: bool = False

    def update(self, rt_backlog: int) -> str | None:
        if not self.paused and rt_backlog > self.pause_records:
            self.paused = True
            return "pause"
        if self.paused and rt_backlog <= self.resume_records:
            self.paused = False
            return "resume"
        return None


def install_lane_priority(app: Any, bootstrap: str, topic_prefix: str, rt_topic: str, bulk_topic: str,
                          pause_records: int, interval_s: float = 1.0,
                          client_kwargs: dict[str, Any] | None = None) -> LaneGate:
    """A timer on ``app`` that keeps its bulk topic paused while its rt topic is behind
    (``client_kwargs``: the lag reader's security options)."""
    gate = LaneGate(pause_records, max(0, pause_records // 5))
    reader = LagReader(bootstrap, client_kwargs)

    @app.timer(interval_s, name=f"lanes-{rt_topic}")
    async def rt_first() -> None:
        try:
            await reader.start()
            rows = await reader.measure(topic_prefix)
        except Exception as exc:  # lanes are an optimisation: never stop the stage for them
            log.debug("lanes: could not read lag: %r", exc)
            await reader.close()
            return
        backlog = sum(r.lag for r in rows if r.topic == rt_topic and r.group == app.conf.id)
        change = gate.update(backlog)
        bulk = [tp for tp in app.consumer.assignment() if tp.topic == bulk_topic]
        if change == "pause" or (gate.paused and bulk):
            app.consumer.pause_partitions(bulk)
        elif change == "resume":
            app.consumer.resume_partitions(bulk)
        if change:
            log.info("%s: %s %s (rt backlog %d records)", app.conf.id, change, bulk_topic, backlog)

    return gate
