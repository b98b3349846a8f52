"""The fidelity thresholds each model's precision variants must meet to be served.

Written into config.json by the build (``VariantSpec.gate``) and read at load by
``workers.engines.gate``. They catch a variant that went wrong (a bad conversion, a
quantizer regression, a GPU kernel that loses precision), not quality tuning: each sits
well under what the variant measured when it was introduced (in the comments; fidelity
against fp32 on the build's probe set). fp32 is the reference and has no gate.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Mapping

from workers.repository import ModelConfig

Gate = Mapping[str, Mapping[str, float]]

GATES: Mapping[str, Mapping[str, Gate]] = {
    "all-minilm-l6-v2": {
        "int8": {"mean_cosine": {"min": 0.98}, "min_cosine": {"min": 0.95}},  # 0.9915, 0.9749
        "fp16": {"mean_cosine": {"min": 0.999}, "min_cosine": {"min": 0.995}},  # 1.0, 0.99999
    },
    "efficientnet-lite0": {
        "int8": {"mean_cosine": {"min": 0.97}, "top1_agreement": {"min": 0.85}},  # 0.9883, 0.95 as introduced; 0.9734, 0.95 on AVX2 without VNNI
        "fp16": {"mean_cosine": {"min": 0.999}, "top1_agreement": {"min": 0.85}},  # 0.99998, 0.9375 (one near-tie of 16)
    },
    "smollm2-135m": {
        # Greedy agreement compounds after the first divergence; teacher-forced does not.
        "int8": {"teacher_forced_agreement": {"min": 0.8}},  # 0.8804
        "fp16": {"teacher_forced_agreement": {"min": 0.95}},
        "q4_1": {"teacher_forced_agreement": {"min": 0.8}},  # the GGUF on llama.cpp vs its dequantized fp32 graph
    },
    "whisper-base": {
        "int8": {"wer": {"max": 0.2}, "transcript_agreement": {"min": 0.8}},  # 0.0526, 1.0
    },
}


def with_gates(config: ModelConfig) -> ModelConfig:
    """``config`` with each variant's gate from ``GATES`` (variants without one keep theirs)."""
    table = GATES.get(config.name, {})
    variants = {
        p: dataclasses.replace(v, gate=MappingProxyType({m: MappingProxyType(dict(b)) for m, b in table[p].items()}))
        if p in table else v
        for p, v in config.variants.items()
    }
    return dataclasses.replace(config, variants=MappingProxyType(variants))
