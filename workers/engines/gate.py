"""The fidelity gate and the fallback chain: which precision variant a worker may serve.

Pure decisions over the model config and what a load reported; ``workers.engines.load_engine``
carries them out. A variant is refused, and the worker moves to the next in its chain, when:

- ``missing``: the config has no such variant (never built for this target);
- ``fidelity``: its fidelity, measured at build time against fp32 on the build's probe set,
  misses a threshold its config records (``VariantSpec.gate``: ``{"mean_cosine": {"min":
  0.99}, "wer": {"max": 0.1}}``; a gated metric the build did not record fails too);
- ``load_failed``: the engine raised while loading it (file missing, provider refused it);
- ``provider``: it loaded, but a precision that only pays on a GPU (fp16, bf16) landed on
  the CPU, where it is slower than fp32 (measured: MiniLM fp16 on ONNX Runtime CPU takes
  about twice the fp32 time) and buys nothing.

The chain is the requested precision, then fp32 (the reference every variant is measured
against). A variant without recorded thresholds (a build older than the gate) passes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from workers.repository import ModelConfig

REFERENCE = "fp32"
GPU_ONLY_PRECISIONS = frozenset({"fp16", "bf16", "fp8"})
FALLBACK_REASONS = frozenset({"missing", "fidelity", "load_failed", "provider", "provider_failed"})
"""``provider_failed`` is not a refusal: ONNX Runtime itself went past a provider it was
asked for first (e.g. TensorRT without its libraries) to the next one; it is counted too."""


@dataclass(frozen=True)
class Refusal:
    """Why ``precision`` is not served; ``reason`` is one of ``FALLBACK_REASONS``."""

    precision: str
    reason: str
    detail: str


def fallback_chain(requested: str) -> tuple[str, ...]:
    """The precisions to try, in order: ``requested``, then fp32 unless it was fp32."""
    return (requested,) if requested == REFERENCE else (requested, REFERENCE)


def gate_failures(fidelity: Mapping[str, Any], gate: Mapping[str, Mapping[str, float]]) -> list[str]:
    """Each threshold of ``gate`` that ``fidelity`` misses, as a sentence; empty when all hold.

    ``gate`` maps a fidelity metric to ``{"min": x}`` and/or ``{"max": y}``. A metric the
    fidelity lacks, or that is not a number, fails. Raises ``ValueError`` on a bound other
    than min or max (a typo in config.json must not pass silently).
    """
    failures = []
    for metric, bounds in gate.items():
        unknown = set(bounds) - {"min", "max"}
        if unknown:
            raise ValueError(f"gate on {metric!r} has bounds {sorted(unknown)}; only min and max exist")
        value = fidelity.get(metric)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            failures.append(f"{metric} was not measured")
            continue
        if "min" in bounds and value < bounds["min"]:
            failures.append(f"{metric} {value} < {bounds['min']}")
        if "max" in bounds and value > bounds["max"]:
            failures.append(f"{metric} {value} > {bounds['max']}")
    return failures


def check_variant(config: ModelConfig, precision: str) -> Refusal | None:
    """Refusal of ``precision`` before loading it (``missing`` or ``fidelity``), else None."""
    variant = config.variants.get(precision)
    if variant is None:
        built = ", ".join(sorted(config.variants))
        return Refusal(precision, "missing", f"{config.name}/{config.version} has no {precision} variant (built: {built})")
    failures = gate_failures(variant.fidelity, variant.gate)
    if failures:
        return Refusal(precision, "fidelity", f"{config.name}/{config.version} {precision} misses its gate: "
                       + "; ".join(failures))
    return None


def on_gpu(provider: str) -> bool:
    """Whether an engine's reported provider (or CTranslate2 device) is a GPU one."""
    return not (provider == "CPUExecutionProvider" or provider.startswith("cpu"))


def check_provider(precision: str, provider: str) -> Refusal | None:
    """Refusal of a loaded variant whose precision needs a GPU it did not get, else None."""
    if precision in GPU_ONLY_PRECISIONS and not on_gpu(provider):
        return Refusal(precision, "provider", f"{precision} pays only on a GPU, and this engine runs on {provider}")
    return None
