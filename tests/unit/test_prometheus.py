"""The Prometheus configs and rules as promtool reads them: `promtool check config` and
`check rules`, and the alert unit tests in infra/prometheus/alerts.test.yml (`promtool test
rules`). promtool comes from Debian's `prometheus` package (infra/system-deps.sh installs it);
without it these tests skip on a developer's machine and fail in CI (CI=true)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "infra" / "prometheus"


@pytest.fixture(scope="module")
def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("promtool is missing in CI: infra/system-deps.sh installs it (Debian package prometheus)")
        pytest.skip("promtool not installed (apt-get install prometheus; infra/system-deps.sh does it as root)")
    return found


def run(promtool: str, *args: str, cwd: Path = ROOT) -> str:
    res = subprocess.run([promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"promtool {' '.join(args)}:\n{res.stdout}\n{res.stderr}"
    return res.stdout + res.stderr


def test_rules_are_valid(promtool):
    assert "SUCCESS" in run(promtool, "check", "rules", str(PROMETHEUS / "alerts.yml"))


def test_alert_rule_unit_tests_pass(promtool):
    assert "SUCCESS" in run(promtool, "test", "rules", "alerts.test.yml", cwd=PROMETHEUS)


def test_every_alert_has_a_unit_test_or_is_trivial():
    import yaml

    rules = [r for g in yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"] for r in g["rules"]]
    tests = (PROMETHEUS / "alerts.test.yml").read_text()
    untested = {r["alert"] for r in rules if "alert" in r and f"alertname: {r['alert']}" not in tests}
    # Rate-of-counter alerts whose expression is one comparison; the rest must be tested.
    assert untested <= {"MmstreamDeadLetters", "MmstreamInteractiveShed", "MmstreamInteractiveLatencyHigh"}, untested


@pytest.mark.parametrize("config", ["infra/prometheus/prometheus.yml", "docker/prometheus.yml"])
def test_scrape_configs_are_valid(promtool, tmp_path, config):
    # Each config names alerts.yml beside it (compose mounts it there): check it that way.
    shutil.copy(ROOT / config, tmp_path / "prometheus.yml")
    shutil.copy(PROMETHEUS / "alerts.yml", tmp_path / "alerts.yml")
    (tmp_path / "targets").mkdir()
    assert "SUCCESS" in run(promtool, "check", "config", str(tmp_path / "prometheus.yml"))
