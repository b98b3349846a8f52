"""The KEDA ScaledObjects of infra/k8s/mmstream.yaml, generated from the autoscale settings.

One source: the pools' min/max and lag per replica are ``Settings().autoscale``'s, the same
numbers the local scaler (``mmstream.autoscaler``) acts on, and ``tests/unit/test_k8s.py``
holds the file equal to what this prints for the defaults. Change a default, then paste
``mmstream scale --keda`` over the ScaledObjects of the file.

KEDA sees consumer lag only; the local scaler also reads the queued work the stages report
(``target_queued_ms``), which no KEDA trigger can read without a metrics adapter.
"""

from __future__ import annotations

from typing import Any

from schemas.settings import Settings
from streams.app import group_id
from schemas.topics import LANES, TopicNames


def pool_topics(names: TopicNames, stage: str) -> dict[str, str]:
    """Lane -> the shared topic a scaled stage consumes on it."""
    if stage == "router":
        return {lane: names.ingress(lane) for lane in LANES}
    if stage == "assembler":
        return {lane: names.encoded(lane) for lane in LANES}
    if stage.startswith("encode."):
        return {lane: names.encode(stage.removeprefix("encode."), lane) for lane in LANES}
    if stage == "generate":
        return {lane: names.generate(lane) for lane in LANES}
    if stage == "retrieve":
        return {lane: names.retrieve(lane) for lane in LANES}
    raise ValueError(f"{stage!r} is not a scaled stage")


def scaled_objects(settings: Settings) -> list[dict[str, Any]]:
    a, prefix = settings.autoscale, settings.kafka.topic_prefix
    names = TopicNames(prefix)
    out = []
    for stage, (low, high) in a.limits().items():
        name = f"mmstream-{stage.replace('.', '-')}"
        triggers = [{"type": "kafka", "authenticationRef": {"name": "mmstream-kafka"},
                     "metadata": {"bootstrapServersFromEnv": "MMSTREAM_KAFKA_BOOTSTRAP",
                                  "consumerGroup": group_id(prefix, stage), "topic": topic,
                                  "lagThreshold": str(a.lag_per_replica(stage, lane))}}
                    for lane, topic in pool_topics(names, stage).items()]
        out.append({"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": {"name": name},
                    "spec": {"scaleTargetRef": {"name": name}, "minReplicaCount": low, "maxReplicaCount": high,
                             "triggers": triggers}})
    return out


def render(objects: list[dict[str, Any]]) -> str:
    """The objects in the file's own flow style, one ``---`` document each."""
    docs = []
    for o in objects:
        lines = ["apiVersion: keda.sh/v1alpha1", "kind: ScaledObject", "metadata:", f"  name: {o['metadata']['name']}",
                 "spec:", f"  scaleTargetRef: {{name: {o['spec']['scaleTargetRef']['name']}}}",
                 f"  minReplicaCount: {o['spec']['minReplicaCount']}",
                 f"  maxReplicaCount: {o['spec']['maxReplicaCount']}", "  triggers:"]
        for t in o["spec"]["triggers"]:
            m = t["metadata"]
            lines += ["    - type: kafka", "      authenticationRef: {name: mmstream-kafka}", "      metadata:",
                      "        bootstrapServersFromEnv: MMSTREAM_KAFKA_BOOTSTRAP",
                      f"        consumerGroup: {m['consumerGroup']}", f"        topic: {m['topic']}",
                      f"        lagThreshold: \"{m['lagThreshold']}\""]
        docs.append("\n".join(lines) + "\n")
    return "---\n".join(docs)
