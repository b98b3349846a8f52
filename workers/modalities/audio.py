"""The audio modality: Whisper through CTranslate2, a transcript plus the speech-pooled
encoder embedding (``workers/audio.py``). One clip is one unit of cost (a 30 s window)."""

from __future__ import annotations

from typing import Any, Mapping

from schemas.jobs import EncodeJob
from schemas.settings import Settings
from workers import audio
from workers import prompt as P
from workers.audio import AudioEncoder, normalized_speech
from workers.encoders import Runner, load_engine, refs_not_served
from workers.engines.ctranslate2 import WhisperEngine
from workers.modalities.spec import ModalitySpec
from workers.outputs import Encoded, Observer


def build_runner(settings: Settings, observer: Observer, stage: str) -> Runner:
    config, engine = load_engine(settings, observer, SPEC.model_name(settings) or "", stage, WhisperEngine,
                                 settings.models.audio_precision)
    encoder = AudioEncoder(engine, max_seconds=settings.limits.max_audio_seconds)
    encoder.warmup()

    def run_batch(jobs: list[EncodeJob]) -> list[Any]:
        inline = [j for j in jobs if j.data is not None]
        results = iter(encoder.run_batch([(j.data, j.mime) for j in inline]))
        out: list[Any] = []
        for j in jobs:
            if j.data is None:
                out.append(refs_not_served(j))
                continue
            r = next(results)
            out.append(r if isinstance(r, Exception) else Encoded(r.embedding, {
                "transcript": r.transcript, "speech_seconds": round(r.speech_seconds, 3), "language": r.language}))
        return out

    run = SPEC.cached(settings, observer, run_batch, config)
    identity = f"{config.name}/{config.version}/{settings.models.audio_precision}/{audio.PREPROCESSING_VERSION}"
    return Runner(run, lambda job: 1.0, identity=identity)


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
    units_per_record=1.0,
    cache_ttl_s=3600,  # its own TTL: it used to borrow the image setting's
    grounding=_grounding,
    prompt_part=_prompt_part,
)
