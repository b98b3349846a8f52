"""The audio modality's compute, loaded only where an ``encode.audio`` worker starts: decoding,
voice activity and Whisper through CTranslate2 (``workers/audio``)."""

from __future__ import annotations

from typing import Any

from schemas.jobs import EncodeJob
from schemas.settings import Settings
from workers import audio
from workers.audio import SAMPLE_RATE, AudioEncoder, decode_audio, normalized_speech
from workers.audio_header import HEAD_BYTES, SLACK_S, seconds_bound, windows
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
        # No longer than it was priced at (the router read the same bound from the same bytes),
        # and as long as it plays in 30 s windows: the cost model learns per window.
        data = job.data or b""
        bound = min(max_s, seconds_bound(data[:HEAD_BYTES], len(data), max_s) + SLACK_S)
        samples = decode_audio(data, job.mime, bound)
        return Prepared(job, windows(len(samples) / SAMPLE_RATE), samples)

    def run(items: list[Prepared]) -> list[Any]:
        return [r if isinstance(r, Exception) else Encoded(r.embedding, {
            "transcript": r.transcript, "speech_seconds": round(r.speech_seconds, 3), "language": r.language})
            for r in run_isolated([item.data for item in items], encoder.encode)]

    identity = f"{config.name}/{config.version}/{engine.precision}/{audio.PREPROCESSING_VERSION}"
    # Rows alone: a batch costs what its clips' windows cost (not its longest clip's, times its clips).
    return Runner(prepare, run, identity=identity, cost_prior=(0.0, 300.0, 0.0), config=config, rows_alone=True,
                  precision=engine.precision, cache_content=cache_content,
                  preprocessing=f"{audio.PREPROCESSING_VERSION}+speech")


def cache_content(job: EncodeJob, settings: Settings) -> bytes | None:
    # Keyed by the speech the model hears (decoded, resampled, VAD-trimmed): a few ms of
    # work that saves Whisper's hundreds when the same words come again.
    return normalized_speech(job.data, job.mime, settings.limits.max_audio_seconds) if job.data else None
