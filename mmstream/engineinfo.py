"""What engine each worker serves and how long it took to start, read from its /metrics, for
`mmstream status`.

The workers publish ``mmstream_engine_info`` (model, version, precision, provider, backend
per stage: ``streams.observe.metrics``); this reads it back, so status shows the provider that
actually runs (CUDA after a TensorRT failure, fp32 after a refused fp16) without asking the
worker anything else. ``summary`` is pure; ``scrape`` does the one HTTP call.
"""

from __future__ import annotations

import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def summary(metrics_text: str) -> str | None:
    """``"all-minilm-l6-v2/1 fp16 on CUDAExecutionProvider (onnxruntime)"`` per stage, joined
    with "; "; None when the worker publishes no engine (router, assembler, lag monitor)."""
    found = []
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name != "mmstream_engine_info":
                continue
            lab = s.labels
            found.append(f"{lab.get('model')}/{lab.get('version')} {lab.get('precision')} on "
                         f"{lab.get('provider')} ({lab.get('backend')})")
    return "; ".join(sorted(set(found))) or None


def cold_start(metrics_text: str) -> str | None:
    """``"ready 2.4 s, first answer 3.1 s"`` from ``mmstream_cold_start_seconds`` (seconds from
    the worker's fork); None before it is ready."""
    phases = {s.labels.get("phase"): s.value for family in text_string_to_metric_families(metrics_text)
              for s in family.samples if s.name == "mmstream_cold_start_seconds"}
    parts = [f"{label} {phases[key]:.2f} s" for key, label in (("ready", "ready"), ("first_answer", "first answer"))
             if key in phases]
    return ", ".join(parts) or None


def _get(port: int, host: str, timeout_s: float) -> str | None:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout_s) as resp:
            return resp.read().decode("utf-8", "replace")
    except (OSError, urllib.error.URLError, ValueError):
        return None


def scrape(port: int, host: str = "127.0.0.1", timeout_s: float = 0.5) -> str | None:
    """``summary`` of the worker on ``port``; None when it does not answer in time."""
    text = _get(port, host, timeout_s)
    return None if text is None else summary(text)


def scrape_all(port: int, host: str = "127.0.0.1", timeout_s: float = 0.5) -> tuple[str | None, str | None]:
    """(``summary``, ``cold_start``) of the worker on ``port``, in one request."""
    text = _get(port, host, timeout_s)
    return (None, None) if text is None else (summary(text), cold_start(text))
