"""Worker crashes and restarts mid-run (the scenarios in chaos/scenarios/): every request
still gets exactly one terminal event on the wire."""

from __future__ import annotations

from pathlib import Path

import pytest

from mmstream.chaos import load, run_scenario

pytestmark = pytest.mark.integration

SCENARIOS = Path(__file__).resolve().parents[2] / "chaos" / "scenarios"


@pytest.mark.parametrize("name", ["worker-crashes", "assembler-crash"])
async def test_scenario_keeps_exactly_one_terminal_event_per_request(pipeline, name):
    report = await run_scenario(pipeline.settings, pipeline.supervisor, load(SCENARIOS / f"{name}.json"))
    print(f"\n{name}: sent {report.sent}, outcomes {report.outcomes}")
    assert report.ok, report.violations
