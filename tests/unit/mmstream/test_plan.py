"""`mmstream plan` from a run's measured cost: cores, replicas, partitions, capacity, warnings."""

import json
from pathlib import Path

import pytest

from mmstream.plan import load_run, make_plan, stage_costs

RUN = {"config": {"rate": 60.0}, "achieved_rate": 60.0, "requests": {"ok": 1000},
       "cpu": {"per_process_s": {"router[0]": 7.0, "encode.image[0]": 3.0, "encode.image[1]": 1.0, "broker": 4.0,
                                 "assembler[0]": 2.0, "redis": 0.3, "encode.audio[0]": 0.2}}}


def test_costs_are_cpu_ms_per_answered_request_summed_over_replicas():
    costs, rate = stage_costs(RUN)
    assert rate == 60.0
    assert costs == pytest.approx({"router": 7.0, "encode.image": 4.0, "broker": 4.0, "assembler": 2.0, "redis": 0.3,
                                   "encode.audio": 0.2})
    with pytest.raises(ValueError):
        stage_costs({**RUN, "requests": {"ok": 0}})


def test_a_plan_sizes_each_stage_and_states_the_capacity_of_the_cores():
    costs, rate = stage_costs(RUN)  # 17.5 ms per request in all
    p = make_plan(costs, rate, 60.0, machines=1, cores=2, target_util=0.7, partitions=4)
    by = {s.stage: s for s in p.stages}
    assert by["router"].cores == pytest.approx(0.42) and by["router"].replicas == 1
    assert by["encode.audio"].replicas == 1 and by["broker"].replicas == 1
    assert p.utilisation == pytest.approx(60 * 17.5 / 1000 / 2, abs=1e-3)
    assert p.capacity_at_full == pytest.approx(2000 / 17.5, abs=0.1)
    assert p.capacity_at_target == pytest.approx(0.7 * 2000 / 17.5, abs=0.1)
    assert p.partitions == 4 and p.warnings == []
    big = make_plan(costs, rate, 120.0, machines=2, cores=8, threads={"encode.image": 1}, partitions=4)
    by = {s.stage: s for s in big.stages}
    assert by["router"].replicas == 2 and by["encode.image"].replicas == 1  # 0.84 cores and 0.48 at 0.7
    assert any("more than one machine" in w for w in big.warnings)
    far = make_plan(costs, rate, 500.0, cores=2)
    assert any("far from the measured" in w for w in far.warnings) and far.utilisation > 1
    assert max(s.replicas for s in far.stages if s.stage not in ("broker", "redis")) == far.partitions


def test_a_sweep_gives_its_run_at_the_rate_asked_or_its_highest(tmp_path: Path):
    f = tmp_path / "sweep.json"
    f.write_text(json.dumps({"runs": [{**RUN, "config": {"rate": r}} for r in (10.0, 60.0, 90.0)]}))
    assert load_run(f)["config"]["rate"] == 90.0 and load_run(f, 10.0)["config"]["rate"] == 10.0
    with pytest.raises(ValueError, match="no run at 35"):
        load_run(f, 35.0)
