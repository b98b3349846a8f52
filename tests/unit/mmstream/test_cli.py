"""The command line as a person meets it: every mistake is one sentence and a non-zero exit,
never a traceback; every command and flag has help; noisy exporters stay in a log file."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mmstream import cli, commands
from tests.unit.workers.test_model_repository import config_dict, write

ROOT = Path(__file__).resolve().parents[3]


def run_cli(*argv: str, env: dict[str, str] | None = None, stdout: int | None = subprocess.PIPE,
            timeout: float = 60) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MMSTREAM_")}
    full_env.update({"PYTHONPATH": str(ROOT), **(env or {})})
    return subprocess.run([sys.executable, "-m", "mmstream.cli", *argv], env=full_env, stdout=stdout,
                          stderr=subprocess.PIPE, text=True, timeout=timeout, cwd=ROOT)


def one_sentence(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("mmstream: ") and "Traceback" not in stderr
    return lines[0]


def subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    found = {}
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found[name] = sub
                found.update({f"{name} {k}": v for k, v in subparsers(sub).items()})
    return found


def test_every_command_and_flag_has_help():
    p = cli.parser()
    commands_ = subparsers(p)
    assert {"up", "down", "status", "config", "worker", "send", "demo", "bench", "top", "models build",
            "models list"} <= set(commands_)
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            assert all(c.help for c in action._choices_actions), "a command without help"
    for name, sub in commands_.items():
        for action in sub._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            assert action.help and action.help != argparse.SUPPRESS, f"{name} {action.option_strings or action.dest}"


def test_every_command_and_flag_is_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    for name, sub in subparsers(cli.parser()).items():
        assert f"mmstream {name}" in readme, f"README does not show `mmstream {name}`"
        for action in sub._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and flag not in ("--help", "--debug"):
                    assert flag in readme, f"README does not mention {name} {flag}"
    assert "--version" in readme and "--debug" in readme


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("mmstream ")


def test_a_mistyped_setting_is_one_sentence_with_the_closest_name():
    res = run_cli("status", env={"MMSTREAM_KAFKA_BOOTSTAP": "k:1"})
    assert res.returncode == 2
    assert one_sentence(res.stderr) == ("mmstream: MMSTREAM_KAFKA_BOOTSTAP is not a setting; "
                                        "did you mean MMSTREAM_KAFKA_BOOTSTRAP?")


def test_config_check():
    ok = run_cli("config", "--check", env={"MMSTREAM_KAFKA_PARTITIONS": "8"})
    assert ok.returncode == 0 and ok.stdout.startswith("ok: ") and "MMSTREAM_KAFKA_PARTITIONS" in ok.stdout
    bad = run_cli("config", "--check", env={"MMSTREAM_KAFKA_PARTITIONS": "-3"})
    assert bad.returncode == 2
    assert "MMSTREAM_KAFKA_PARTITIONS='-3'" in one_sentence(bad.stderr)


def test_config_never_prints_a_password():
    res = run_cli("config", env={"MMSTREAM_REDIS_URL": "redis://app:hunter2@cache:6379/0"})
    assert res.returncode == 0 and "hunter2" not in res.stdout and "redis://app:***@cache:6379/0" in res.stdout


def test_a_closed_pipe_is_not_a_traceback():
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line, as with `| head -0`
    try:
        res = run_cli("config", stdout=write_end)
    finally:
        os.close(write_end)
    assert res.returncode == cli.EXIT_PIPE and res.stderr == ""


def test_an_unreachable_broker_is_one_sentence():
    res = run_cli("send", "--text", "hi", env={"MMSTREAM_KAFKA_BOOTSTRAP": "127.0.0.1:1"})
    assert res.returncode == 1
    line = one_sentence(res.stderr)
    assert "cannot reach Kafka at 127.0.0.1:1" in line and "Unclosed" not in res.stderr


@pytest.mark.parametrize("content, says", [
    (None, "no such file"),
    ('{"parts": [', "is not valid JSON: Expecting value at line 1 column 12"),
    ("[1, 2]", "holds a JSON list, not a request object"),
    (b"\xff\xfe", "is not UTF-8 text"),
])
def test_a_missing_or_malformed_json_request_is_one_sentence(tmp_path, capsys, content, says):
    path = tmp_path / "request.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    assert cli.main(["send", "--json", str(path)]) == cli.EXIT_USAGE
    assert says in one_sentence(capsys.readouterr().err)


def test_debug_shows_the_traceback(tmp_path, capsys):
    assert cli.main(["send", "--debug", "--json", str(tmp_path / "nope.json")]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "Traceback" in err and err.rstrip().endswith("no such file")


def test_an_unforeseen_failure_is_one_sentence(monkeypatch, capsys):
    def boom(*_: object) -> int:
        raise RuntimeError("something broke")

    monkeypatch.setitem(commands.__dict__, "cmd_status", boom)
    assert cli.main(["status"]) == cli.EXIT_FAILED
    assert one_sentence(capsys.readouterr().err) == ("mmstream: unexpected RuntimeError: something broke "
                                                     "(--debug shows the traceback)")


def test_models_list_shows_variants_and_fidelity(tmp_path, monkeypatch, capsys):
    write(tmp_path, config_dict())
    monkeypatch.setenv("MMSTREAM_MODELS_REPOSITORY", str(tmp_path))
    assert cli.main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("tiny 1") and "fp32" in out


def test_models_build_prints_one_line_per_model_and_keeps_the_noise_in_a_log(tmp_path, monkeypatch, capfd):
    from workers.models import build

    def noisy_build(root, names, force=False, log=print, target="cpu"):
        for i in range(800):
            print(f"[torch.onnx] step {i}")
            logging.getLogger("onnxscript").info("rewrite %d", i)
        os.write(2, b"C++ says hello\n")
        return [build.BuildReport(names[0], "1", "built", 1.0, Path(root), "key", {})]

    monkeypatch.setattr(build, "build_models", noisy_build)
    monkeypatch.setenv("MMSTREAM_LOCAL_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("MMSTREAM_MODELS_REPOSITORY", str(tmp_path / "models"))
    assert cli.main(["models", "build"]) == 0
    out, err = capfd.readouterr()
    lines = out.splitlines()
    assert len(lines) == len(build.RECIPES) and all("built (1 s)" in line for line in lines), out
    assert "torch.onnx" not in out + err and "C++" not in out + err
    noise = (tmp_path / "models-build.log").read_text()
    assert "[torch.onnx] step 799" in noise and "rewrite 799" in noise and "C++ says hello" in noise


def test_models_build_names_an_unknown_model(capsys):
    assert cli.main(["models", "build", "--only", "gpt-9"]) == cli.EXIT_USAGE
    assert "unknown model gpt-9" in one_sentence(capsys.readouterr().err)
