"""AudioEncoder with a fake engine: window packing, pooling, per-item errors, no-speech clips."""

from __future__ import annotations

import io
import wave

import numpy as np
import pytest

pytest.importorskip("av")
pytest.importorskip("faster_whisper")

from schemas.errors import ErrorCode, WireError  # noqa: E402
from workers import audio  # noqa: E402
from workers.audio import (  # noqa: E402
    SAMPLE_RATE,
    WINDOW_SAMPLES,
    AudioEncoder,
    AudioOutput,
    pack_windows,
    pooled_embedding,
)  # fmt: skip

DIM = 8


class FakeEngine:
    """Encoder output rows are the window's mean sample value, repeated; text names the clip length."""

    def __init__(self, fail_when_batch_over: int | None = None) -> None:
        self.fail_when_batch_over = fail_when_batch_over
        self.encoded_windows = 0

    def features(self, window: np.ndarray) -> np.ndarray:
        return np.full((80, 3000), float(len(window)), dtype=np.float32)

    def encode(self, features: np.ndarray) -> np.ndarray:
        if self.fail_when_batch_over is not None and len(features) > self.fail_when_batch_over:
            raise RuntimeError("batch too big")
        self.encoded_windows += len(features)
        out = np.zeros((len(features), 1500, DIM), dtype=np.float32)
        out[:, :, 0] = 1.0
        out[:, :, 1] = features[:, 0, :1500] / WINDOW_SAMPLES
        return out

    def transcribe(self, encoded: np.ndarray, languages, beam_size: int = 1):
        return [(f"words {int(round(row[0, 1] * WINDOW_SAMPLES))}", lang or "en") for row, lang in zip(encoded, languages)]


def fake_vad(monkeypatch: pytest.MonkeyPatch) -> None:
    """Speech is wherever the signal is non-zero (one segment per non-zero run)."""

    def segments(samples: np.ndarray) -> list[tuple[int, int]]:
        voiced = np.flatnonzero(np.diff(np.concatenate([[0], (samples != 0).astype(np.int8), [0]])))
        return [(int(s), int(e)) for s, e in zip(voiced[::2], voiced[1::2])]

    monkeypatch.setattr(audio.encoder, "speech_segments", segments)  # where the encoder looks it up


def wav(samples: np.ndarray) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE)
        w.writeframes((samples * 32767).astype("<i2").tobytes())
    return out.getvalue()


def test_pack_windows_keeps_segments_whole_when_they_fit() -> None:
    w = 100
    assert pack_windows([], w) == []
    assert pack_windows([(0, 40), (50, 90), (95, 130)], w) == [[(0, 40), (50, 90)], [(95, 130)]]
    assert pack_windows([(0, 250)], w) == [[(0, 100)], [(100, 200)], [(200, 250)]]
    assert pack_windows([(0, 30), (40, 190)], w) == [[(0, 30)], [(40, 140)], [(140, 190)]]


def test_packed_windows_cover_every_segment_sample_once_and_fit() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        cuts = np.sort(rng.choice(10_000, size=2 * int(rng.integers(1, 10)), replace=False))
        segments = [(int(a), int(b)) for a, b in zip(cuts[::2], cuts[1::2])]
        windows = pack_windows(segments, 700)
        assert all(sum(e - s for s, e in w) <= 700 for w in windows)
        covered = [i for w in windows for s, e in w for i in range(s, e)]
        assert covered == [i for s, e in segments for i in range(s, e)]


def test_pooled_embedding_uses_only_the_speech_frames_and_is_unit_length() -> None:
    frames = np.zeros((1500, 2), dtype=np.float32)
    frames[:10, 0] = 1.0  # the speech frames
    frames[10:, 1] = 5.0  # padding frames: must not count
    emb = pooled_embedding([frames], [10 * 320])
    np.testing.assert_allclose(emb, [1.0, 0.0], atol=1e-6)
    assert emb.dtype == np.float32


def test_no_speech_gives_empty_transcript_zero_embedding_and_no_engine_call(monkeypatch) -> None:
    fake_vad(monkeypatch)
    engine = FakeEngine()
    out = AudioEncoder(engine, embedding_dim=DIM).run_batch([(wav(np.zeros(SAMPLE_RATE)), "audio/wav")])
    assert out == [out[0]] and isinstance(out[0], AudioOutput)
    assert out[0].transcript == "" and out[0].speech_seconds == 0.0 and out[0].language is None
    assert not out[0].embedding.any() and out[0].embedding.shape == (DIM,)
    assert engine.encoded_windows == 0


def test_only_speech_reaches_the_engine(monkeypatch) -> None:
    fake_vad(monkeypatch)
    samples = np.zeros(3 * SAMPLE_RATE)
    samples[SAMPLE_RATE : 2 * SAMPLE_RATE] = 0.25
    (out,) = AudioEncoder(FakeEngine(), embedding_dim=DIM).run_batch([(wav(samples), None)])
    assert out.transcript == f"words {SAMPLE_RATE}"
    assert out.speech_seconds == 1.0 and out.language == "en"
    assert abs(float(np.linalg.norm(out.embedding)) - 1.0) < 1e-6


def test_long_speech_is_split_into_windows_and_joined(monkeypatch) -> None:
    fake_vad(monkeypatch)
    engine = FakeEngine()
    samples = np.full(45 * SAMPLE_RATE, 0.25)
    (out,) = AudioEncoder(engine, embedding_dim=DIM, max_seconds=60).run_batch([(wav(samples), None)])
    assert engine.encoded_windows == 2
    assert out.transcript == f"words {WINDOW_SAMPLES} words {15 * SAMPLE_RATE}"


def test_bad_items_fail_alone(monkeypatch) -> None:
    fake_vad(monkeypatch)
    good = wav(np.full(SAMPLE_RATE, 0.25))
    too_long = wav(np.full(3 * SAMPLE_RATE, 0.25))
    out = AudioEncoder(FakeEngine(), embedding_dim=DIM, max_seconds=2).run_batch(
        [(good, None), (b"not audio at all", None), (too_long, "audio/wav"), ("text", None), (good, "image/png")]  # type: ignore[list-item]
    )
    assert isinstance(out[0], AudioOutput)
    assert isinstance(out[1], WireError) and out[1].code == ErrorCode.UNSUPPORTED_MEDIA
    assert isinstance(out[2], WireError) and out[2].code == ErrorCode.PAYLOAD_TOO_LARGE
    assert isinstance(out[3], TypeError)
    assert isinstance(out[4], WireError) and out[4].code == ErrorCode.UNSUPPORTED_MEDIA


def test_engine_failure_for_the_batch_is_retried_one_by_one(monkeypatch) -> None:
    fake_vad(monkeypatch)
    clips = [(wav(np.full(SAMPLE_RATE * (i + 1), 0.25)), None) for i in range(3)]
    out = AudioEncoder(FakeEngine(fail_when_batch_over=1), embedding_dim=DIM).run_batch(clips)
    assert [o.transcript for o in out] == [f"words {SAMPLE_RATE * (i + 1)}" for i in range(3)]


def test_wrong_encoder_width_is_an_error_per_item(monkeypatch) -> None:
    fake_vad(monkeypatch)
    (out,) = AudioEncoder(FakeEngine(), embedding_dim=DIM + 1).run_batch([(wav(np.full(SAMPLE_RATE, 0.25)), None)])
    assert isinstance(out, audio.EncoderOutputError)


def test_real_vad_finds_no_speech_in_silence_tone_and_noise() -> None:
    t = np.arange(3 * SAMPLE_RATE) / SAMPLE_RATE
    for samples in (
        np.zeros(len(t)),
        0.5 * np.sin(2 * np.pi * 440 * t),
        np.random.default_rng(0).normal(0, 0.02, len(t)),
    ):
        assert audio.speech_segments(samples.astype(np.float32)) == []


@pytest.mark.parametrize("provider,rounds", [("cpu/int8", 0), ("cuda/int8_float16", 1)])
def test_warm_up_runs_the_engine_only_where_a_first_pass_costs_more(monkeypatch, provider, rounds) -> None:
    import types

    fake_vad(monkeypatch)
    engine = FakeEngine()
    engine.info = types.SimpleNamespace(provider=provider)
    AudioEncoder(engine, embedding_dim=DIM).warmup()
    assert engine.encoded_windows == rounds
    AudioEncoder(engine, embedding_dim=DIM).warmup(2)  # asked for: always run
    assert engine.encoded_windows == rounds + 2
