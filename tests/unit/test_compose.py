"""docker/compose.yaml cannot run on the build machines (no Docker engine), so this keeps it
in step with the native set-up that the tests do run: broker version, broker settings,
Redis policy, and one service per stage."""

from pathlib import Path

import yaml

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
    return props


def test_broker_image_is_the_native_version():
    assert SERVICES["kafka"]["image"] == f"apache/kafka:{LocalSettings().kafka_version}"


def test_broker_settings_match_server_properties():
    env = SERVICES["kafka"]["environment"]
    compose = {k[len("KAFKA_"):].lower().replace("_", "."): str(v) for k, v in env.items()}
    native = native_broker_settings()
    # Addresses differ by design (container names vs loopback); threads are a laptop tweak.
    skip = {"listeners", "advertised.listeners", "controller.quorum.voters", "log.dirs", "node.id",
            "num.network.threads", "num.io.threads"}
    for key, value in native.items():
        if key in skip:
            continue
        assert compose.get(key) == value, f"{key}: compose has {compose.get(key)!r}, native has {value!r}"


def test_redis_policy_matches_native_config():
    cmd = " ".join(SERVICES["redis"]["command"])
    native = (ROOT / "infra" / "redis" / "redis.conf").read_text()
    assert "maxmemory-policy allkeys-lru" in native and "--maxmemory-policy allkeys-lru" in cmd


def test_every_stage_has_a_service_running_it():
    for stage in stage_names():  # the registry's modalities (workers/modalities) and the fixed stages
        service = SERVICES[stage.replace(".", "-")]
        assert service["command"] == ["worker", stage]
        assert service["environment"]["MMSTREAM_KAFKA_BOOTSTRAP"] == "kafka:9092"
