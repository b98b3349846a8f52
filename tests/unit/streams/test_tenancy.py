"""Who a request is from, and where its answers may go: the router's tenant and reply_to
rules in both modes (pure: a fake topic-existence check, no broker)."""

import asyncio

import pytest

from schemas import pack, unpack
from schemas.events import Event
from schemas.jobs import Manifest, Verdict, fan_in_from_wire
from schemas.settings import Settings
from streams.stages.routing import Router
from schemas.topics import valid_tenant
from schemas.topics import TopicNames

NAMES = TopicNames("mm")
SECURE = {"MMSTREAM_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "MMSTREAM_KAFKA_USERNAME": "svc",
          "MMSTREAM_KAFKA_PASSWORD": "pw"}
EXISTING = {"client.replies", "mm.results.acme", "mm.results.acme.batch", "mm.results.globex", "mm.encoded.rt",
            "mm.ingress.rt", "mm.dlq", "mm.assembler.done", "mm-assembler-table-changelog", "__consumer_offsets"}


def router(secure: bool) -> Router:
    async def exists(topic):
        return topic in EXISTING

    return Router(Settings.from_env(SECURE if secure else {}), exists)


def route(r: Router, body: dict, tenant: str | None = None):
    outs = asyncio.run(r.handle(pack({"v": 1, "parts": [{"modality": "text", "text": "x"}], **body}), [], 1.0,
                                "test", tenant=tenant)).outs
    first = fan_in_from_wire(unpack(outs[0].value))
    if isinstance(first, Verdict):
        return first.tenant, first.reply_to, Event.from_wire(first.events[0]).error
    assert isinstance(first, Manifest)
    return first.tenant, first.reply_to, None


def test_tenant_names_cannot_nest_or_escape_their_topics():
    assert valid_tenant("acme") and valid_tenant("a-1_b")
    for bad in ("", "Acme", "a.b", "a/b", "-a", "x" * 49, "acme\n"):
        assert not valid_tenant(bad), bad


def test_ingress_topics_say_their_lane_and_tenant():
    assert NAMES.parse_ingress("mm.ingress.rt") == ("rt", None)
    assert NAMES.parse_ingress("mm.ingress.bulk.acme") == ("bulk", "acme")
    for other in ("mm.ingress.rt.a.b", "mm.ingress.rtx", "mm.ingress.rt.Acme", "mmx.ingress.rt", "mm.encoded.rt"):
        assert NAMES.parse_ingress(other) is None, other


@pytest.mark.parametrize("topic, internal", [
    ("mm.results", False), ("mm.results.acme", False), ("mm.results.acme.x", False), ("client.replies", False),
    ("mm.ingress.rt", True), ("mm.ingress.rt.acme", True), ("mm.encoded.rt", True), ("mm.encode.text.bulk", True),
    ("mm.generate.rt", True), ("mm.dlq", True), ("mm.assembler.done", True), ("mm.generator.done", True),
    ("mm-router-x", True), ("any-changelog", True), ("__consumer_offsets", True),
])
def test_internal_topics_are_every_pipeline_topic_but_the_reply_topics(topic, internal):
    assert NAMES.is_internal(topic) is internal


def test_the_reply_namespace_of_a_tenant_excludes_a_longer_name():
    assert NAMES.in_reply_namespace("mm.results.acme", "acme")
    assert NAMES.in_reply_namespace("mm.results.acme.batch", "acme")
    assert not NAMES.in_reply_namespace("mm.results.acme2", "acme")
    assert not NAMES.in_reply_namespace("mm.results", "acme")


def test_plaintext_believes_the_payload_tenant_and_keeps_custom_reply_topics():
    r = router(secure=False)
    assert route(r, {"id": "a", "tenant": "acme"}) == ("acme", "mm.results", None)
    assert route(r, {"id": "b", "tenant": "acme", "reply_to": "client.replies"}) == ("acme", "client.replies", None)


@pytest.mark.parametrize("secure", [False, True])
@pytest.mark.parametrize("target", ["mm.encoded.rt", "mm.ingress.rt", "mm.dlq", "mm.assembler.done",
                                    "mm-assembler-table-changelog", "__consumer_offsets"])
def test_internal_reply_topics_are_refused_in_every_mode(secure, target):
    tenant, reply_to, err = route(router(secure), {"id": "a", "reply_to": target})
    assert err["code"] == "invalid_request" and err["field"] == "reply_to"
    assert reply_to == "mm.results"  # the refusal goes to the sender's default reply topic


def test_the_tenant_comes_from_the_topic_not_the_payload():
    r = router(secure=True)
    assert route(r, {"id": "a"}, tenant="acme") == ("acme", "mm.results.acme", None)
    assert route(r, {"id": "b", "tenant": "acme"}, tenant="acme") == ("acme", "mm.results.acme", None)
    tenant, reply_to, err = route(r, {"id": "c", "tenant": "globex"}, tenant="acme")
    assert (tenant, reply_to) == ("acme", "mm.results.acme")  # answered to acme, as acme
    assert err["code"] == "invalid_request" and err["field"] == "tenant" and "globex" in err["message"]


@pytest.mark.parametrize("target", ["mm.results.globex", "mm.results", "client.replies", "mm.results.acme2",
                                    "mm.encoded.rt"])
def test_a_tenant_gets_answers_only_inside_its_reply_namespace(target):
    tenant, reply_to, err = route(router(secure=True), {"id": "a", "reply_to": target}, tenant="acme")
    assert err["field"] == "reply_to" and reply_to == "mm.results.acme" and tenant == "acme"


def test_a_tenants_own_reply_topics_are_accepted_when_they_exist():
    r = router(secure=True)
    assert route(r, {"id": "a", "reply_to": "mm.results.acme.batch"}, tenant="acme")[1] == "mm.results.acme.batch"
    assert route(r, {"id": "b", "reply_to": "mm.results.acme.nope"}, tenant="acme")[2]["field"] == "reply_to"


def test_an_invalid_request_of_a_tenant_is_answered_as_that_tenant():
    r = router(secure=True)
    tenant, reply_to, err = route(r, {"id": "a", "tenant": "globex", "reply_to": "mm.results.globex",
                                      "task": "nonsense"}, tenant="acme")
    assert (tenant, reply_to) == ("acme", "mm.results.acme") and err["code"] == "invalid_request"


def test_the_shared_ingress_of_a_secure_deployment_trusts_the_service_principal():
    # Only the service principal may write the shared ingress (ACLs): its payload tenant holds.
    assert route(router(secure=True), {"id": "a", "tenant": "bench-1"}) == ("bench-1", "mm.results", None)
