"""infra/k8s/mmstream.yaml cannot be applied here (no cluster); this keeps its stages,
consumer groups and topics in step with the code."""

from pathlib import Path

import yaml

from schemas.settings import Settings
from streams.stages import BASELINE_POOL, stage_names
from schemas.topics import TopicNames

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


ROOT = Path(__file__).resolve().parents[2]
DEPLOYMENTS = [d for d in DOCS if d["kind"] == "Deployment"]
SCALERS = [d for d in DOCS if d["kind"] == "ScaledObject"]


def _container(d: dict) -> dict:
    return d["spec"]["template"]["spec"]["containers"][0]


def test_images_are_pinned_to_the_package_version():
    import tomllib

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    for d in DEPLOYMENTS:
        assert _container(d)["image"] == f"mmstream:{version}", d["metadata"]["name"]


def test_probes_hit_the_health_endpoints_on_the_metrics_port():
    for d in DEPLOYMENTS:
        c = _container(d)
        assert c["ports"] == [{"containerPort": 9400, "name": "metrics"}]
        assert c["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
        assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
        assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
        # engines warm up before the app starts: the startup probe must wait for them
        assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 180


def test_workers_run_as_non_root_on_a_read_only_root():
    for d in DEPLOYMENTS:
        pod = d["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 10001
        sc = _container(d)["securityContext"]
        assert sc == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
        mounts = {m["mountPath"] for m in _container(d)["volumeMounts"]}
        assert "/var/lib/mmstream" in mounts  # MMSTREAM_LOCAL_STATE_DIR in the image: Faust's data
        assert _container(d)["resources"]["requests"] and _container(d)["resources"]["limits"]["memory"]


def test_one_configmap_and_one_secret_feed_workers_and_scalers():
    config = next(d for d in DOCS if d["kind"] == "ConfigMap")
    secret = next(d for d in DOCS if d["kind"] == "Secret")
    assert "MMSTREAM_KAFKA_BOOTSTRAP" in config["data"] and "MMSTREAM_REDIS_URL" in secret["stringData"]
    Settings.from_env({**config["data"], "MMSTREAM_REDIS_URL": secret["stringData"]["MMSTREAM_REDIS_URL"]})
    for d in DEPLOYMENTS:
        assert _container(d)["envFrom"] == [{"configMapRef": {"name": "mmstream"}}, {"secretRef": {"name": "mmstream"}}]
    auth = next(d for d in DOCS if d["kind"] == "TriggerAuthentication")
    assert {r["name"] for r in auth["spec"]["secretTargetRef"]} == {"mmstream"}
    for obj in SCALERS:
        for trigger in obj["spec"]["triggers"]:
            assert trigger["authenticationRef"] == {"name": auth["metadata"]["name"]}
            assert "bootstrapServers" not in trigger["metadata"]  # written once, in the ConfigMap
            assert trigger["metadata"]["bootstrapServersFromEnv"] == "MMSTREAM_KAFKA_BOOTSTRAP"


def test_lag_alert_limits_follow_the_keda_thresholds():
    rules = yaml.safe_load((ROOT / "infra" / "prometheus" / "alerts.yml").read_text())
    limits = {(r["labels"]["group"], r["labels"]["topic"]): r["expr"]
              for g in rules["groups"] for r in g["rules"] if r.get("record") == "mmstream:keda_lag_limit"}
    expected = {(t["metadata"]["consumerGroup"], t["metadata"]["topic"]):
                f"vector({int(t['metadata']['lagThreshold']) * obj['spec']['maxReplicaCount']})"
                for obj in SCALERS for t in obj["spec"]["triggers"]}
    assert limits == expected
    assert expected[("mm-generate", "mm.generate.rt")] == "vector(64)"  # generate's own threshold, not the rt default


def test_the_engines_that_want_a_gpu_say_how_to_get_one():
    text = (ROOT / "infra" / "k8s" / "mmstream.yaml").read_text()
    for stage in ("encode-image", "encode-video", "generate"):
        block = text.split(f"name: mmstream-{stage}\n", 1)[1].split("---", 1)[0]
        assert "nvidia.com/gpu: 1" in block and "mmstream:0.1.0-gpu" in block


def test_workers_and_keda_authenticate_from_the_same_secret_keys():
    config = next(d for d in DOCS if d["kind"] == "ConfigMap")["data"]
    secret = next(d for d in DOCS if d["kind"] == "Secret")["stringData"]
    auth = next(d for d in DOCS if d["kind"] == "TriggerAuthentication")
    keys = {r["parameter"]: r["key"] for r in auth["spec"]["secretTargetRef"]}
    assert keys["username"] == "MMSTREAM_KAFKA_USERNAME" and keys["password"] == "MMSTREAM_KAFKA_PASSWORD"
    assert {"sasl", "tls", "ca"} <= set(keys) and set(keys.values()) <= set(secret)
    secured = Settings.from_env({**config, "MMSTREAM_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
                                 **{k: v for k, v in secret.items() if k.startswith("MMSTREAM_")}})
    assert secured.kafka.username == secret["MMSTREAM_KAFKA_USERNAME"]
    for d in DEPLOYMENTS:  # the CA file the settings name is the Secret's `ca`
        pod = d["spec"]["template"]["spec"]
        mount = next(m for m in _container(d)["volumeMounts"] if m["name"] == "kafka-ca")
        volume = next(v for v in pod["volumes"] if v["name"] == "kafka-ca")
        assert volume["secret"]["items"] == [{"key": keys["ca"], "path": "ca.pem"}]
        assert f"{mount['mountPath']}/ca.pem" == config["MMSTREAM_KAFKA_SSL_CA_FILE"]


def test_scalers_are_what_the_autoscale_settings_generate():
    """One source for thresholds: the local scaler and KEDA read the same pools and lag per
    replica (regenerate with `mmstream scale --keda`)."""
    from mmstream.k8s_scalers import render, scaled_objects

    generated = scaled_objects(Settings())
    assert sorted(SCALERS, key=lambda o: o["metadata"]["name"]) == sorted(generated, key=lambda o: o["metadata"]["name"])
    assert list(yaml.safe_load_all(render(generated))) == generated
    # what a changed default would change in the file
    tighter = scaled_objects(Settings.from_env({"MMSTREAM_AUTOSCALE_POOLS": "encode.text=2:3", "MMSTREAM_AUTOSCALE_RT_LAG": "9"}))
    assert [(o["spec"]["minReplicaCount"], o["spec"]["maxReplicaCount"], o["spec"]["triggers"][0]["metadata"]["lagThreshold"])
            for o in tighter] == [(2, 3, "9")]
