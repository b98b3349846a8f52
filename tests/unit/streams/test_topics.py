"""Topic configs that bound what the pipeline stores and reads: no compressed batches past
the size limit, and a DLQ that forgets by time and by bytes."""

from __future__ import annotations

from schemas.settings import Settings
from streams.runtime.produce import dead_letter
from schemas.topics import TopicNames
from streams.topics import tenant_topic_specs, topic_specs


def test_every_topic_is_stored_uncompressed_and_the_dlq_is_bounded():
    s = Settings.from_env({"MMSTREAM_DLQ_RETENTION_MS": "3600000", "MMSTREAM_DLQ_RETENTION_BYTES": str(64 << 20)})
    specs = {t.name: t.config for t in topic_specs(s.kafka, s.dlq)}
    assert all(c.get("compression.type") == "uncompressed" for c in specs.values())
    own = tenant_topic_specs(s.kafka, "acme")  # what a tenant's own client writes and reads
    assert own and all(t.config.get("compression.type") == "uncompressed" for t in own)
    dlq = specs["mm.dlq"]
    assert dlq["retention.ms"] == "3600000" and dlq["retention.bytes"] == str(64 << 20)
    assert int(dlq["segment.bytes"]) <= 64 << 20 and int(dlq["segment.ms"]) <= 3600000
    default = {t.name: t.config for t in topic_specs(s.kafka)}["mm.dlq"]  # without the section: its defaults
    assert int(default["retention.ms"]) == Settings().dlq.retention_ms


def test_a_metadata_only_dead_letter_keeps_no_byte_of_the_value_and_fits():
    out = dead_letter("mm.dlq", b"k", b"v" * 5000, "why", [("h", b"1")], "t[0]@1", max_bytes=1024,
                      keep_payload=False)
    headers = dict(out.headers)
    assert out.value == b"" and headers["h"] == b"1" and headers["x-mm-error"] == b"why"
    assert b"5000 bytes dropped" in headers["x-mm-truncated"]


def test_ingress_topics_parse_to_their_lane_and_tenant():
    names = TopicNames("mm")
    assert names.parse_ingress("mm.ingress.rt") == ("rt", None)
    assert names.parse_ingress("mm.ingress.bulk.acme") == ("bulk", "acme")
    assert names.parse_ingress("mm.encode.text.rt") is None and names.parse_ingress("mmx.ingress.rt") is None
    assert TopicNames("other").parse_ingress("mm.ingress.rt") is None  # each prefix its own pattern
