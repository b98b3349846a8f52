import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.errors import ErrorCode, WireError
from schemas.jobs import DeadlineTick, EncodedPart, Manifest
from schemas.tensor import to_wire
from streams.policies.assembly import AssemblyPolicy, due_at, step
from streams.policies.lifecycle import RequestStatus

POLICY = AssemblyPolicy(retention_ms=1000.0, orphan_ttl_ms=5000.0)


def manifest(n=2, deadline=100.0):
    return Manifest(id="r", task="embed", tenant="t", lane="rt", reply_to="mm.results", n_parts=n,
                    modalities=["text"] * n, deadline_at_ms=deadline, accepted_at_ms=1.0, client_sent_at_ms=0.0,
                    sent_at_ms=1.0, trace=[["route", 0.0, 0.5, 1.0]])


def part(i, ok=True):
    if ok:
        return EncodedPart(id="r", part=i, modality="text", sent_at_ms=5.0 + i, embedding=to_wire(np.ones(4)),
                           trace=[["encode.text", 1.0, 2.0, 4.0 + i]])
    return EncodedPart(id="r", part=i, modality="text", sent_at_ms=5.0,
                       error=WireError(ErrorCode.UNSUPPORTED_MEDIA, "nope").to_wire())


def run(msgs, now=10.0):
    state, events = None, []
    for m in msgs:
        r = step(state, m, now, POLICY)
        state = r.state
        if r.emit:
            events.append(r.emit)
    return state, events


def test_completes_when_all_parts_are_in_with_timings():
    state, events = run([manifest(), part(1), part(0)])
    assert len(events) == 1
    ev = events[0]
    assert ev.kind == "result" and not ev.payload["partial"]
    assert [p["index"] for p in ev.payload["parts"]] == [0, 1]
    stages = [s["stage"] for s in ev.timings["stages"]]
    assert stages == ["route", "encode.text", "assemble"]
    assert ev.timings["e2e_ms"] == 10.0
    assert state.status == RequestStatus.FINISHED


def test_parts_before_manifest_and_duplicates_change_nothing():
    _, events = run([part(0), part(0), manifest(), manifest(), part(1), part(1), manifest()])
    assert len(events) == 1


def test_partial_result_names_the_failed_part():
    _, events = run([manifest(), part(0), part(1, ok=False)])
    ev = events[0]
    assert ev.kind == "result" and ev.payload["partial"]
    assert ev.payload["parts"][1]["error"]["code"] == "unsupported_media"


def test_all_parts_failed_is_an_error_event_with_the_parts_code():
    _, events = run([manifest(n=1), part(0, ok=False)])
    assert events[0].kind == "error" and events[0].error["code"] == "unsupported_media"


def test_a_request_whose_parts_were_all_refused_overloaded_keeps_the_longest_retry_after():
    def refused(i, wait):
        return EncodedPart(id="r", part=i, modality="text", sent_at_ms=5.0,
                           error=WireError(ErrorCode.OVERLOADED, "busy", None, wait).to_wire())

    _, events = run([manifest(n=2), refused(0, 350), refused(1, 900)])
    assert events[0].kind == "error" and events[0].error["code"] == "overloaded"
    assert events[0].error["retry_after_ms"] == 900
    _, mixed = run([manifest(n=2), refused(0, 350), part(1, ok=False)])  # codes differ: the policy's own
    assert mixed[0].error["code"] == "invalid_request" and mixed[0].error["retry_after_ms"] is None


def test_deadline_completes_with_what_is_there():
    state, _ = run([manifest(deadline=50.0), part(0)], now=10.0)
    assert step(state, DeadlineTick("r"), 49.0, POLICY).emit is None
    r = step(state, DeadlineTick("r"), 50.0, POLICY)
    assert r.emit.kind == "result" and r.emit.payload["partial"]
    assert r.emit.payload["parts"][1]["error"]["code"] == "deadline_exceeded"


def test_deadline_with_no_part_is_deadline_exceeded():
    state, _ = run([manifest(deadline=50.0)])
    r = step(state, DeadlineTick("r"), 60.0, POLICY)
    assert r.emit.kind == "error" and r.emit.error["code"] == "deadline_exceeded"
    assert r.state.status == RequestStatus.DEADLINE_EXCEEDED


def test_tombstone_absorbs_late_duplicates_then_expires():
    state, _ = run([manifest(n=1), part(0)], now=10.0)
    assert state.done and due_at(state, POLICY) == 1010.0
    assert step(state, manifest(n=1), 20.0, POLICY).emit is None
    assert step(state, DeadlineTick("r"), 500.0, POLICY).state is state
    assert step(state, DeadlineTick("r"), 1010.0, POLICY).state is None


def test_orphan_parts_expire():
    state, _ = run([part(0)], now=10.0)
    assert step(state, DeadlineTick("r"), 10.0 + 4999, POLICY).state is not None
    assert step(state, DeadlineTick("r"), 10.0 + 5000, POLICY).state is None


def test_out_of_range_part_index_is_ignored():
    _, events = run([manifest(n=1), part(5), part(0)])
    assert len(events) == 1 and len(events[0].payload["parts"]) == 1


msg_strategy = st.lists(st.sampled_from(["m", "p0", "p1", "p2", "tick"]), min_size=1, max_size=30)


@settings(max_examples=300)
@given(msgs=msg_strategy, tick_times=st.lists(st.floats(0, 300), min_size=30, max_size=30))
def test_at_most_one_terminal_event_and_exactly_one_once_complete(msgs, tick_times):
    """Any order, any duplication, any tick timing: never two terminal events; and once the
    manifest and every part are in (or the deadline passed), exactly one."""
    state, emitted, now = None, 0, 0.0
    for i, m in enumerate(msgs):
        now = max(now, tick_times[i])
        msg = {"m": manifest(n=3, deadline=200.0), "tick": DeadlineTick("r")}.get(m) or part(int(m[1]))
        r = step(state, msg, now, AssemblyPolicy(retention_ms=1e9, orphan_ttl_ms=1e9))
        state = r.state
        emitted += r.emit is not None
    assert emitted <= 1
    complete = "m" in msgs and ({"p0", "p1", "p2"} <= set(msgs))
    if complete:
        assert emitted == 1


def video_msgs(n_chunks=3):
    m = Manifest(id="r", task="embed", tenant="t", lane="rt", reply_to="mm.results", n_parts=1,
                 modalities=["video"], deadline_at_ms=100.0, accepted_at_ms=1.0, client_sent_at_ms=0.0, sent_at_ms=1.0)
    header = EncodedPart(id="r", part=0, modality="video", sent_at_ms=2.0, n_chunks=n_chunks,
                         extras={"duration_s": 3.0}, trace=[["encode.video", 1.0, 1.5, 2.0]])
    rng = np.random.default_rng(1)
    frames = [rng.normal(size=(2, 8)) for _ in range(n_chunks)]
    frames = [f / np.linalg.norm(f, axis=1, keepdims=True) for f in frames]
    chunks = [EncodedPart(id="r", part=0, modality="image", sent_at_ms=5.0 + k, chunk=k,
                          embedding=to_wire(frames[k].sum(axis=0), "float32"),
                          extras={"frames": 2, "labels": [f"l{k}a", f"l{k}b"]}, trace=[["encode.image", 2.0, 3.0, 4.0 + k]])
              for k in range(n_chunks)]
    expected = np.concatenate(frames).mean(axis=0)
    return m, header, chunks, expected / np.linalg.norm(expected)


def test_video_chunks_pool_into_one_part_whatever_the_order():
    from schemas.tensor import from_wire

    m, header, chunks, expected = video_msgs()
    for order in ([m, header, *chunks], [*reversed(chunks), chunks[0], m, header], [chunks[1], header, m, chunks[2], chunks[0]]):
        _, events = run(order)
        assert len(events) == 1, order
        part = events[0].payload["parts"][0]
        got = from_wire(part["embedding"]).astype(np.float32)
        assert float(got @ expected) > 0.999
        assert part["extras"]["frames_encoded"] == 6 and part["extras"]["complete"]
        assert part["extras"]["frame_labels"] == ["l0a", "l0b", "l1a", "l1b", "l2a", "l2b"]
        assert part["extras"]["duration_s"] == 3.0


def test_video_at_deadline_pools_the_chunks_it_has():
    m, header, chunks, _ = video_msgs()
    state, events = run([m, header, chunks[0]])
    assert not events
    r = step(state, DeadlineTick("r"), 100.0, POLICY)
    part = r.emit.payload["parts"][0]
    assert r.emit.kind == "result" and part["embedding"] is not None
    assert part["extras"]["frames_encoded"] == 2 and part["extras"]["complete"] is False


# -- trust: nonces and reused ids ------------------------------------------------------------


def signed(msg, nonce="n1", digest=None):
    """``msg`` as the pipeline makes it: the request's nonce (and the manifest's digest)."""
    from dataclasses import replace

    if isinstance(msg, Manifest):
        return replace(msg, nonce=nonce, digest=digest or "d1")
    return replace(msg, nonce=nonce, tenant="t")


def test_a_part_without_the_manifests_nonce_never_counts():
    forged = part(0)  # no nonce: produced by someone outside the pipeline
    _, events = run([signed(manifest(n=1)), forged])
    assert events == []
    _, events = run([signed(manifest(n=1)), signed(part(0), nonce="guess"), signed(part(0))])
    assert len(events) == 1 and events[0].payload["parts"][0]["embedding"] is not None


def test_a_forged_part_before_the_manifest_is_dropped_when_it_comes():
    forged = EncodedPart(id="r", part=0, modality="text", sent_at_ms=1.0, embedding=to_wire(np.full(4, 9.0)),
                         tenant="t")
    state, events = run([forged, signed(manifest(n=1))])
    assert events == [] and state.parts == {}
    _, events = run([forged, signed(manifest(n=1)), signed(part(0))])
    assert len(events) == 1
    assert events[0].payload["parts"][0]["embedding"] == to_wire(np.ones(4))  # the real one, not the forgery


def test_a_real_part_that_overtakes_its_manifest_still_counts():
    _, events = run([signed(part(1)), signed(manifest()), signed(part(0))])
    assert len(events) == 1 and not events[0].payload["partial"]


def test_forged_video_chunks_are_not_pooled():
    m, header, chunks, expected = video_msgs()
    forged = EncodedPart(id="r", part=0, modality="image", sent_at_ms=9.0, chunk=0, tenant="t",
                         embedding=to_wire(np.full(8, 5.0), "float32"), extras={"frames": 2})
    state, events = run([forged, signed(m), signed(header), *(signed(c) for c in chunks[1:])])
    assert not events  # chunk 0 is still missing: the forged one did not fill its place
    r = step(state, signed(chunks[0]), 20.0, POLICY)
    assert r.emit is not None and r.emit.payload["parts"][0]["extras"]["frames_encoded"] == 6


def test_a_replayed_manifest_adds_its_nonce_and_another_request_is_refused():
    first = signed(manifest(n=2), nonce="n1", digest="d1")
    replay = signed(manifest(n=2), nonce="n2", digest="d1")  # the router routed the same record again
    state, _ = run([first, signed(part(0), nonce="n1")])
    r = step(state, replay, 10.0, POLICY)
    assert r.changed and r.state.nonces == {"n1", "n2"} and r.refused is None
    r = step(r.state, signed(part(1), nonce="n2"), 10.0, POLICY)
    assert r.emit is not None and r.emit.kind == "result"
    other = signed(manifest(n=1), nonce="n3", digest="d2")  # another request reusing the id
    r = step(state, other, 10.0, POLICY)
    assert not r.changed and r.state is state and r.emit is None
    assert r.refused.kind == "error" and r.refused.error["code"] == "invalid_request"
    assert "id already used" in r.refused.error["message"] and r.reply_to == "mm.results"


def test_a_manifest_without_a_nonce_trusts_parts_as_before():
    _, events = run([manifest(n=1), part(0)])
    assert len(events) == 1


def test_a_search_names_the_space_of_its_query_and_a_pooled_video_the_space_of_its_frames():
    import dataclasses

    from schemas.jobs import RetrieveJob

    m = dataclasses.replace(manifest(n=1), task="retrieve", params={"collection": "kb", "k": 3})
    q = dataclasses.replace(part(0), space="minilm/1/int8/p1")
    r = step(step(None, m, 10.0, POLICY).state, q, 10.0, POLICY)
    assert isinstance(r.forward, RetrieveJob) and r.forward.space == "minilm/1/int8/p1"
    vm, header, chunks, _ = video_msgs()
    vm = dataclasses.replace(vm, task="retrieve", params={"collection": "kb", "k": 3})
    chunks = [dataclasses.replace(c, space="effnet/1/int8/p1") for c in chunks]
    state = None
    for msg in [vm, header, *chunks]:
        got = step(state, msg, 10.0, POLICY)
        state = got.state
    assert got.forward.space == "effnet/1/int8/p1"


def test_a_generation_admitted_in_debt_reaches_the_generator_marked_so():
    import dataclasses

    for background, charged, by in ((None, None, None), (True, 1024, "router/7-abc")):
        m = dataclasses.replace(manifest(n=1), task="generate", background=background, charged_tokens=charged,
                                charged_by=by)
        r = step(step(None, m, 2.0, POLICY).state, part(0), 6.0, POLICY)
        assert r.forward is not None and r.forward.background is background and r.forward.charged_tokens == charged
        assert r.forward.charged_by == by
