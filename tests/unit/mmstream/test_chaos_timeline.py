"""The chaos timeline: faults, requests and worker/broker log lines on one clock."""

import json
import time
from pathlib import Path

from mmstream.chaos import timeline


def _stamp(wall: float, broker: bool = False) -> str:
    base = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(int(wall)))
    ms = f"{int(round((wall - int(wall)) * 1000)):03d}"
    return f"[{base},{ms}]" if broker else f"{base},{ms}"


def test_breakdown_puts_log_events_and_requests_on_the_fault_clock(tmp_path: Path) -> None:
    t0 = float(int(time.time()) - 100)
    begin, end = t0 + 10, t0 + 13
    (tmp_path / "faults.json").write_text(json.dumps([{"fault": "kill assembler @10s", "begin": begin, "end": end}]))
    requests = [
        {"id": "a", "kind": "text", "lane": "rt", "outcome": "result", "sent": t0 + 1, "answered": t0 + 1.2},
        {"id": "b", "kind": "text", "lane": "rt", "outcome": "result", "sent": t0 + 2, "answered": t0 + 2.1},
        {"id": "c", "kind": "text", "lane": "rt", "outcome": "result", "sent": begin + 1, "answered": begin + 4.5},
        {"id": "d", "kind": "text", "lane": "rt", "outcome": "result", "sent": begin + 5, "answered": begin + 5.1},
        {"id": "e", "kind": "text", "lane": "rt", "outcome": None, "sent": None, "answered": None},
    ]
    (tmp_path / "requests.json").write_text(json.dumps(requests))
    logs = tmp_path / "state" / "workers" / "chaosx"
    logs.mkdir(parents=True)
    (logs / "assembler-1.log").write_text("\n".join([
        f"{_stamp(begin + 3.2)} INFO aiokafka.consumer.group_coordinator: Revoking previously assigned partitions",
        f"{_stamp(begin + 3.5)} INFO aiokafka.consumer.group_coordinator: Setting newly assigned partitions {{}}",
        f"{_stamp(begin + 3.9)} INFO streams.runtime.recovery: p.assembler.done: 3 requests to replay, 0 with events",
        "a line without a stamp",
    ]))
    broker = tmp_path / "kafka-1"
    broker.mkdir()
    (broker / "broker.log").write_text(f"{_stamp(begin + 2, broker=True)} INFO [KafkaRaftServer nodeId=1] "
                                       "Kafka Server started (kafka.server.KafkaRaftServer)\n")

    [part] = timeline.breakdown(tmp_path)

    assert part["stalled"] == {"requests": 1, "max_wait_s": 3.5, "unanswered": 0}
    assert part["first_answer_after_s"] == 4.5
    assert list(part["events"]) == ["broker started", "revoking", "assigned", "replay"]
    assert part["events"]["assigned"]["at_s"] == 3.5 and part["events"]["assigned"]["worker"] == "assembler-1"
    assert part["normal_p99_s"] == 0.2
    assert part["back_to_normal_s"] == 1.0  # c (sent at +1) waited past 2x normal; d did not
