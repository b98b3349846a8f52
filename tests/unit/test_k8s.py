"""infra/k8s/mmstream.yaml cannot be applied here (no cluster); this keeps its stages,
consumer groups and topics in step with the code."""

from pathlib import Path

import yaml

from schemas.settings import Settings
from streams.stages import BASELINE_POOL, stage_names
from streams.topics import TopicNames

DOCS = list(yaml.safe_load_all((Path(__file__).resolve().parents[2] / "infra" / "k8s" / "mmstream.yaml").read_text()))


def test_every_stage_but_the_baseline_pool_has_a_deployment():
    """The stages are the registry's (workers/modalities): a new modality needs its Deployment."""
    deployed = {d["spec"]["template"]["spec"]["containers"][0]["args"][1] for d in DOCS if d["kind"] == "Deployment"}
    assert deployed == set(stage_names()) - {BASELINE_POOL}


def test_scalers_watch_the_stage_s_own_group_and_topics():
    names = TopicNames(Settings().kafka.topic_prefix)
    for obj in (d for d in DOCS if d["kind"] == "ScaledObject"):
        stage = obj["metadata"]["name"].removeprefix("mmstream-").replace("-", ".", 1)
        for trigger in obj["spec"]["triggers"]:
            meta = trigger["metadata"]
            assert meta["consumerGroup"] == f"mm-{stage.replace('.', '-')}"
            if stage.startswith("encode."):
                assert meta["topic"] in {names.encode(stage.split(".")[1], lane) for lane in ("rt", "bulk")}
            if stage == "generate":
                assert meta["topic"] in {names.generate(lane) for lane in ("rt", "bulk")}
        assert obj["spec"]["maxReplicaCount"] <= 8
