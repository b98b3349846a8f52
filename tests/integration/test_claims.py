"""Claim checks on the real pipeline: payloads over the inline limit travel as a Redis
reference, workers fetch (and keep) them; unknown and forbidden refs fail their own part."""

from __future__ import annotations

import pytest
import redis

from mmstream.samples import photo, video
from schemas.request import Modality, Part, Request
from streams.sdk.client import Client, new_id

pytestmark = pytest.mark.integration

CATS = {"tabby", "tiger cat", "Egyptian cat", "Persian cat", "Siamese cat"}


async def test_big_parts_go_by_claim_check_and_bad_refs_fail_alone(pipeline):
    url = pipeline.settings.redis.url
    rid = new_id()
    async with Client(pipeline.bootstrap, pipeline.prefix, redis_url=url, inline_limit_bytes=10_000) as client:
        sub = await client.submit(Request(id=rid, parts=(
            Part(Modality.IMAGE, data=photo("chelsea"), mime="image/jpeg"),
            Part(Modality.VIDEO, data=video(["coffee", "chelsea"]), mime="video/mp4"),
            Part(Modality.IMAGE, ref="redis:mm:claim:default:nobody:0", mime="image/jpeg"),
            Part(Modality.IMAGE, ref="file:///etc/passwd", mime="image/jpeg"),
            Part(Modality.TEXT, text="small parts stay inline"))))
        event = await sub.result(timeout_s=120)
    image, clip, unknown, forbidden, text = event.payload["parts"]
    assert event.kind == "result" and event.payload["partial"]
    assert image["extras"]["top5"][0][0] in CATS
    assert clip["extras"]["frames_encoded"] == 2
    assert unknown["error"]["code"] == "invalid_request" and "expired" in unknown["error"]["message"]
    assert unknown["error"]["field"] == "parts.2.ref"
    assert forbidden["error"]["code"] == "invalid_request" and forbidden["error"]["field"] == "parts.3.ref"
    assert text["embedding"] is not None
    # Read, never deleted: a job that runs again after a crash finds its payload.
    assert redis.Redis.from_url(url).exists(f"mm:claim:default:{rid}:0") == 1  # in the tenant's namespace
