"""A chaos scenario as data (``chaos/scenarios/*.json``): the pipeline it runs, the traffic it
sends, the faults it fires and what it expects. ``load`` reads and checks one; a mistake in
the file is a ``ScenarioError`` naming the field.

    {"name": "kill-each-stage", "about": "...",
     "pipeline": {"replicas": {"router": 2, "assembler": 2}, "partitions": 4, "env": {...}},
     "infra": {"broker": "shared" | "own" | "cluster", "redis": "shared" | "own", "proxy": false},
     "traffic": {"seconds": 40, "rate": 4, "mix": {"text": 4, "image": 2, "generate": 1},
                 "bulk_share": 0.3, "deadline_ms": 120000, "max_tokens": 8, "seed": 1},
     "faults": [{"at_s": 5, "action": "kill", "stage": "assembler", "replica": 0, "restart_after_s": 2}],
     "expect": {"dlq": 0, "rss_mb": 2000, "errors": ["deadline_exceeded"], "drain_s": 120},
     "documents": {"collection": "kb", "count": 60, "rate": 6}}

``documents`` (optional): passages written to a collection during the run, and afterwards the
check that the retrieve stage's index equals the topic (``ingest.py``).

Fault actions (``faults.py`` carries them out): ``kill`` / ``term`` (a stage replica, started
again after ``restart_after_s``), ``stall`` (SIGSTOP for ``for_s``, then SIGCONT),
``cpu_starve`` (SIGSTOP/SIGCONT bursts: ``for_s``, ``stopped_ms`` of every ``period_ms``),
``broker_kill`` / ``broker_restart`` / ``kill_leader`` (own broker or cluster only),
``redis_kill`` / ``redis_evict`` (own Redis only), ``latency`` / ``bandwidth`` / ``cut`` (on
the Toxiproxy link ``link``: ``kafka`` or ``redis``, for ``for_s``), ``slow_reader`` (the
runner's own reply reader stops reading for ``for_s``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmstream.chaos.ingest import Ingest

KINDS = ("text", "image", "video", "audio", "generate")
ACTIONS = {
    "kill": ("stage",), "term": ("stage",), "stall": ("stage", "for_s"), "cpu_starve": ("stage", "for_s"),
    "broker_kill": (), "broker_restart": (), "kill_leader": (), "redis_kill": (), "redis_evict": (),
    "latency": ("link", "for_s"), "bandwidth": ("link", "for_s"), "cut": ("link", "for_s"),
    "slow_reader": ("for_s",),
}
BROKER_ACTIONS = {"broker_kill", "broker_restart", "kill_leader"}
REDIS_ACTIONS = {"redis_kill", "redis_evict"}
LINK_ACTIONS = {"latency", "bandwidth", "cut"}


class ScenarioError(ValueError):
    """A scenario file that cannot be run as written; the message names the field."""


@dataclass(frozen=True)
class Fault:
    at_s: float
    action: str
    params: dict[str, Any] = field(default_factory=dict)
    """Everything else the fault's entry says (stage, replica, for_s, restart_after_s...)."""

    @property
    def duration_s(self) -> float:
        """How long the fault lasts (0 for an instant one), counting a restart's wait."""
        return float(self.params.get("for_s", self.params.get("restart_after_s", 0.0)))

    def describe(self) -> str:
        what = self.params.get("stage") or self.params.get("link") or ""
        return f"{self.action} {what}".strip() + f" @{self.at_s:g}s"


@dataclass(frozen=True)
class Scenario:
    name: str
    about: str
    replicas: dict[str, int]
    env: dict[str, str]
    partitions: int
    broker: str
    redis: str
    proxy: bool
    seconds: float
    rate: float
    mix: dict[str, float]
    bulk_share: float
    deadline_ms: int
    max_tokens: int
    seed: int
    faults: tuple[Fault, ...]
    dlq: int
    rss_mb: float
    errors: tuple[str, ...]
    """Error codes a terminal event may carry without failing the run (a fault may cause them)."""
    drain_s: float
    ci: bool
    """Short enough for `make test` (tests/integration/test_chaos.py)."""
    documents: Ingest | None = None


def load(path: Path) -> Scenario:
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ScenarioError(f"{path}: {exc}") from None
    return parse(raw, str(path))


def parse(raw: dict[str, Any], where: str = "scenario") -> Scenario:
    def need(obj: dict[str, Any], key: str, kind: type, ctx: str) -> Any:
        if key not in obj:
            raise ScenarioError(f"{where}: {ctx}{key} is missing")
        value = obj[key]
        if kind is float and isinstance(value, int):
            value = float(value)
        if not isinstance(value, kind):
            raise ScenarioError(f"{where}: {ctx}{key} must be {kind.__name__}")
        return value

    pipeline = raw.get("pipeline", {})
    infra = raw.get("infra", {})
    traffic = need(raw, "traffic", dict, "")
    expect = raw.get("expect", {})
    mix = {str(k): float(v) for k, v in need(traffic, "mix", dict, "traffic.").items()}
    unknown = set(mix) - set(KINDS)
    if unknown or not mix:
        raise ScenarioError(f"{where}: traffic.mix takes {', '.join(KINDS)}; got {sorted(mix)}")
    faults = []
    for i, f in enumerate(raw.get("faults", [])):
        action = need(f, "action", str, f"faults[{i}].")
        if action not in ACTIONS:
            raise ScenarioError(f"{where}: faults[{i}].action {action!r}; actions: {', '.join(ACTIONS)}")
        for key in ACTIONS[action]:
            if key not in f:
                raise ScenarioError(f"{where}: faults[{i}] ({action}) needs {key}")
        faults.append(Fault(float(need(f, "at_s", float, f"faults[{i}].")), action,
                            {k: v for k, v in f.items() if k not in ("at_s", "action")}))
    broker = infra.get("broker", "shared")
    redis = infra.get("redis", "shared")
    proxy = bool(infra.get("proxy", False))
    if broker not in ("shared", "own", "cluster") or redis not in ("shared", "own"):
        raise ScenarioError(f"{where}: infra.broker is shared, own or cluster; infra.redis shared or own")
    for f in faults:
        if f.action in BROKER_ACTIONS and broker == "shared":
            raise ScenarioError(f"{where}: {f.action} needs infra.broker own or cluster (never the shared broker)")
        if f.action in REDIS_ACTIONS and redis == "shared":
            raise ScenarioError(f"{where}: {f.action} needs infra.redis own (never the shared Redis)")
        if f.action in LINK_ACTIONS and not proxy:
            raise ScenarioError(f"{where}: {f.action} needs infra.proxy true")
    if proxy and (broker != "own" or redis != "own"):
        raise ScenarioError(f"{where}: infra.proxy needs infra.broker own and infra.redis own")
    documents = None
    if raw.get("documents") is not None:
        try:
            documents = Ingest.parse(need(raw, "documents", dict, ""), int(traffic.get("seed", 1)))
        except (ValueError, TypeError) as exc:
            raise ScenarioError(f"{where}: {exc}") from None
    return Scenario(
        name=need(raw, "name", str, ""), about=raw.get("about", ""),
        replicas={str(k): int(v) for k, v in need(pipeline, "replicas", dict, "pipeline.").items()},
        env={str(k): str(v) for k, v in pipeline.get("env", {}).items()},
        partitions=int(pipeline.get("partitions", 4)), broker=broker, redis=redis, proxy=proxy,
        seconds=need(traffic, "seconds", float, "traffic."), rate=need(traffic, "rate", float, "traffic."), mix=mix,
        bulk_share=float(traffic.get("bulk_share", 0.0)), deadline_ms=int(traffic.get("deadline_ms", 120_000)),
        max_tokens=int(traffic.get("max_tokens", 8)), seed=int(traffic.get("seed", 1)),
        faults=tuple(sorted(faults, key=lambda f: f.at_s)), dlq=int(expect.get("dlq", 0)),
        rss_mb=float(expect.get("rss_mb", 2000)), errors=tuple(expect.get("errors", ())),
        drain_s=float(expect.get("drain_s", 180)), ci=bool(raw.get("ci", False)), documents=documents,
    )
