"""The chaos suite's short scenarios (``"ci": true`` in chaos/scenarios/) through the runner,
each on a pipeline of its own: every invariant must hold (exactly one terminal event per
request on the wire, no repeated accepted or token seq, lag drained, state empty, no dead
letters, RSS under the cap). The slow scenarios run from `mmstream chaos run`; their last
results are in docs/reliability.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmstream.chaos import runner
from mmstream.chaos.scenario import load

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = REPO / "chaos" / "scenarios"
CI = sorted(p.stem for p in SCENARIOS.glob("*.json") if json.loads(p.read_text()).get("ci"))


def test_the_ci_scenarios_are_the_kill_zombie_and_colocated_ones() -> None:
    assert CI == ["ci-colocated", "ci-kill", "ci-zombie"]


@pytest.mark.parametrize("name", CI)
async def test_scenario_holds_every_invariant(infra, name, tmp_path) -> None:
    result = await runner.run(infra, load(SCENARIOS / f"{name}.json"), REPO, tmp_path)
    print(f"\n{result.row()}\n{json.dumps(runner.to_json(result), indent=1)}")
    assert result.requests > 0 and result.ok, result.violations
