"""One topic prefix, one set of workers, one broker: `mmstream up` and `up --secure` refuse at
once while the prefix's workers run against the other broker, and `tenant add` finds the local
secure broker by itself while it runs. No broker here: live "workers" and a live "broker" are
this test process, recorded in pid files as the supervisor and the local stack write them."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import pytest

from mmstream import commands
from mmstream.localstack import procs, secure_kafka
from mmstream.supervisor import Supervisor, WorkerProc, WorkersElsewhereError
from schemas.settings import Settings
from tests.unit.mmstream.test_cli import one_sentence, run_cli

ROOT = Path(__file__).resolve().parents[3]


def _settings(state: Path, **extra: str) -> Settings:
    return Settings.from_env({"MMSTREAM_LOCAL_STATE_DIR": str(state), **extra})


def _record_worker(state: Path, bootstrap: str | None) -> None:
    """A live worker (this process) of prefix mm, started against ``bootstrap`` (None: a pid
    file from before the broker was recorded)."""
    sup = Supervisor(_settings(state), env={})
    sup.dir.mkdir(parents=True)
    record = asdict(WorkerProc("router", 0, os.getpid(), str(sup.dir / "router-0.log"), 0.0, 0, bootstrap or ""))
    if bootstrap is None:
        del record["bootstrap"]
    (sup.dir / "router-0.json").write_text(json.dumps(record))


def test_the_supervisor_refuses_workers_of_another_broker_and_keeps_its_own(tmp_path):
    _record_worker(tmp_path, "127.0.0.1:9092")
    Supervisor(_settings(tmp_path), env={}).check_broker()  # same broker: reused
    secure = Supervisor(_settings(tmp_path, MMSTREAM_KAFKA_BOOTSTRAP="127.0.0.1:9094"), env={})
    with pytest.raises(WorkersElsewhereError) as refused:
        secure.start({"router": 1})
    assert refused.value.theirs == "127.0.0.1:9092" and [w.stage for w in refused.value.workers] == ["router"]
    assert [w.pid for w in secure.workers()] == [os.getpid()]  # nothing stopped, nothing spawned


def test_a_pid_file_that_names_no_broker_is_not_reused(tmp_path):
    _record_worker(tmp_path, None)
    with pytest.raises(WorkersElsewhereError, match="do not name"):
        Supervisor(_settings(tmp_path), env={}).check_broker()


def test_up_secure_refuses_at_once_naming_what_to_stop(tmp_path):
    _record_worker(tmp_path, "127.0.0.1:9092")  # the workers of a plain `mmstream up`
    done = run_cli("up", "--secure", env={"MMSTREAM_LOCAL_STATE_DIR": str(tmp_path)})
    assert done.returncode == 2
    sentence = one_sentence(done.stderr)
    assert "127.0.0.1:9092" in sentence and "127.0.0.1:9094" in sentence and "`mmstream down`" in sentence
    assert not (tmp_path / "kafka-secure" / "broker.json").exists()  # no broker was started


def test_up_refuses_while_the_secure_stacks_workers_run(tmp_path):
    _record_worker(tmp_path, "127.0.0.1:9094")
    done = run_cli("up", env={"MMSTREAM_LOCAL_STATE_DIR": str(tmp_path)})
    assert done.returncode == 2
    sentence = one_sentence(done.stderr)
    assert "the secure broker 127.0.0.1:9094 (`mmstream up --secure`)" in sentence, sentence
    assert "`mmstream down`" in sentence
    assert not (tmp_path / "kafka" / "broker.json").exists()


def test_tenant_commands_find_the_local_secure_broker_while_it_runs(tmp_path, monkeypatch):
    for var in [v for v in os.environ if v.startswith("MMSTREAM_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("MMSTREAM_LOCAL_STATE_DIR", str(tmp_path))
    settings = Settings.from_env()
    assert commands._service_settings(settings, ROOT) is settings  # nothing runs: as the environment says
    broker = secure_kafka(settings, ROOT)
    procs.write_pid_file(broker.pid_file, os.getpid(), run_id="x", bootstrap=broker.bootstrap)  # "it runs"
    found = commands._service_settings(settings, ROOT).kafka
    assert (found.bootstrap, found.security_protocol, found.username) == ("127.0.0.1:9094", "SASL_SSL", "mmstream")
    assert found.password.get_secret_value() == broker.service_password()
    named = Settings.from_env({**os.environ, **broker.env(), "MMSTREAM_KAFKA_USERNAME": "ops"})
    assert commands._service_settings(named, ROOT) is named  # the environment names a SASL broker: it wins


def test_the_secure_brokers_format_step_gets_its_password_from_a_private_file_not_its_command_line(tmp_path,
                                                                                                 monkeypatch):
    from mmstream.localstack import kafka

    broker = secure_kafka(_settings(tmp_path), ROOT)
    monkeypatch.setattr(broker, "ensure_certificates", lambda: None)
    seen = {}

    class Formatted(Exception):
        pass

    def run_tool(argv, what, timeout_s, **kw):
        argfile = Path(argv[-1][1:])
        seen.update(argv=list(argv), text=argfile.read_text(), mode=argfile.stat().st_mode & 0o777, path=argfile)
        raise Formatted

    monkeypatch.setattr(kafka.procs, "run_tool", run_tool)
    with pytest.raises(Formatted):
        broker._launch("java", tmp_path / "libs")
    password = broker.service_password()
    assert password not in " ".join(seen["argv"]) and len(seen["argv"]) == 2 and seen["argv"][1].startswith("@")
    assert f'"SCRAM-SHA-512=[name=mmstream,password={password}]"' in seen["text"].splitlines()
    assert '"kafka.tools.StorageTool"' in seen["text"] and seen["mode"] == 0o600
    assert not seen["path"].exists()  # removed once the step is over, even when it failed
