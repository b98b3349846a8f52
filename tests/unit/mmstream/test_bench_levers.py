import subprocess
import sys

import pytest

from mmstream.bench import BenchConfig, parse_lanes, schedule
from mmstream.bench.workloads import run_tenants
from mmstream.lever_names import LEVERS
from mmstream.levers import lever_env, replicas
from schemas.settings import Settings


def test_lanes_and_repeats_follow_the_asked_shares_and_the_seed():
    cfg = BenchConfig(rate=200, duration_s=10, lanes=parse_lanes("rt=0.2,bulk=0.8"), repeat=0.3)
    _, reqs = schedule(cfg, 200)
    rt = sum(r.lane == "rt" for r in reqs) / len(reqs)
    assert 0.15 < rt < 0.25
    texts = [r.parts[0].text for r in reqs]
    repeated = sum(t in texts[:i] for i, t in enumerate(texts)) / len(reqs)
    assert 0.25 < repeated < 0.4
    _, again = schedule(cfg, 200)
    assert [(r.lane, r.parts) for r in again] == [(r.lane, r.parts) for r in reqs]


def test_the_shape_of_traffic_does_not_change_its_content_or_timing():
    base = BenchConfig(rate=50, duration_s=5)
    shaped = BenchConfig(rate=50, duration_s=5, lanes=parse_lanes("rt=0.5,bulk=0.5"))
    (t1, a), (t2, b) = schedule(base, 50), schedule(shaped, 50)
    assert t1 == t2 and [r.parts for r in a] == [r.parts for r in b]


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError):
        BenchConfig(lanes=(("rt", 0.5), ("bulk", 0.6)))
    with pytest.raises(ValueError):
        BenchConfig(repeat=1.0)
    with pytest.raises(ValueError):
        parse_lanes("rt:1")


def test_levers_map_to_settings_and_stages():
    env = lever_env(("cache", "routing"), "p1")
    assert env["MMSTREAM_CACHE_ENABLED"] == "false" and env["MMSTREAM_ROUTER_MODALITY_TOPICS"] == "false"
    assert env["MMSTREAM_KAFKA_TOPIC_PREFIX"] == "p1"
    assert "encode.any" in replicas(("routing",), "mixed") and "encode.text" not in replicas(("routing",), "mixed")
    assert {"encode.text", "encode.image", "encode.video", "encode.audio"} <= set(replicas((), "mixed"))
    with pytest.raises(ValueError):
        lever_env(("gravity",), "p")


def test_every_lever_switches_real_settings_off():
    for lever in LEVERS:
        Settings.from_env(lever_env((lever,), "p"))  # every env a lever writes is a valid setting
    fifo = Settings.from_env(lever_env(("grouping",), "p"))
    assert fifo.encoder.grouping == "fifo" and Settings.from_env({}).encoder.grouping == "length"
    apart = Settings.from_env(lever_env(("placement",), "p"))
    assert apart.router.colocate == "" and Settings.from_env({}).router.colocate == "text,image"


def test_chat_workload_is_generate_requests_with_a_scheduler_switch():
    cfg = BenchConfig(workload="chat", rate=20, duration_s=5, scheduler="static")
    _, reqs = schedule(cfg, 20)
    assert reqs and all(r.task == "generate" and r.params.max_tokens == 32 for r in reqs)
    assert replicas((), "chat")["generate"] == 1
    assert BenchConfig(workload="chat", mode="monolithic").mode == "monolithic"
    with pytest.raises(ValueError):
        BenchConfig(workload="chat", scheduler="eager")


def test_each_run_of_a_seed_gets_fresh_tenants_so_no_run_reads_anothers_cache():
    cfg = BenchConfig(workload="capacity", rate=20, duration_s=2, seed=7)
    _, reqs = schedule(cfg, 20)
    first, second = run_tenants(reqs, "bench-a", "s1"), run_tenants(reqs, "bench-a", "s2")
    assert [r.parts for r in first] == [r.parts for r in second]  # the seed's traffic
    assert not {r.tenant for r in first} & {r.tenant for r in second}  # nothing shared between the runs
    assert len({r.tenant for r in first}) == len(first)  # still a tenant per request
    shared = run_tenants(schedule(BenchConfig(rate=20, duration_s=2), 20)[1], "bench-a", "s1")
    assert {r.tenant for r in shared} == {"bench-a"}


@pytest.mark.parametrize("module", ["mmstream.levers", "mmstream.bench", "mmstream.cli"])
def test_each_module_imports_first_in_a_fresh_interpreter(module):
    done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
