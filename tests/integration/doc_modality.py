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
from workers.encoders import Runner, batch_dependent, load_engine, refs_not_served, run_isolated
from workers.modalities import ModalitySpec, register
from workers.outputs import Encoded, Observer, Prepared
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

    def prepare(job: EncodeJob) -> Prepared:
        doc = decode(job)  # raises this part's own WireError
        ids = pre.ids(doc)
        return Prepared(job, float(len(ids)), (doc, ids), content=doc.encode())

    alone = batch_dependent(config, engine.precision)  # as the text modality: rows alone when batches change them

    def run(items: list[Prepared]) -> list[Any]:
        rows = [item.data[1] for item in items]
        embedded = ([run_isolated([r], encoder.embed_ids)[0] for r in rows] if alone
                    else run_isolated(rows, encoder.embed_ids))
        return [e if isinstance(e, Exception) else
                Encoded(e, {"chars": len(item.data[0]), "excerpt": item.data[0][:EXCERPT_CHARS]})
                for item, e in zip(items, embedded)]

    identity = f"{config.name}/{config.version}/{engine.precision}/{PREPROCESSING}"
    return Runner(prepare, run, identity=identity, variable_length=True, cost_prior=(1.0, 0.1, 0.0002),
                  config=config, precision=engine.precision)


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
    cache_ttl_s=600,
    grounding=_grounding,
    prompt_part=_prompt_part,
))
