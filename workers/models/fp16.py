"""`mmstream models build --target gpu`: an fp16 variant of each ONNX model, with its fidelity.

The conversion is ONNX Runtime's own (``onnxruntime.transformers.float16``, shipped in the
onnxruntime wheel): weights and activations in half precision, graph inputs and outputs
kept float32 (``keep_io_types``), so the encoders, the LM's KV handling and the wire see the
dtypes they see today. Ops the converter blocks by default stay float32.

Fidelity is measured against fp32 on the build's probe set, on the best provider this
machine has (recorded as ``measured_on``): the text model on the fidelity sentences, the
image model on its fidelity and calibration photos, the LM as teacher-forced and greedy
agreement on its fidelity prompts. The variant is recorded in config.json with its gate
(``workers.models.gates``), which is rewritten in place under the build's lock: the graph
is written first and config.json replaced in one rename, so a reader sees the old config
or the new one with its file, never a variant without its graph.

Not built: Whisper's fp16 is a CTranslate2 compute type of the same model.bin, and its
fidelity can only be measured on a GPU (CTranslate2 has no fp16 on the CPU).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable

import numpy as np

from workers.engines.lm import GENERATION_FILE, LMEngine, SamplingParams
from workers.image import preprocess
from workers.models.efficientnet import CALIBRATION_PHOTOS, FIDELITY_PHOTOS, sample_photo
from workers.models.fidelity import FIDELITY_SENTENCES, compare
from workers.models.gates import with_gates
from workers.models.smollm import FIDELITY_PROMPTS, FIDELITY_SYSTEM
from workers.prompt import render_chatml
from workers.repository import CONFIG_FILE, ModelConfig, VariantSpec
from workers.text import TextPreprocessor, normalize

RECIPE = "1"  # bump when the conversion or a probe changes: every fp16 variant is rebuilt
FILE = "model.fp16.onnx"
NEW_TOKENS = 24

Log = Callable[[str], None]


def recipe_key() -> str:
    """What the fp16 variant's content depends on beyond the fp32 graph (its build key)."""
    import onnx
    import onnxruntime

    return f"fp16-{RECIPE}/onnxruntime-{onnxruntime.__version__}/onnx-{onnx.__version__}"


def ensure_fp16(config: ModelConfig, log: Log, force: bool = False) -> ModelConfig:
    """``config`` with an up-to-date fp16 variant (built now if missing, stale or ``force``).
    Models it does not apply to (no probe for the task, not ONNX) come back unchanged.
    The caller holds the model's build lock."""
    probe = PROBES.get(config.task)
    if probe is None or config.backend not in ("onnxruntime", "lm-onnxruntime"):
        log(f"{config.name}: no fp16 variant for a {config.backend} {config.task} model")
        return config
    key = recipe_key()
    current = config.variants.get("fp16")
    if current is not None and not force and current.fidelity.get("recipe") == key \
            and (config.directory / current.file).is_file():
        return config
    src, dst = config.model_path("fp32"), config.directory / FILE
    log(f"{config.name}: converting fp32 -> fp16")
    scratch = dst.with_name(f".{FILE}.tmp")
    convert(src, scratch)
    os.replace(scratch, dst)
    log(f"{config.name}: measuring fp16 against fp32")
    fidelity = {"reference": "fp32", **probe(config, src, dst), "recipe": key,
                "conversion": "onnxruntime.transformers.float16, float32 inputs and outputs"}
    variants = {**config.variants, "fp16": VariantSpec("fp16", FILE, dst.stat().st_size, MappingProxyType(fidelity))}
    updated = with_gates(dataclasses.replace(config, variants=MappingProxyType(variants)))
    write_config(updated)
    log(f"{config.name}: fp16 {fidelity}")
    return updated


def convert(src: Path, dst: Path) -> None:
    """Write the fp16 copy of the ONNX graph ``src`` to ``dst`` (inputs/outputs float32)."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = convert_float_to_float16(onnx.load(str(src)), keep_io_types=True)
    onnx.save_model(model, str(dst), save_as_external_data=False)


def write_config(config: ModelConfig) -> None:
    """Replace config.json of ``config.directory`` in one rename."""
    path = config.directory / CONFIG_FILE
    scratch = path.with_name(f".{CONFIG_FILE}.tmp")
    scratch.write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    os.replace(scratch, path)


# -- probes: fidelity of the fp16 graph against the fp32 graph -----------------------------

def _session(path: Path) -> Any:
    import onnxruntime as ort

    preferred = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in ort.get_available_providers()]
    return ort.InferenceSession(str(path), providers=preferred)


def _text(config: ModelConfig, fp32: Path, fp16: Path) -> dict[str, Any]:
    feeds = TextPreprocessor(config.tokenizer_path, config.max_length).tokenize_batch(
        [normalize(s) for s in FIDELITY_SENTENCES])
    ref, test = (_session(p) for p in (fp32, fp16))
    out = compare(test.run(["embedding"], feeds)[0], ref.run(["embedding"], feeds)[0], "fp32")
    return {**out, "measured_on": test.get_providers()[0]}


def _image(config: ModelConfig, fp32: Path, fp16: Path) -> dict[str, Any]:
    pixels = preprocess([sample_photo(name) for name in FIDELITY_PHOTOS + CALIBRATION_PHOTOS])
    ref, test = (_session(p) for p in (fp32, fp16))
    r = dict(zip(("embedding", "logits"), ref.run(["embedding", "logits"], {"pixels": pixels})))
    t = dict(zip(("embedding", "logits"), test.run(["embedding", "logits"], {"pixels": pixels})))
    out = compare(t["embedding"], r["embedding"], "fp32")
    out["top1_agreement"] = round(float((t["logits"].argmax(1) == r["logits"].argmax(1)).mean()), 4)
    return {**out, "measured_on": test.get_providers()[0]}


def _lm(config: ModelConfig, fp32: Path, fp16: Path) -> dict[str, Any]:
    import tokenizers

    generation = json.loads((config.directory / GENERATION_FILE).read_text())
    tokenizer = tokenizers.Tokenizer.from_file(str(config.tokenizer_path))
    prompts = [tokenizer.encode(render_chatml([{"role": "system", "content": FIDELITY_SYSTEM},
                                               {"role": "user", "content": p}]), add_special_tokens=False).ids
               for p in FIDELITY_PROMPTS]
    providers = ("CUDAExecutionProvider", "CPUExecutionProvider")
    ref = LMEngine.from_file(fp32, generation, providers=providers)
    test = LMEngine.from_file(fp16, generation, providers=providers)
    reference = [ref.generate_greedy(p, NEW_TOKENS) for p in prompts]
    greedy = [test.generate_greedy(p, NEW_TOKENS) for p in prompts]
    agreed = total = 0
    for prompt, tokens in zip(prompts, reference):  # teacher-forced: fp16 fed fp32's own context
        seq = test.new_sequence("tf", prompt, SamplingParams(max_tokens=len(tokens)))
        logits = test.prefill([(seq, len(prompt))])[0]
        for i, token in enumerate(tokens):
            agreed, total = agreed + int(np.argmax(logits) == token), total + 1
            if i + 1 < len(tokens):
                test.append(seq, token)
                logits = test.decode([seq])[0]
    prefix = sum(next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), min(len(g), len(r)))
                 for g, r in zip(greedy, reference))
    return {"prompts": len(prompts), "max_new_tokens": NEW_TOKENS,
            "teacher_forced_agreement": round(agreed / max(total, 1), 4),
            "greedy_token_agreement": round(prefix / max(sum(len(r) for r in reference), 1), 4),
            "identical_outputs": sum(g == r for g, r in zip(greedy, reference)),
            "measured_on": test.provider}


PROBES: dict[str, Callable[[ModelConfig, Path, Path], dict[str, Any]]] = {
    "text-embedding": _text,
    "image-embedding": _image,
    "text-generation": _lm,
}

