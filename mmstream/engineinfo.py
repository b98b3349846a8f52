"""What engine each worker serves, read from its /metrics, for `mmstream status`.

The workers publish ``mmstream_engine_info`` (model, version, precision, provider, backend
per stage: ``streams.metrics``); this reads it back, so status shows the provider that
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


def scrape(port: int, host: str = "127.0.0.1", timeout_s: float = 0.5) -> str | None:
    """``summary`` of the worker on ``port``; None when it does not answer in time."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout_s) as resp:
            return summary(resp.read().decode("utf-8", "replace"))
    except (OSError, urllib.error.URLError, ValueError):
        return None
