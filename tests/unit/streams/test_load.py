"""The router's view of the load, from the encoders' reports plus what it sent since."""

from streams.policies.load import LoadView


def report(stage, at, queued, partitions, item_ms):
    return {"stage": stage, "at": at, "queued_ms": queued, "partitions": partitions, "item_ms": item_ms}


def test_wait_is_the_least_loaded_replica_plus_what_was_sent_there_since() -> None:
    view = LoadView()
    view.update_reports({
        "encode.text/a": report("encode.text", 1000.0, 300.0, {"mm.encode.text.rt:0": 300.0}, {"16": 1.0, "256": 20.0}),
        "encode.text/b": report("encode.text", 1000.0, 100.0, {"mm.encode.text.rt:1": 100.0}, {"16": 1.0, "256": 20.0}),
    }, now_ms=1500.0)
    assert view.wait_ms("encode.text") == 100.0
    view.note_sent("mm.encode.text.rt", 1, 250.0, 1200.0)
    assert view.wait_ms("encode.text") == 300.0  # b now holds 350, a 300
    assert view.partition_ms["mm.encode.text.rt"] == {0: 300.0, 1: 350.0}
    assert view.item_ms("encode.text", 200) == 20.0 and view.item_ms("encode.text", 10) == 1.0
    assert view.item_ms("encode.image", 1) is None  # no report: the caller uses the default cost


def test_stale_reports_are_ignored() -> None:
    view = LoadView(stale_ms=3000.0)
    view.update_reports({"encode.image/a": report("encode.image", 0.0, 5000.0, {}, {"1": 8.0})}, now_ms=10_000.0)
    assert view.wait_ms("encode.image") == 0.0 and view.total_ms == 0.0


def test_a_new_report_replaces_what_was_counted_as_sent() -> None:
    view = LoadView()
    view.note_sent("mm.encode.image.rt", 0, 40.0, 50.0)
    assert view.wait_ms("encode.image") == 40.0
    view.update_reports({"encode.image/a": report("encode.image", 300.0, 10.0, {"mm.encode.image.rt:0": 10.0},
                                                  {"1": 8.0})}, now_ms=350.0)
    assert view.wait_ms("encode.image") == 10.0  # sent well before the report: the report holds it
    view.note_sent("mm.encode.image.rt", 0, 40.0, 280.0)  # sent just before: maybe not fetched yet
    assert view.wait_ms("encode.image") == 50.0


def test_rt_waits_only_behind_rt_work_and_the_running_batch() -> None:
    view = LoadView()
    r = report("encode.text", 1000.0, 900.0, {"mm.encode.text.bulk:0": 850.0, "mm.encode.text.rt:0": 20.0}, {"16": 1.0})
    r["queued_rt_ms"] = 50.0
    view.update_reports({"encode.text/a": r}, now_ms=1000.0)
    assert view.wait_ms("encode.text", "rt") == 50.0 and view.wait_ms("encode.text", "bulk") == 900.0
    view.note_sent("mm.encode.text.bulk", 0, 100.0, 1010.0)
    assert view.wait_ms("encode.text", "rt") == 50.0 and view.wait_ms("encode.text", "bulk") == 1000.0


def fair_report(at, running, tenants, rest=(0.0, 0)):
    r = report("encode.text", at, running + sum(tenants.values()) + rest[0], {}, {"16": 1.0})
    r["queued_rt_ms"] = running + sum(tenants.values()) + rest[0]
    r["tenants_rt"], r["rest_rt"] = dict(tenants), list(rest)
    return r


def test_with_fair_order_a_tenant_waits_for_its_own_work_and_a_turn_of_each_other_not_their_backlog() -> None:
    view = LoadView()
    view.update_reports({"encode.text/a": fair_report(1000.0, 20.0, {"abuser": 9000.0, "small": 3.0})}, now_ms=1000.0)
    assert view.wait_ms("encode.text", "rt") == 9023.0  # no tenant named: the whole queue, as before
    assert view.wait_ms("encode.text", "rt", "victim", 5.0) == 20.0 + 5.0 + 3.0  # one turn of the abuser, small's 3
    assert view.wait_ms("encode.text", "rt", "abuser", 5.0) == 20.0 + 9000.0 + 3.0  # behind its own backlog
    view.note_sent("mm.encode.text.rt", -1, 100.0, 1010.0, "victim")  # the router's own, not yet in a report
    assert view.wait_ms("encode.text", "rt", "victim", 5.0) == 20.0 + 100.0 + 105.0 + 3.0
    assert view.queued_ms("rt", "victim", {"encode.text": 5.0}) == {"encode.text": 228.0}
    assert view.wait_ms("encode.text", "bulk", "victim", 5.0) == 9123.0  # bulk waits behind every rt


def test_tenants_past_the_reported_ones_count_one_turn_each() -> None:
    from streams.policies.load import MAX_REPORTED_TENANTS, fair_wait_ms, tenant_shares

    queued = {f"t{i}": float(i + 1) for i in range(MAX_REPORTED_TENANTS + 8)}
    shares = tenant_shares(queued)
    assert len(shares["tenants_rt"]) == MAX_REPORTED_TENANTS and shares["rest_rt"] == [sum(range(1, 9)), 8]
    exact = fair_wait_ms(0.0, queued, (0.0, 0), "new", 2.0)
    approx = fair_wait_ms(0.0, shares["tenants_rt"], tuple(shares["rest_rt"]), "new", 2.0)
    assert approx >= exact  # never under what fair order gives


def test_what_was_sent_to_a_partition_counts_for_the_replica_reading_it_even_with_nothing_queued_from_it() -> None:
    view = LoadView()
    a = report("encode.text", 1000.0, 0.0, {}, {"16": 1.0})
    a["assigned"] = ["mm.encode.text.rt:0", "mm.encode.text.rt:1"]
    b = report("encode.text", 1000.0, 50.0, {"mm.encode.text.rt:2": 50.0}, {"16": 1.0})
    b["assigned"] = ["mm.encode.text.rt:2", "mm.encode.text.rt:3"]
    view.update_reports({"encode.text/a": a, "encode.text/b": b}, now_ms=1000.0)
    view.note_sent("mm.encode.text.rt", 0, 400.0, 1010.0)
    assert view.wait_ms("encode.text", "rt") == 50.0  # b is now the least loaded: a holds the 400 sent to it
    view.note_sent("mm.encode.text.rt", 3, 400.0, 1010.0)
    assert view.wait_ms("encode.text", "rt") == 400.0


def test_queued_ms_for_the_stages_a_request_needs_is_the_whole_maps_values_there() -> None:
    view = LoadView()
    view.update_reports({
        "encode.text/a": report("encode.text", 1000.0, 30.0, {"mm.encode.text.rt:0": 30.0}, {"16": 1.0}),
        "encode.image/a": report("encode.image", 1000.0, 70.0, {"mm.encode.image.rt:0": 70.0}, {"1": 8.0}),
    }, now_ms=1000.0)
    view.note_sent("mm.encode.text.rt", 0, 5.0, 1001.0)
    view.note_sent("mm.encode.audio.bulk", None, 40.0, 1002.0)  # a stage with no report yet
    whole = view.queued_ms("bulk")
    assert whole == {"encode.text": 35.0, "encode.image": 70.0, "encode.audio": 40.0}
    for stages in (["encode.text"], ["encode.image", "encode.audio"], ["encode.video"]):
        assert view.queued_ms("bulk", only=stages) == {s: whole.get(s, 0.0) for s in stages}


def test_a_wait_is_calibrated_by_the_latest_scale_its_stages_replicas_report() -> None:
    from streams.policies.load import MAX_WAIT_SCALE, WAIT_FLOOR_MS

    view = LoadView()
    assert view.calibrated("encode.image", 200.0) == 200.0  # no report: as predicted
    late = {**report("encode.image", 1000.0, 200.0, {}, {"1": 8.0}), "wait_scale": 2.0}
    on_time = report("encode.image", 1000.0, 50.0, {}, {"1": 8.0})  # an older replica: no scale reported
    view.update_reports({"encode.image/a": late, "encode.image/b": on_time,
                         "encode.text/a": report("encode.text", 1000.0, 200.0, {}, {"16": 1.0})}, now_ms=1100.0)
    # The largest reported scale: the least-loaded choice may send the part to the late replica.
    assert view.calibrated("encode.image", 200.0) == (200.0 + WAIT_FLOOR_MS) * 2.0 - WAIT_FLOOR_MS
    assert view.calibrated("encode.text", 200.0) == 200.0  # another stage's scale is not this one's
    wild = {**report("encode.image", 1000.0, 0.0, {}, {"1": 8.0}), "wait_scale": 1e9}
    view.update_reports({"encode.image/a": wild}, now_ms=1100.0)
    assert view.calibrated("encode.image", 100.0) == (100.0 + WAIT_FLOOR_MS) * MAX_WAIT_SCALE - WAIT_FLOOR_MS
    view.update_reports({"encode.image/a": late}, now_ms=10_000.0)  # stale: forgotten with its report
    assert view.calibrated("encode.image", 200.0) == 200.0
    nan = {**report("encode.image", 10_000.0, 900.0, {}, {"1": 8.0}), "wait_scale": float("nan")}
    view.update_reports({"encode.image/a": nan}, now_ms=10_000.0)  # refused whole, not read as the least scale
    assert view.calibrated("encode.image", 200.0) == 200.0 and view.wait_ms("encode.image") == 0.0


def test_a_report_counts_as_worked_down_since_it_was_made_and_what_was_sent_since_counts_whole() -> None:
    view = LoadView()
    r = report("encode.audio", 1000.0, 300.0, {}, {"1": 300.0})  # one clip running when it was made
    r["queued_rt_ms"] = 300.0
    view.update_reports({"encode.audio/a": r}, now_ms=1100.0)
    assert view.wait_ms("encode.audio", "rt") == 300.0  # without a clock: the report as made
    assert view.wait_ms("encode.audio", "rt", now_ms=1100.0) == 200.0
    assert view.wait_ms("encode.audio", "rt", now_ms=1400.0) == 0.0  # done since: no phantom clip ahead
    view.note_sent("mm.encode.audio.rt", None, 300.0, 1350.0)  # the next clip, after the report
    assert view.wait_ms("encode.audio", "rt", now_ms=1400.0) == 300.0  # the drain never takes what it sent
    assert view.queued_ms("rt", only=["encode.audio"], now_ms=1400.0) == {"encode.audio": 300.0}


def test_what_is_left_of_a_report_is_what_the_calibration_scales() -> None:
    view = LoadView()
    r = report("encode.audio", 1000.0, 300.0, {}, {"1": 300.0})
    r["queued_rt_ms"], r["wait_scale"] = 300.0, 2.0
    view.update_reports({"encode.audio/a": r}, now_ms=1000.0)
    left = view.wait_ms("encode.audio", "rt", now_ms=1200.0)
    assert left == 100.0 and view.calibrated("encode.audio", left) == 250.0  # (100 + 50) * 2 - 50


def test_with_fair_order_the_drain_comes_off_the_running_batch_not_the_tenants_queues() -> None:
    view = LoadView()
    view.update_reports({"encode.text/a": fair_report(1000.0, 40.0, {"abuser": 900.0})}, now_ms=1000.0)
    assert view.wait_ms("encode.text", "rt", "victim", 5.0, now_ms=1030.0) == 10.0 + 5.0
    assert view.wait_ms("encode.text", "rt", "victim", 5.0, now_ms=1500.0) == 5.0  # never below its queue
    assert view.wait_ms("encode.text", "rt", "abuser", 5.0, now_ms=1500.0) == 900.0
