"""The demo's latency table: readable at 80 columns and when piped (no colour codes, no
cell broken over two lines)."""

from __future__ import annotations

import io

from rich.console import Console

from mmstream.console import latency_table
from schemas.events import Event, EventKind

STAGES = ("route", "encode.text", "encode.image", "encode.audio", "encode.video", "assemble")


def terminal(rid: str, kind: EventKind, n_stages: int, error: dict | None = None) -> Event:
    stages = [{"stage": s, "queued_ms": 12.5 * (i + 1), "service_ms": 3000.0 if s == "encode.video" else 100.0 + i}
              for i, s in enumerate(STAGES[:n_stages])]
    return Event(rid, kind, 1, 0.0, error=error, timings={"stages": stages})


def test_latency_table_fits_80_columns_when_piped():
    rows = [("embed: a cat sleeps on the warm windowsill in the sun", terminal("a", EventKind.RESULT, 6), 4321.5),
            ("a spoken clip (espeak-ng)", terminal("b", EventKind.RESULT, 3), 812.0),
            ("broken image", terminal("c", EventKind.ERROR, 1, {"code": "unsupported_media"}), 9.0)]
    out = io.StringIO()
    Console(file=out, width=80).print(latency_table(rows))  # a file: what a pipe gets
    text = out.getvalue()
    lines = text.splitlines()
    assert "\x1b[" not in text and max(len(line) for line in lines) <= 80
    body = [line for line in lines if line.lstrip().startswith(("embed:", "a spoken", "broken"))]
    assert len(body) == 3, text  # one line per request
    assert any("encode.video" in line and "4322" in line for line in body)  # where the time went
    assert any("unsupported_media" in line for line in body)
    per_stage = [line for line in lines if line.lstrip().startswith(STAGES)]
    assert len(per_stage) == 6 and per_stage[0].lstrip().startswith("route")
