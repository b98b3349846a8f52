"""A modality added from outside the package, the way docs/adding-a-modality.md says: "doc",
a plain-text document sent as UTF-8 bytes (``data``), embedded with the real text model and
described to the language model by its text.

Workers load it with ``MMSTREAM_MODALITIES_PLUGINS=tests.integration.doc_modality``; it
registers its spec when imported. Nothing else in the tree names it.
"""

from __future__ import annotations

from typing import Any, Mapping

from schemas.errors import ErrorCode, WireError
from schemas.jobs import EncodeJob
from schemas.settings import Settings
from workers import prompt, text
from workers.encoders import Runner, load_engine, refs_not_served
from workers.modalities import ModalitySpec, register
from workers.outputs import Encoded, Observer
from workers.text import TextEncoder, TextPreprocessor, normalize

PREPROCESSING = f"doc-utf8+{text.PREPROCESSING_VERSION}"
EXCERPT_CHARS = 500


def decode(job: EncodeJob) -> str:
    """The document's normalized text; ``WireError`` naming the part when it is not UTF-8 text."""
    if job.data is None:
        raise refs_not_served(job)
    try:
        doc = normalize(job.data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise WireError(ErrorCode.UNSUPPORTED_MEDIA, f"the document is not UTF-8 text (byte {exc.start})",
                        f"parts.{job.part}.data") from None
    if not doc:
        raise WireError(ErrorCode.INVALID_REQUEST, "the document is empty", f"parts.{job.part}.data")
    return doc


def build_runner(settings: Settings, observer: Observer, stage: str) -> Runner:
    config, engine = load_engine(settings, observer, SPEC.model_name(settings) or "", stage)
    pre = TextPreprocessor(config.tokenizer_path, config.max_length)
    encoder = TextEncoder(engine, pre, embedding_dim=config.embedding_dim)
    encoder.warmup(1)

    def run_batch(jobs: list[EncodeJob]) -> list[Any]:
        docs: list[Any] = []
        for job in jobs:
            try:
                docs.append(decode(job))
            except WireError as err:
                docs.append(err)
        good = [i for i, d in enumerate(docs) if isinstance(d, str)]
        embedded = iter(encoder.run_batch([docs[i] for i in good]))
        out: list[Any] = []
        for d in docs:
            if isinstance(d, Exception):
                out.append(d)
                continue
            e = next(embedded)
            out.append(e if isinstance(e, Exception) else
                       Encoded(e, {"chars": len(d), "excerpt": d[:EXCERPT_CHARS]}))
        return out

    def cost(job: EncodeJob) -> float:
        try:
            return float(pre.count_tokens(decode(job)))
        except WireError:
            return 1.0

    identity = f"{config.name}/{config.version}/{settings.encoder.precision}/{PREPROCESSING}"
    return Runner(SPEC.cached(settings, observer, run_batch, config), cost, identity=identity)


def _content(job: EncodeJob, settings: Settings) -> bytes | None:
    try:
        return decode(job).encode()
    except WireError:
        return None  # not cached: the batch answers it with its error


def _grounding(extras: Mapping[str, Any]) -> dict[str, Any]:
    return {"text": extras.get("excerpt", "")}


def _prompt_part(grounded: Mapping[str, Any]) -> Any:
    return prompt.AttachmentPart("doc", "text", grounded.get("text", ""), failed=bool(grounded.get("failed")))


SPEC = register(ModalitySpec(
    name="doc",
    runner=build_runner,
    model_setting="text_model",  # the text model's build recipe already builds it
    cache_content=_content,
    preprocessing=PREPROCESSING,
    cost_unit="token",
    ms_per_unit=0.15,
    units=lambda size, max_frames: max(1.0, size / 4.0),  # ~4 bytes per token
    units_per_record=100.0,
    cache_ttl_s=600,
    grounding=_grounding,
    prompt_part=_prompt_part,
))
