"""The scaling policy alone: windows, wake, idle, cores and bounds, on a clock the test turns."""

import dataclasses

import pytest

from schemas.settings import Settings, SettingsError
from schemas.settings_autoscale import parse_pools
from streams.policies.autoscale import CpuReading, Decision, PoolRule, PoolSignal, ScalePolicy, demand

LAG = {"rt": 50, "bulk": 200}


def policy(cores: int = 8, **rules: PoolRule) -> ScalePolicy:
    return ScalePolicy(rules or {"encode.text": PoolRule(1, 4, LAG, 250.0)}, up_window_s=2.0, down_window_s=10.0,
                       idle_s=5.0, cpu_cores=cores)


def run(p: ScalePolicy, t0: float, t1: float, *sigs: PoolSignal) -> list[tuple[float, Decision]]:
    """Decide once a second over [t0, t1], with the same signals each time (replicas as given)."""
    out, t = [], t0
    while t <= t1:
        out += [(t, d) for d in p.decide(t, sigs)]
        t += 1.0
    return out


def test_demand_is_the_larger_of_lag_and_queued_work_per_replica():
    rule = PoolRule(1, 8, LAG, 250.0)
    assert demand(rule, PoolSignal("s", 1)) == (0, "lag")
    assert demand(rule, PoolSignal("s", 1, {"rt": 1})) == (1, "lag")
    assert demand(rule, PoolSignal("s", 1, {"rt": 101, "bulk": 10})) == (3, "lag")
    assert demand(rule, PoolSignal("s", 1, {"bulk": 200}, queued_ms=600)) == (3, "queued")


def test_a_long_batch_in_service_counts_one_replica_and_what_waits_behind_it_counts_whole():
    rule = PoolRule(0, 8, LAG, 250.0)
    one_clip = PoolSignal("encode.audio", 1, queued_ms=850.0, running_ms=(850.0,))
    assert demand(rule, one_clip) == (1, "queued")  # a second replica would take nothing from it
    behind = PoolSignal("encode.audio", 1, queued_ms=1700.0, running_ms=(850.0,))
    assert demand(rule, behind) == (5, "queued")  # 250 + 850 waiting: the waiting clip starts at once elsewhere
    two_busy = PoolSignal("encode.audio", 2, queued_ms=1700.0, running_ms=(850.0, 850.0))
    assert demand(rule, two_busy) == (2, "queued")
    short = PoolSignal("encode.text", 1, queued_ms=600.0, running_ms=(20.0,))
    assert demand(rule, short) == (3, "queued")  # short batches: as if counted whole
    assert demand(rule, PoolSignal("encode.text", 1, queued_ms=600.0)) == (3, "queued")  # no running_ms reported
    # never more replicas than jobs: one clip being prepared (not yet in service) is one job
    assert demand(rule, PoolSignal("encode.audio", 1, queued_ms=850.0, items=1)) == (1, "queued")
    assert demand(rule, dataclasses.replace(behind, items=2)) == (2, "queued")
    assert demand(rule, dataclasses.replace(short, items=40)) == (3, "queued")


def test_a_burst_shorter_than_the_up_window_costs_no_replica():
    p = policy()
    hot = PoolSignal("encode.text", 1, {"rt": 150})
    assert run(p, 0, 3, PoolSignal("encode.text", 1)) == []
    assert run(p, 4, 4, hot) == [] and run(p, 5, 5, hot) == []  # 2 reads over target, window not yet whole
    got = run(p, 6, 6, hot)
    assert [(d.current, d.target, d.reason) for _, d in got] == [(1, 3, "lag")]


def test_up_goes_to_the_least_the_window_asked_for_and_stops_at_max():
    p = policy()
    run(p, 0, 2, PoolSignal("encode.text", 1))
    p.decide(3, [PoolSignal("encode.text", 1, {"rt": 100})])  # wants 2
    p.decide(4, [PoolSignal("encode.text", 1, {"rt": 900})])  # wants 4 (max)
    (d,) = p.decide(5, [PoolSignal("encode.text", 1, {"rt": 900})])
    assert (d.target, d.held) == (2, False)
    (d,) = p.decide(6, [PoolSignal("encode.text", 4, {"rt": 900})])
    assert (d.target, d.reason, d.held) == (4, "max", True)


def test_down_waits_for_a_calm_window_and_the_cooldown_then_goes_to_the_most_asked():
    p = policy()
    p.decide(0, [PoolSignal("encode.text", 3, {"rt": 150})])
    p.changed("encode.text", 0)
    assert run(p, 1, 9, PoolSignal("encode.text", 3, {"rt": 60})) == []  # wants 2, cooldown 10 s
    got = run(p, 10, 12, PoolSignal("encode.text", 3, {"rt": 60}))
    assert [(t, d.target, d.reason) for t, d in got] == [(11, 2, "calm")]  # the read at 0 wanted 3


def test_an_idle_pool_with_min_zero_keeps_one_replica_for_idle_s_then_stops():
    p = policy(**{"generate": PoolRule(0, 2, {"rt": 8}, 250.0)})
    got = run(p, 0, 10, PoolSignal("generate", 1))
    assert [(t, d.target, d.reason) for t, d in got][0] == (5, 0, "idle")


def test_a_pool_at_zero_wakes_on_its_first_record_without_waiting_for_a_window():
    p = policy(**{"generate": PoolRule(0, 2, {"rt": 8}, 250.0)})
    assert p.decide(0, [PoolSignal("generate", 0)]) == []
    (d,) = p.decide(1, [PoolSignal("generate", 0, {"rt": 1})])
    assert (d.current, d.target, d.reason) == (0, 1, "wake")
    # work keeps it: never back to zero while anything is queued
    assert run(p, 2, 30, PoolSignal("generate", 1, queued_ms=10.0)) == []


def test_bounds_are_restored_whatever_the_signal():
    p = policy()
    (d,) = p.decide(0, [PoolSignal("encode.text", 0)])
    assert (d.target, d.reason) == (1, "min")
    (d,) = p.decide(1, [PoolSignal("encode.text", 6)])
    assert (d.target, d.reason) == (4, "max")


def test_a_replica_that_would_only_fight_for_busy_cores_is_held():
    rules = {"encode.text": PoolRule(1, 4, LAG, 250.0), "encode.image": PoolRule(1, 4, LAG, 250.0, threads=1)}
    p = policy(cores=2, **rules)
    busy_image = PoolSignal("encode.image", 1, {"rt": 10})
    got = run(p, 0, 4, PoolSignal("encode.text", 1, {"rt": 500}), busy_image)
    assert got and all(d.held and d.reason == "cpu" and d.stage == "encode.text" for _, d in got)
    # the image pool idle: its replica needs no core, so text may take the second one (and no more)
    got = run(p, 5, 5, PoolSignal("encode.text", 1, {"rt": 500}), PoolSignal("encode.image", 1))
    assert [(d.stage, d.target, d.held) for _, d in got] == [("encode.text", 2, False)]


def cpu(idle: float, **used: float) -> CpuReading:
    return CpuReading(idle, {k.replace("_", "."): v for k, v in used.items()})


def test_with_cpu_measured_a_replica_starts_where_half_its_cores_are_idle_and_the_pool_uses_its_own():
    rules = {"encode.audio": PoolRule(0, 4, LAG, 250.0), "encode.text": PoolRule(1, 4, LAG, 250.0)}
    p = policy(cores=2, **rules)
    hot = PoolSignal("encode.audio", 1, queued_ms=1700.0, running_ms=(850.0,))
    busy_router = PoolSignal("encode.text", 1, {"rt": 10})  # by threads alone: no core left for audio
    got = [d for t in range(0, 3) for d in p.decide(t, [hot, busy_router], cpu(0.8, encode_audio=0.95))]
    assert [(d.stage, d.current, d.target, d.held) for d in got] == [("encode.audio", 1, 2, False)]
    p = policy(cores=2, **rules)
    got = [d for t in range(0, 4) for d in p.decide(t, [hot, busy_router], cpu(0.4, encode_audio=0.95))]
    assert got and all(d.held and d.reason == "cpu" for d in got)
    # the mean over the up window: one idle reading among busy ones does not make room
    p = policy(cores=2, **rules)
    got = [d for t, idle in enumerate((0.1, 0.1, 1.0)) for d in p.decide(t, [hot], cpu(idle, encode_audio=0.95))]
    assert got and all(d.held for d in got)


def test_a_pool_that_does_not_use_its_cores_gets_no_more_replicas_even_with_cores_idle():
    # two replicas, one of them still joining (a rebalance): the work waits on the group, not on cores
    p = policy(cores=4, **{"encode.audio": PoolRule(0, 4, LAG, 250.0)})
    hot = PoolSignal("encode.audio", 2, {"bulk": 900}, queued_ms=3000.0)
    got = [d for t in range(0, 4) for d in p.decide(t, [hot], cpu(2.5, encode_audio=0.9))]
    assert got and all(d.held and d.reason == "cpu" for d in got)
    p = policy(cores=4, **{"encode.audio": PoolRule(0, 4, LAG, 250.0)})
    got = [d for t in range(0, 3) for d in p.decide(t, [hot], cpu(2.5, encode_audio=1.9))]
    assert [(d.current, d.target, d.held) for d in got] == [(2, 4, False)]


def test_cores_given_to_one_pool_are_gone_for_the_next_in_the_same_call():
    rules = {"encode.audio": PoolRule(0, 4, LAG, 250.0), "encode.image": PoolRule(1, 4, LAG, 250.0)}
    p = policy(cores=4, **rules)
    hot = [PoolSignal("encode.audio", 1, queued_ms=2000.0), PoolSignal("encode.image", 1, queued_ms=2000.0)]
    got = [d for t in range(0, 3) for d in p.decide(t, hot, cpu(1.0, encode_audio=1.0, encode_image=1.0))]
    assert [(d.stage, d.target, d.held) for d in got if not d.held] == [("encode.audio", 2, False)]
    assert any(d.stage == "encode.image" and d.held and d.reason == "cpu" for d in got)


def test_waking_is_never_held_for_cores():
    p = policy(cores=1, **{"encode.text": PoolRule(1, 4, LAG, 250.0), "encode.audio": PoolRule(0, 2, LAG, 250.0)})
    got = p.decide(0, [PoolSignal("encode.text", 1, {"rt": 500}), PoolSignal("encode.audio", 0, {"rt": 1})])
    assert [(d.stage, d.target, d.reason) for d in got] == [("encode.audio", 1, "wake")]


def test_pools_parse_and_refuse_what_is_not_min_max():
    assert parse_pools("encode.text=1:8, generate=0:2") == {"encode.text": (1, 8), "generate": (0, 2)}
    for bad in ("encode.text=2:1", "encode.text=0:0", "encode.text=1", "=1:2", "x=a:2"):
        with pytest.raises(ValueError):
            parse_pools(bad)
    with pytest.raises(SettingsError, match="MMSTREAM_AUTOSCALE_POOLS"):
        Settings.from_env({"MMSTREAM_AUTOSCALE_POOLS": "encode.text=3:1"})
