"""pyproject.toml and the Makefile install what the code needs, no more: a build backend
that understands the license string, report-only plotting in its own extra."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _names(reqs: list[str]) -> set[str]:
    return {r.split("==")[0].split(">=")[0].split("<")[0].strip().lower() for r in reqs}


def test_the_build_backend_understands_an_spdx_license_string():
    assert isinstance(PYPROJECT["project"]["license"], str)  # SPDX expression: setuptools >= 77
    (setuptools,) = [r for r in PYPROJECT["build-system"]["requires"] if r.startswith("setuptools")]
    major = int(setuptools.split(">=")[1].split(".")[0])
    assert major >= 77


def test_plots_are_a_report_extra_and_make_installs_it():
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert "matplotlib" not in _names(PYPROJECT["project"]["dependencies"])
    assert "matplotlib" in _names(extras["report"])
    makefile = (ROOT / "Makefile").read_text()
    assert "-e '.[build,test,report]'" in makefile


def test_settings_library_is_pinned():
    deps = PYPROJECT["project"]["dependencies"]
    assert any(d.startswith("pydantic-settings==") for d in deps) and any(d.startswith("pydantic==") for d in deps)
