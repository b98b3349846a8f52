"""The README's secure quick start, command for command: the ```console block of its Security
section that starts with ``mmstream up --secure``, each line run as a subprocess of the real
``mmstream`` CLI, in order, exactly as a person would type it into a fresh shell (nothing
sourced): ``up --secure`` starts the real secured broker and the workers, ``tenant add`` finds
that broker by itself, the tenant's request is answered, and ``down`` stops what ``up``
started.

The commands run with a state dir, a topic prefix and secure-broker ports of this test's own
(``MMSTREAM_LOCAL_STATE_DIR``, ``MMSTREAM_KAFKA_TOPIC_PREFIX``, ``MMSTREAM_LOCAL_KAFKA_SECURE_*``,
``MMSTREAM_LOCAL_REDIS_SECURE_PORT``), so they never touch the suite's stack or a developer's
``mmstream up`` on the default ports and state dir; the one path the README spells out for those
defaults (``~/.local/state/mmstream/tenants/mm/``) is rewritten to the same place under them.
``up --secure`` starts its secured Redis (ACL users) there too, ``tenant add`` gives the tenant a
Redis user of its own and writes its URL into the properties file, and ``down`` stops both.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from mmstream.localstack.secure import SecureKafka
from mmstream.supervisor import Supervisor
from streams.connection import read_redis_url
from schemas.settings import Settings
from tests.integration.conftest import free_ports

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DEFAULT_TENANTS = "~/.local/state/mmstream/tenants/mm/"
"""Where the README's commands find the tenant's file: the default state dir and prefix."""
TIMEOUT_S = {"up": 600, "down": 180}
"""Per command, past its own waits (`up`: the broker's 90 s and the probe's 180 s)."""


def quick_start(readme: Path = README) -> list[str]:
    """The command lines (without ``$``) of the README's console block that runs
    ``mmstream up --secure``."""
    blocks = re.findall(r"^```console\n(.*?)^```$", readme.read_text(encoding="utf-8"), re.S | re.M)
    found = [b for b in blocks if re.search(r"^\$ mmstream up --secure", b, re.M)]
    assert len(found) == 1, f"{readme} has {len(found)} console blocks running `mmstream up --secure`"
    return [line[2:] for line in found[0].splitlines() if line.startswith("$ ")]


def _mmstream() -> list[str]:
    """The installed ``mmstream`` command of this interpreter's environment."""
    script = Path(sys.executable).with_name("mmstream")
    return [str(script)] if script.exists() else [sys.executable, "-m", "mmstream.cli"]


def test_the_readme_secure_quick_start_as_written(infra: Settings, tmp_path: Path) -> None:
    lines = quick_start()
    assert [shlex.split(line, comments=True)[:2] for line in lines] == [
        ["mmstream", "down"], ["mmstream", "up"], ["mmstream", "tenant"], ["mmstream", "send"],
        ["mmstream", "down"]], lines
    assert sum(DEFAULT_TENANTS in line for line in lines) == 1, lines

    state, prefix = tmp_path / "state", f"q{uuid.uuid4().hex[:10]}"
    port, internal, controller, redis_port = free_ports(4)
    env = {**os.environ,
           "MMSTREAM_LOCAL_STATE_DIR": str(state), "MMSTREAM_KAFKA_TOPIC_PREFIX": prefix,
           "MMSTREAM_LOCAL_KAFKA_SECURE_PORT": str(port), "MMSTREAM_LOCAL_KAFKA_SECURE_INTERNAL_PORT": str(internal),
           "MMSTREAM_LOCAL_KAFKA_SECURE_CONTROLLER_PORT": str(controller),
           "MMSTREAM_LOCAL_REDIS_SECURE_PORT": str(redis_port),
           "MMSTREAM_LOCAL_KAFKA_HEAP_MB": "256", "MMSTREAM_LOCAL_METRICS_BASE_PORT": "0"}
    # A fresh shell: nothing of a secure broker sourced (tenant add must find it by itself).
    for var in ("BOOTSTRAP", "SECURITY_PROTOCOL", "SASL_MECHANISM", "USERNAME", "PASSWORD", "SSL_CA_FILE"):
        env.pop(f"MMSTREAM_KAFKA_{var}", None)
    settings = Settings.from_env(env)
    broker = SecureKafka(settings.local, REPO)

    outputs: list[str] = []
    try:
        for line in lines:
            argv = shlex.split(line.replace(DEFAULT_TENANTS, f"{state}/tenants/{prefix}/"), comments=True)
            done = subprocess.run(_mmstream() + argv[1:], env=env, cwd=tmp_path, capture_output=True, text=True,
                                  timeout=TIMEOUT_S.get(argv[1], 120))
            outputs.append(f"$ {line}\n{done.stdout}{done.stderr}")
            assert done.returncode == 0, "\n".join(outputs) + _worker_logs(settings)
            if argv[1] == "up":
                assert broker.running(), "\n".join(outputs)
            if argv[1] == "tenant":
                props = Path(state / "tenants" / prefix / f"{argv[3]}.properties")
                redis_url = read_redis_url(props)
                assert redis_url and f"//{argv[3]}:" in redis_url and f":{redis_port}/" in redis_url, props.read_text()
            if argv[1] == "send":
                terminal = json.loads(done.stdout.strip().splitlines()[-1])
                assert terminal["kind"] == "result", "\n".join(outputs)
        # The last `down` stopped the broker and the workers `up` started.
        assert not broker.running() and not [w for w in Supervisor(settings).workers() if w.alive]
    finally:  # whatever failed, leave nothing of this test running
        subprocess.run(_mmstream() + ["down"], env=env, cwd=tmp_path, capture_output=True, timeout=180)


def _worker_logs(settings: Settings) -> str:
    return "".join(f"\n--- {w.log_file}\n" + Path(w.log_file).read_text(errors="replace")[-2000:]
                   for w in Supervisor(settings).workers() if Path(w.log_file).exists())
