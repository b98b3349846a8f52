"""The video stage holds at most ``video.max_held`` jobs (each with its bytes): at the bound its
poll budget is 0, so the runtime's intake gate (``RecordStage.intake_gate``, applied before
every poll) pauses its topics, and resumes them once a decode is done. Decoding is replaced by
a function that waits for the test, so what is tested is the bookkeeping."""

from __future__ import annotations

import asyncio
import threading

import pytest
from aiokafka.structs import ConsumerRecord

import streams.stages.video as video
from schemas.codec import pack
from schemas.jobs import EncodeJob
from schemas.settings import Settings
from streams.app import create_app
from streams.observe.health import WorkerHealth
from streams.observe.metrics import Metrics
from streams.runtime.produce import out_map

PREFIX = "unit"


class Recorder:
    """Stands in for StageIO: deliveries, finished offsets and paused topics."""

    def __init__(self) -> None:
        self.finished: list[int] = []
        self.paused: set[str] = set()

    def hold(self, inputs):
        pass

    def deliver(self, outs, inputs=()):
        self.finished.extend(r.offset for r in inputs)

    def pause(self, topic):
        self.paused.add(topic)

    def resume(self, topic):
        self.paused.discard(topic)

    def backlog(self, topic):
        return 0


@pytest.fixture
def stage(tmp_path, monkeypatch):
    gate = threading.Event()

    def plan(job, settings, decode, resolver):
        gate.wait(10)
        return [out_map(f"{PREFIX}.encoded.rt", job.id, {"v": 1})]

    monkeypatch.setattr(video, "plan_fanout", plan)
    settings = Settings.from_env({"MMSTREAM_KAFKA_TOPIC_PREFIX": PREFIX, "MMSTREAM_LOCAL_STATE_DIR": str(tmp_path),
                                  "MMSTREAM_VIDEO_MAX_HELD": "3"})
    s = video.VideoStage(create_app(settings, "encode.video", health=WorkerHealth()), settings,
                         Metrics(health=WorkerHealth()))
    s.io = Recorder()
    s.gate = gate
    yield s
    gate.set()


def _record(offset: int) -> ConsumerRecord:
    job = EncodeJob(id=f"v{offset}", part=0, n_parts=1, modality="video", lane="rt", tenant="t",
                    deadline_at_ms=1e18, sent_at_ms=0, data=b"not decoded here")
    value = pack(job.to_wire())
    return ConsumerRecord(f"{PREFIX}.encode.video.rt", 0, offset, 0, 0, None, value, None, 0, len(value), [])


def _before_poll(stage) -> None:
    """What the poll loop does before each poll (``RecordStage._poll_forever``)."""
    stage.intake_gate(stage.poll_budget() == 0)
    if not stage.intake_full:
        stage.bulk_gate(not stage.should_take_bulk())


async def test_at_the_bound_the_stage_pauses_and_takes_no_more_until_a_job_is_done(stage) -> None:
    assert stage.poll_budget() == 3
    await stage.handle([_record(i) for i in range(3)])
    assert stage.held == 3 and stage.poll_budget() == 0
    _before_poll(stage)
    assert stage.io.paused == {f"{PREFIX}.encode.video.rt", f"{PREFIX}.encode.video.bulk"}
    _before_poll(stage)  # still full: still paused (a rebalance may have resumed them)
    assert len(stage.io.paused) == 2
    stage.gate.set()
    for _ in range(100):
        if len(stage.io.finished) == 3:
            break
        await asyncio.sleep(0.01)
    assert sorted(stage.io.finished) == [0, 1, 2] and stage.held == 0
    _before_poll(stage)
    assert stage.io.paused == set() and stage.poll_budget() == 3


def test_an_expired_job_is_answered_deadline_exceeded_without_a_byte_decoded(tmp_path):
    from schemas.codec import unpack
    from schemas.jobs import fan_in_from_wire

    settings = Settings.from_env({"MMSTREAM_KAFKA_TOPIC_PREFIX": PREFIX, "MMSTREAM_LOCAL_STATE_DIR": str(tmp_path)})
    job = EncodeJob(id="late", part=0, n_parts=1, modality="video", lane="rt", tenant="t", deadline_at_ms=1.0,
                    sent_at_ms=0, data=b"never decoded")

    def decode(*args, **kwargs):
        raise AssertionError("decoded past the deadline")

    outs = video.plan_fanout(job, settings, decode)
    part = fan_in_from_wire(unpack(outs[0].value))
    assert len(outs) == 1 and part.error["code"] == "deadline_exceeded"


async def test_held_jobs_are_decoded_one_tenant_at_a_time(tmp_path, monkeypatch):
    order = []

    def plan(job, settings, decode, resolver):
        order.append(job.tenant)
        return [out_map(f"{PREFIX}.encoded.rt", job.id, {"v": 1})]

    monkeypatch.setattr(video, "plan_fanout", plan)
    settings = Settings.from_env({"MMSTREAM_KAFKA_TOPIC_PREFIX": PREFIX, "MMSTREAM_LOCAL_STATE_DIR": str(tmp_path)})
    s = video.VideoStage(create_app(settings, "encode.video", health=WorkerHealth()), settings,
                         Metrics(health=WorkerHealth()))
    s.io = Recorder()

    def rec(offset, tenant):
        job = EncodeJob(id=f"v{offset}", part=0, n_parts=1, modality="video", lane="rt", tenant=tenant,
                        deadline_at_ms=1e18, sent_at_ms=0, data=b"x")
        value = pack(job.to_wire())
        return ConsumerRecord(f"{PREFIX}.encode.video.rt", 0, offset, 0, 0, None, value, None, 0, len(value), [])

    await s.handle([rec(0, "hog"), rec(1, "hog"), rec(2, "hog"), rec(3, "quiet")])
    for _ in range(200):
        if len(order) == 4:
            break
        await asyncio.sleep(0.01)
    assert order == ["hog", "quiet", "hog", "hog"] and sorted(s.io.finished) == [0, 1, 2, 3]


def _fanout_with_sound(tmp_path, monkeypatch, priced: float | None):
    from schemas.codec import unpack
    from schemas.jobs import fan_in_from_wire
    from tests.unit.workers.test_video_header import tone_wav
    from mmstream.samples import video as sample_video

    settings = Settings.from_env({"MMSTREAM_KAFKA_TOPIC_PREFIX": PREFIX, "MMSTREAM_LOCAL_STATE_DIR": str(tmp_path),
                                  "MMSTREAM_ROUTER_SERVED_MODALITIES": "text,image,audio,video"})
    if priced is not None:
        monkeypatch.setattr(video, "soundtrack_seconds", lambda data, most: priced)
    job = EncodeJob(id="v", part=0, n_parts=1, modality="video", lane="rt", tenant="t", deadline_at_ms=1e18,
                    sent_at_ms=0, data=sample_video(["chelsea", "coffee"], seconds_each=2.0, soundtrack=tone_wav(3.0)))
    outs = video.plan_fanout(job, settings)
    header = fan_in_from_wire(unpack(outs[0].value))
    tracks = [EncodeJob.from_wire(unpack(o.value)) for o in outs if ".encode.audio." in o.topic]
    return header, tracks


def test_the_soundtrack_goes_to_the_audio_pool_no_longer_than_it_was_priced(tmp_path, monkeypatch):
    import io
    import wave

    _, [track] = _fanout_with_sound(tmp_path, monkeypatch, None)  # as its index declares: 3 s
    with wave.open(io.BytesIO(track.data)) as w:
        assert 2.9 <= w.getnframes() / w.getframerate() <= 3.6
    _, [track] = _fanout_with_sound(tmp_path, monkeypatch, 1.0)  # priced at 1 s: cut there (and its slack)
    with wave.open(io.BytesIO(track.data)) as w:
        assert w.getnframes() / w.getframerate() <= 1.0 + 0.5 + 0.1
    header, tracks = _fanout_with_sound(tmp_path, monkeypatch, 0.0)  # priced none: forwarded none
    assert tracks == [] and header.extras["audio_error"]["code"] == "unsupported_media"
    assert "not priced" in header.extras["audio_error"]["message"]


def test_a_video_admitted_in_debt_fans_out_frames_and_soundtrack_that_say_so(tmp_path):
    """The pools run a batch of work admitted in debt lower (``EncodeJob.background``): a video's
    chunks are that request's work too."""
    from schemas.codec import unpack
    from tests.unit.workers.test_video_header import tone_wav
    from mmstream.samples import video as sample_video

    settings = Settings.from_env({"MMSTREAM_KAFKA_TOPIC_PREFIX": PREFIX, "MMSTREAM_LOCAL_STATE_DIR": str(tmp_path),
                                  "MMSTREAM_ROUTER_SERVED_MODALITIES": "text,image,audio,video"})
    data = sample_video(["chelsea", "coffee"], seconds_each=2.0, soundtrack=tone_wav(3.0))
    for background in (True, None):
        job = EncodeJob(id="v", part=0, n_parts=1, modality="video", lane="rt", tenant="t", deadline_at_ms=1e18,
                        sent_at_ms=0, data=data, background=background)
        jobs = [EncodeJob.from_wire(unpack(o.value)) for o in video.plan_fanout(job, settings) if ".encode." in o.topic]
        assert {j.modality for j in jobs} == {"image", "audio"}
        assert all(j.background is background for j in jobs)
