"""The audio modality's compute, loaded only where an ``encode.audio`` worker starts: decoding,
voice activity and Whisper through CTranslate2 (``workers/audio``)."""

from __future__ import annotations

from typing import Any

from schemas.jobs import EncodeJob
from schemas.settings import Settings
from workers import audio
from workers.audio import AudioEncoder, decode_audio, normalized_speech
from workers.encoders import Runner, load_engine, run_isolated
from workers.modalities.audio import SPEC
from workers.outputs import Encoded, Observer, Prepared


def build_runner(settings: Settings, observer: Observer, stage: str) -> Runner:
    config, engine = load_engine(settings, observer, SPEC.model_name(settings) or "", stage,
                                 precision=settings.models.audio_precision)
    encoder = AudioEncoder(engine, max_seconds=settings.limits.max_audio_seconds)
    encoder.warmup()
    max_s = settings.limits.max_audio_seconds

    def prepare(job: EncodeJob) -> Prepared:
        return Prepared(job, 1.0, decode_audio(job.data or b"", job.mime, max_s))

    def run(items: list[Prepared]) -> list[Any]:
        return [r if isinstance(r, Exception) else Encoded(r.embedding, {
            "transcript": r.transcript, "speech_seconds": round(r.speech_seconds, 3), "language": r.language})
            for r in run_isolated([item.data for item in items], encoder.encode)]

    identity = f"{config.name}/{config.version}/{engine.precision}/{audio.PREPROCESSING_VERSION}"
    return Runner(prepare, run, identity=identity, cost_prior=(0.0, 300.0, 0.0), config=config,
                  precision=engine.precision, cache_content=cache_content,
                  preprocessing=f"{audio.PREPROCESSING_VERSION}+speech")


def cache_content(job: EncodeJob, settings: Settings) -> bytes | None:
    # Keyed by the speech the model hears (decoded, resampled, VAD-trimmed): a few ms of
    # work that saves Whisper's hundreds when the same words come again.
    return normalized_speech(job.data, job.mime, settings.limits.max_audio_seconds) if job.data else None
