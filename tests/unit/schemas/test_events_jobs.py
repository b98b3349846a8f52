import numpy as np
import pytest

from schemas import pack, unpack
from schemas.events import Event, EventKind
from schemas.jobs import DeadlineTick, EncodedPart, EncodeJob, Manifest, fan_in_from_wire
from schemas.tensor import from_wire, to_wire
from schemas.trace import Span, breakdown


def test_event_round_trip_and_terminal_kinds():
    ev = Event("r1", EventKind.RESULT, 1, 123.5, payload={"x": 1}, timings={"e2e_ms": 3.0})
    back = Event.from_wire(unpack(pack(ev.to_wire())))
    assert back == ev and back.terminal
    assert not Event("r1", EventKind.ACCEPTED, 0, 1.0).terminal


def test_event_rejects_other_versions():
    with pytest.raises(ValueError):
        Event.from_wire({"v": 9, "id": "a", "kind": "result", "seq": 1, "ts_ms": 1})


def test_jobs_round_trip():
    job = EncodeJob(id="a", part=1, n_parts=2, modality="text", lane="rt", tenant="t", deadline_at_ms=5.0,
                    sent_at_ms=1.0, text="hi")
    assert EncodeJob.from_wire(unpack(pack(job.to_wire()))) == job
    m = Manifest(id="a", task="embed", tenant="t", lane="rt", reply_to="mm.results", n_parts=2,
                 modalities=["text", "text"], deadline_at_ms=9.0, accepted_at_ms=1.0, client_sent_at_ms=0.5, sent_at_ms=1.0)
    assert fan_in_from_wire(unpack(pack(m.to_wire()))) == m
    p = EncodedPart(id="a", part=0, modality="text", sent_at_ms=2.0, embedding=to_wire(np.ones(3)))
    assert fan_in_from_wire(unpack(pack(p.to_wire()))) == p
    assert fan_in_from_wire(DeadlineTick("a").to_wire()) == DeadlineTick("a")
    with pytest.raises(ValueError):
        fan_in_from_wire({"v": 1, "type": "mystery"})
    with pytest.raises(ValueError):
        EncodeJob.from_wire({"v": 1, "type": "encode", "id": "a"})


def test_tensor_fp16_keeps_unit_vectors_close():
    rng = np.random.default_rng(0)
    v = rng.normal(size=384).astype(np.float32)
    v /= np.linalg.norm(v)
    w = from_wire(unpack(pack({"t": to_wire(v, "float16")}))["t"]).astype(np.float32)
    assert float(v @ w) / float(np.linalg.norm(w)) > 0.9999


@pytest.mark.parametrize("bad", [{"dtype": "float16", "shape": [3], "data": b"\x00" * 4},
                                 {"dtype": "complex", "shape": [1], "data": b""},
                                 {"shape": [1]}])
def test_malformed_tensors_raise(bad):
    with pytest.raises(ValueError):
        from_wire(bad)


def test_breakdown_orders_stages_and_splits_queue_from_service():
    spans = [Span("encode", 10.0, 12.0, 20.0), Span("route", 0.0, 1.0, 2.0)]
    assert breakdown(spans) == [{"stage": "route", "queued_ms": 1.0, "service_ms": 1.0},
                                {"stage": "encode", "queued_ms": 2.0, "service_ms": 8.0}]


def test_an_encode_jobs_payload_is_its_data_its_text_and_its_refs_priced_size() -> None:
    base = dict(id="r", part=0, n_parts=1, modality="image", lane="rt", tenant="t", deadline_at_ms=1.0, sent_at_ms=0.0)
    assert EncodeJob(**base, data=b"x" * 300).payload_bytes == 300
    assert EncodeJob(**base, text="hello").payload_bytes == 5
    assert EncodeJob(**base, ref="redis:mm:claim:t:r:0", ref_bytes=4096).payload_bytes == 4096
