"""The audio modality: Whisper through CTranslate2, a transcript plus the speech-pooled
encoder embedding (``workers/audio.py``). One clip is one unit of cost (a 30 s window)."""

from __future__ import annotations

from typing import Any, Mapping

from schemas.jobs import EncodeJob
from schemas.settings import Settings
from workers import audio
from workers import prompt as P
from workers.audio import AudioEncoder, decode_audio, normalized_speech
from workers.encoders import Runner, load_engine, run_isolated
from workers.modalities.spec import ModalitySpec
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
                  precision=engine.precision)


def _content(job: EncodeJob, settings: Settings) -> bytes | None:
    # Keyed by the speech the model hears (decoded, resampled, VAD-trimmed): a few ms of
    # work that saves Whisper's hundreds when the same words come again.
    return normalized_speech(job.data, job.mime, settings.limits.max_audio_seconds) if job.data else None


def _grounding(extras: Mapping[str, Any]) -> dict[str, Any]:
    return {"transcript": extras.get("transcript", "")}


def _prompt_part(grounded: Mapping[str, Any]) -> Any:
    return P.AudioPart(grounded.get("transcript", "") or "", failed=bool(grounded.get("failed")))


SPEC = ModalitySpec(
    name="audio",
    runner=build_runner,
    model_setting="audio_model",
    recipe="whisper-base",
    cache_content=_content,
    preprocessing=f"{audio.PREPROCESSING_VERSION}+speech",
    cost_unit="clip",
    ms_per_unit=300.0,  # per clip (30 s Whisper window)
    cache_ttl_s=3600,  # its own TTL: it used to borrow the image setting's
    grounding=_grounding,
    prompt_part=_prompt_part,
)
