"""The text modality: a sentence-embedding model over normalized text (``workers/text.py``).

Cost is counted in tokens (about four characters each, as the router sees them); the cache
keys on the normalized text; the language model reads text parts as they are.
"""

from __future__ import annotations

from typing import Any, Mapping

from schemas.jobs import EncodeJob
from schemas.settings import Settings
from workers import prompt as P
from workers import text
from workers.encoders import Runner, load_engine, timed
from workers.modalities.spec import ModalitySpec
from workers.outputs import Observer
from workers.text import _WARMUP_TEXTS, TextEncoder, TextPreprocessor, normalize


def build_runner(settings: Settings, observer: Observer, stage: str) -> Runner:
    config, engine = load_engine(settings, observer, SPEC.model_name(settings) or "", stage)
    pre = TextPreprocessor(config.tokenizer_path, config.max_length)
    encoder = TextEncoder(engine, pre, embedding_dim=config.embedding_dim)
    encoder.warmup()
    run = SPEC.cached(settings, observer, lambda jobs: encoder.run_batch([j.text for j in jobs]), config)

    def calibrate() -> tuple[float, float]:
        texts = list(_WARMUP_TEXTS)
        return float(sum(pre.count_tokens(t) for t in texts)), timed(lambda: encoder.embed(texts))

    identity = f"{config.name}/{config.version}/{settings.encoder.precision}/{text.PREPROCESSING_VERSION}"
    return Runner(run, lambda job: float(pre.count_tokens(job.text or "")), calibrate, identity)


def _content(job: EncodeJob, settings: Settings) -> bytes | None:
    return normalize(job.text or "").encode()


def _tokens(size: int, max_frames: int) -> float:
    return max(1.0, size / 4.0)


def _grounding(extras: Mapping[str, Any]) -> dict[str, Any]:
    return {"text": extras.get("text", "")}


def _prompt_part(grounded: Mapping[str, Any]) -> Any:
    return P.TextPart(grounded.get("text", ""))


SPEC = ModalitySpec(
    name="text",
    runner=build_runner,
    model_setting="text_model",
    recipe="all-minilm-l6-v2",
    cache_content=_content,
    preprocessing=text.PREPROCESSING_VERSION,
    cost_unit="token",
    ms_per_unit=0.15,  # per token, padded batch on 2 CPU threads
    units=_tokens,
    units_per_record=20.0,  # a text job is ~20 tokens
    ttl_setting="ttl_text_s",
    grounding=_grounding,
    prompt_part=_prompt_part,
)
