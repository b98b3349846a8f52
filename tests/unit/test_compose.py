"""docker/compose.yaml cannot run on the build machines (no Docker engine), so this keeps it
in step with the native set-up that the tests do run: broker version, broker settings,
Redis policy, and one service per stage."""

from pathlib import Path

import yaml

from mmstream.localstack.kafka import FAILOVER_PROPERTIES
from schemas.settings import LocalSettings
from streams.stages import stage_names

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]


def native_broker_settings() -> dict[str, str]:
    props = {}
    for line in (ROOT / "infra" / "kafka" / "server.properties").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            props[key] = value
    return props | FAILOVER_PROPERTIES  # appended to every native broker's properties


def test_broker_image_is_the_native_version():
    assert SERVICES["kafka"]["image"] == f"apache/kafka:{LocalSettings().kafka_version}"


def test_broker_settings_match_the_native_brokers():
    env = SERVICES["kafka"]["environment"]
    compose = {k[len("KAFKA_"):].lower().replace("_", "."): str(v) for k, v in env.items()}
    native = native_broker_settings()
    # Addresses differ by design (container names vs loopback); threads and the cleaner's buffer
    # are tweaks for a small broker's heap (the container's JVM keeps Kafka's defaults).
    skip = {"listeners", "advertised.listeners", "controller.quorum.voters", "log.dirs", "node.id",
            "num.network.threads", "num.io.threads", "log.cleaner.dedupe.buffer.size"}
    for key, value in native.items():
        if key in skip:
            continue
        assert compose.get(key) == value, f"{key}: compose has {compose.get(key)!r}, native has {value!r}"


def test_redis_policy_matches_native_config():
    cmd = " ".join(SERVICES["redis"]["command"])
    native = (ROOT / "infra" / "redis" / "redis.conf").read_text()
    for key in ("maxmemory-policy allkeys-lru", "proto-max-bulk-len 64mb", "client-query-buffer-limit 128mb"):
        assert key in native and f"--{key}" in cmd, key


def test_published_ports_bind_to_loopback_unless_told_otherwise():
    published = [(name, p) for name, svc in SERVICES.items() for p in svc.get("ports", [])]
    assert {name for name, _ in published} >= {"kafka", "redis"}
    for name, port in published:
        assert str(port).startswith("${MMSTREAM_PUBLISH_ADDRESS:-127.0.0.1}:"), (name, port)


def test_every_stage_has_a_service_running_it():
    for stage in stage_names():  # the registry's modalities (workers/modalities) and the fixed stages
        service = SERVICES[stage.replace(".", "-")]
        assert service["command"] == ["worker", stage]
        assert service["environment"]["MMSTREAM_KAFKA_BOOTSTRAP"] == "kafka:9092"


DOCKERFILE = (ROOT / "docker" / "Dockerfile").read_text()
WORKERS = {name: s for name, s in SERVICES.items() if s.get("command", [None])[0] == "worker"}


def test_every_image_is_pinned_by_version():
    for name, service in SERVICES.items():
        image = service["image"]
        repo, _, tag = image.rpartition(":")
        assert repo and tag and tag != "latest" and any(ch.isdigit() for ch in tag), f"{name}: {image}"
    assert "ARG PYTHON=python:3.11." in DOCKERFILE  # the base image too


def test_prometheus_and_grafana_come_with_the_rules_and_the_dashboard():
    prom = SERVICES["prometheus"]
    mounts = {m.split(":")[0]: m.split(":")[1] for m in prom["volumes"]}
    assert mounts["../infra/prometheus/alerts.yml"] == "/etc/prometheus/alerts.yml"
    config = yaml.safe_load((ROOT / "docker" / "prometheus.yml").read_text())
    assert config["rule_files"] == ["alerts.yml"]
    (job,) = config["scrape_configs"]
    sd = job["dns_sd_configs"][0]
    assert set(sd["names"]) == set(WORKERS) and sd["port"] == 9400  # every worker, every replica
    grafana = SERVICES["grafana"]
    mounts = {m.split(":")[0]: m.split(":")[1] for m in grafana["volumes"]}
    assert mounts["../infra/grafana/mmstream.json"].startswith("/var/lib/grafana/dashboards/")
    for provisioning in ("./grafana/datasources.yaml", "./grafana/dashboards.yaml"):
        assert (ROOT / "docker" / provisioning).is_file() and "/etc/grafana/provisioning/" in mounts[provisioning]
    providers = yaml.safe_load((ROOT / "docker" / "grafana" / "dashboards.yaml").read_text())["providers"]
    assert providers[0]["options"]["path"] == "/var/lib/grafana/dashboards"
    source = yaml.safe_load((ROOT / "docker" / "grafana" / "datasources.yaml").read_text())["datasources"][0]
    assert source["url"] == "http://prometheus:9090" and source["type"] == "prometheus"


def test_workers_are_scrapable_and_report_health():
    for name, service in WORKERS.items():
        env = service["environment"]
        assert env["MMSTREAM_METRICS_PORT"] == "9400" and env["MMSTREAM_METRICS_BIND"] == "0.0.0.0", name
        assert "/healthz" in " ".join(service["healthcheck"]["test"]), name
        assert service["depends_on"]["kafka"]["condition"] == "service_healthy"
    for infra in ("kafka", "redis", "prometheus", "grafana"):
        assert SERVICES[infra]["healthcheck"]["test"], infra


def test_image_runs_as_non_root_with_a_healthcheck():
    user = [line for line in DOCKERFILE.splitlines() if line.startswith("USER ")]
    assert user and not user[-1].split()[1].startswith(("0", "root"))
    assert "HEALTHCHECK" in DOCKERFILE and "/healthz" in DOCKERFILE.split("HEALTHCHECK", 1)[1]


def test_dependencies_and_models_are_layered_before_the_code():
    lines = DOCKERFILE.splitlines()
    stages = {}
    for i, line in enumerate(lines):
        if line.startswith("FROM "):
            stages[line.split(" AS ")[-1].strip()] = i
    deps = lines[stages["deps"]:stages["models"]]
    assert not any(line.startswith("COPY ") and line.split()[1] in ("schemas", "streams", "workers", "mmstream")
                   for line in deps), "deps must not depend on the code"
    assert any("requirements.py runtime" in line for line in deps)
    models = "\n".join(lines[stages["models"]:stages["app"]])
    assert "--mount=type=cache,target=/cache/models" in models  # an unchanged model is not rebuilt
    app = lines[stages["app"]:]
    first_code = next(i for i, line in enumerate(app) if line.startswith("COPY schemas"))
    assert all("COPY --from" not in line for line in app[first_code:]), "code must come last"


def test_gpu_image_never_has_both_onnx_runtimes():
    import importlib.util

    spec = importlib.util.spec_from_file_location("requirements", ROOT / "docker" / "requirements.py")
    req = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(req)
    cpu = [req._name(r) for r in req.requirements(ROOT / "pyproject.toml", "runtime", "cpu")]
    gpu = [req._name(r) for r in req.requirements(ROOT / "pyproject.toml", "runtime", "gpu")]
    assert "onnxruntime" in cpu and "onnxruntime-gpu" not in cpu
    assert "onnxruntime-gpu" in gpu and "onnxruntime" not in gpu
    assert "torch" in [req._name(r) for r in req.requirements(ROOT / "pyproject.toml", "build")]
    gpu_compose = yaml.safe_load((ROOT / "docker" / "compose.gpu.yaml").read_text())["services"]
    # The router stays on the CPU image and keeps only text in process: pictures go to the GPU pool.
    assert gpu_compose.pop("router") == {"environment": {"MMSTREAM_ROUTER_COLOCATE": "text"}}
    for name, service in gpu_compose.items():
        assert name in WORKERS and service["build"]["args"]["RUNTIME"] == "gpu"
        assert service["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
