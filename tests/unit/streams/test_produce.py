"""Dead-letter records (streams/runtime/produce.py): what they keep, and that the whole record always
fits the producer's size limit."""

from __future__ import annotations

from aiokafka.record.default_records import DefaultRecordBatchBuilder
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.codec import ERROR_HEADER, SOURCE_HEADER, TRUNCATED_HEADER
from streams.runtime.produce import MAX_REASON_BYTES, dead_letter

MB = 1024 * 1024


def test_keeps_value_key_and_original_headers_and_adds_reason_and_source():
    out = dead_letter("mm.dlq", "r1", b"\xc1\xc1", "undecodable: bad", [("trace-id", b"42"), ("x", None)],
                      "mm.ingress.rt[0]@7", max_bytes=MB)
    assert (out.topic, out.key, out.value, out.partition) == ("mm.dlq", b"r1", b"\xc1\xc1", None)
    assert out.headers == [("trace-id", b"42"), ("x", b""), (ERROR_HEADER, b"undecodable: bad"),
                           (SOURCE_HEADER, b"mm.ingress.rt[0]@7")]


def test_headers_as_a_map_and_no_source():
    out = dead_letter("mm.dlq", None, None, "why", {"content-type": "application/json"}, max_bytes=MB)
    assert out.value == b"" and out.key is None
    assert out.headers == [("content-type", b"application/json"), (ERROR_HEADER, b"why")]


def test_reason_is_cut_at_a_character_boundary():
    out = dead_letter("mm.dlq", None, b"v", "é" * 2000, max_bytes=MB)
    reason = dict(out.headers)[ERROR_HEADER]
    assert len(reason) <= MAX_REASON_BYTES and reason.decode("utf-8") == "é" * (MAX_REASON_BYTES // 2)


def test_a_record_at_the_limit_is_cut_and_says_so():
    value = b"v" * (2 * MB)
    out = dead_letter("mm.dlq", b"k", value, "payload_too_large: big", [("h", b"1")], "t[0]@1", max_bytes=MB)
    headers = dict(out.headers)
    assert out.value == value[:len(out.value)] and MB - 2048 < len(out.value) < MB
    assert headers["h"] == b"1" and headers[ERROR_HEADER].startswith(b"payload_too_large")
    assert headers[TRUNCATED_HEADER] == f"value {2 * MB} -> {len(out.value)} bytes".encode()
    assert _producer_size(out) <= MB


def test_original_headers_that_alone_do_not_fit_are_dropped():
    out = dead_letter("mm.dlq", b"k", b"v" * 100, "why", [("small", b"1"), ("huge", b"h" * 5000)],
                      max_bytes=4096)
    headers = dict(out.headers)
    assert "huge" not in headers and headers["small"] == b"1"
    assert headers[TRUNCATED_HEADER].endswith(b"; 1 original header dropped")
    assert _producer_size(out) <= 4096


@settings(max_examples=200, deadline=None)
@given(key=st.none() | st.binary(max_size=200), value=st.none() | st.binary(max_size=20_000),
       headers=st.lists(st.tuples(st.text(max_size=20), st.none() | st.binary(max_size=3000)), max_size=6),
       reason=st.text(max_size=3000), source=st.none() | st.text(max_size=400),
       max_bytes=st.integers(2048, 30_000))
def test_the_whole_record_always_fits(key, value, headers, reason, source, max_bytes):
    out = dead_letter("mm.dlq", key, value, reason, headers, source, max_bytes=max_bytes)
    assert _producer_size(out) <= max_bytes
    assert dict(out.headers)[ERROR_HEADER].decode("utf-8") == reason.encode()[:MAX_REASON_BYTES].decode(
        "utf-8", "ignore")  # always there, cut at a character boundary
    raw = value or b""
    if TRUNCATED_HEADER not in dict(out.headers):
        assert out.value == raw and len(out.headers) == len(headers) + 1 + (source is not None)
    else:
        assert raw.startswith(out.value)


def _producer_size(out) -> int:
    """The size aiokafka's producer checks against max_request_size."""
    return DefaultRecordBatchBuilder.estimate_size_in_bytes(out.key, out.value, out.headers)


def test_client_headers_named_like_the_pipelines_own_are_dropped_and_counted():
    spoofed = [("x-mm-error", b"all fine"), ("X-MM-Source", b"mm.encode.text.rt[0]@1"), ("trace-id", b"7")]
    out = dead_letter("mm.dlq", None, b"v", "undecodable: bad", spoofed, "mm.ingress.rt[0]@9", max_bytes=MB)
    names = [n.lower() for n, _ in out.headers]
    assert names.count(ERROR_HEADER) == 1 and names.count(SOURCE_HEADER) == 1 and names.count(TRUNCATED_HEADER) == 1
    headers = dict(out.headers)
    assert headers[ERROR_HEADER] == b"undecodable: bad" and headers[SOURCE_HEADER] == b"mm.ingress.rt[0]@9"
    assert headers["trace-id"] == b"7" and headers[TRUNCATED_HEADER] == b"2 original x-mm-* headers dropped"
    cut = dead_letter("mm.dlq", None, b"v" * 5000, "why", spoofed, max_bytes=2048)
    assert [n for n, _ in cut.headers].count(TRUNCATED_HEADER) == 1  # one note says both
    assert b"2 original x-mm-* headers dropped" in dict(cut.headers)[TRUNCATED_HEADER]
