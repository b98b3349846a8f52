"""Run a fault scenario against a pipeline and check the invariants afterwards.

    python -m mmstream.chaos chaos/scenarios/worker-crashes.json

uses the local pipeline of `mmstream up` (settings from the environment). A scenario is
data: how many requests, how fast, and at which request which stage gets which signal.
The invariant checked is DESIGN.md's first: every accepted request gets exactly one
terminal event on its reply topic, read from the wire (not through the deduplicating SDK);
``expect.outcome`` also says which kind those events must be.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmstream.supervisor import Supervisor
from schemas.codec import unpack
from schemas.events import Event
from schemas.request import Modality, Part, Request
from schemas.settings import Settings
from streams.client import Client, new_id
from streams.security import KafkaSecurity, client_kwargs
from streams.topic_reader import read_to_end


@dataclass
class ChaosReport:
    scenario: str
    sent: int
    terminal_per_id: dict[str, int] = field(default_factory=dict)
    outcomes: dict[str, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


async def run_scenario(settings: Settings, supervisor: Supervisor, scenario: dict[str, Any],
                       settle_s: float = 3.0, timeout_s: float = 180.0) -> ChaosReport:
    faults = {f["at_request"]: f for f in scenario.get("faults", [])}
    ids: list[str] = []
    async with Client(settings.kafka.bootstrap, settings.kafka.topic_prefix,
                      security=KafkaSecurity.from_settings(settings.kafka)) as client:
        subs = []
        for i in range(scenario["requests"]):
            req = Request(id=new_id(), parts=(Part(Modality.TEXT, text=f"{scenario['name']} request {i}"),),
                          deadline_ms=scenario.get("deadline_ms"))
            subs.append(await client.submit(req))
            ids.append(req.id)
            if i in faults:
                await asyncio.to_thread(_apply, supervisor, faults[i])
            await asyncio.sleep(scenario.get("interval_ms", 20) / 1000.0)
        await asyncio.gather(*(_quiet(s.result(timeout_s)) for s in subs))
    await asyncio.sleep(settle_s)  # a duplicate sent right after the first would land now
    return await check(settings, scenario, ids)


async def _quiet(aw: Any) -> None:
    try:
        await aw
    except asyncio.TimeoutError:
        pass


def _apply(supervisor: Supervisor, fault: dict[str, Any]) -> None:
    sig = getattr(signal, f"SIG{fault['signal']}")
    victims = [w for w in supervisor.workers() if w.stage == fault["stage"] and w.alive]
    if not victims:
        raise RuntimeError(f"no live {fault['stage']} worker to signal")
    supervisor.stop_one(victims[0], 30.0, sig)
    if fault.get("restart", True):
        counts: dict[str, int] = {}
        for w in supervisor.workers():
            counts[w.stage] = counts.get(w.stage, 0) + 1
        counts[fault["stage"]] = counts.get(fault["stage"], 0) + 1
        supervisor.start({fault["stage"]: counts[fault["stage"]]})


async def check(settings: Settings, scenario: dict[str, Any], ids: list[str]) -> ChaosReport:
    topic = f"{settings.kafka.topic_prefix}.results"
    wanted = set(ids)
    report = ChaosReport(scenario["name"], len(ids), {i: 0 for i in ids})
    for record in await read_to_end(settings.kafka.bootstrap, topic, client_kwargs(settings)):
        ev = Event.from_wire(unpack(record.value))
        if ev.terminal and ev.id in wanted:
            report.terminal_per_id[ev.id] += 1
            report.outcomes[str(ev.kind)] = report.outcomes.get(str(ev.kind), 0) + 1
    missing = [i for i, n in report.terminal_per_id.items() if n == 0]
    repeated = [i for i, n in report.terminal_per_id.items() if n > 1]
    if missing:
        report.violations.append(f"{len(missing)} requests got no terminal event (e.g. {missing[0]})")
    if repeated:
        report.violations.append(f"{len(repeated)} requests got more than one terminal event (e.g. {repeated[0]})")
    expected = scenario.get("expect", {}).get("outcome")
    if expected and set(report.outcomes) - {expected}:
        report.violations.append(f"expected every terminal event to be {expected!r}, got {report.outcomes}")
    return report


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m mmstream.chaos SCENARIO.json", file=sys.stderr)
        return 2
    settings = Settings.from_env()
    report = asyncio.run(run_scenario(settings, Supervisor(settings), load(Path(argv[0]))))
    print(json.dumps({"scenario": report.scenario, "sent": report.sent, "outcomes": report.outcomes,
                      "violations": report.violations}, indent=2))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
