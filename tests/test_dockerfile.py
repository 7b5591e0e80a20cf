"""The Dockerfile: hadolint, the properties the issue asks for, and its HEALTHCHECK command.

No Docker engine runs in CI, so the image is never built here: these tests lint and read the
Dockerfile, check that its build context holds what the build copies, and run the exact
HEALTHCHECK command against a live proxy.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import helm_python as helm
import pytest
import yaml

from proxy.app import create_app
from proxy.config import parse_config
from tests.servers import ThreadServer, free_port

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
HADOLINT = Path(sys.executable).parent / "hadolint"

Instruction = tuple[str, str]


def instructions(text: str) -> list[Instruction]:
    """(KEYWORD, arguments) per instruction, continuation lines joined, comments dropped."""
    logical: list[str] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        logical.append(pending + stripped)
        pending = ""
    result = []
    for line in logical:
        keyword, _, rest = line.partition(" ")
        result.append((keyword.upper(), rest.strip()))
    return result


def stages() -> list[list[Instruction]]:
    """The instructions of each build stage (the global ARGs before the first FROM dropped)."""
    found: list[list[Instruction]] = []
    for keyword, rest in instructions(DOCKERFILE.read_text()):
        if keyword == "FROM":
            found.append([])
        if found:
            found[-1].append((keyword, rest))
    return found


def last(stage: list[Instruction], keyword: str) -> str:
    values = [rest for k, rest in stage if k == keyword]
    assert values, f"no {keyword} in the stage"
    return values[-1]


def env_of(stage: list[Instruction]) -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, rest in stage:
        if keyword == "ENV":
            for item in shlex.split(rest):
                name, _, value = item.partition("=")
                env[name] = value
    return env


def test_hadolint_finds_nothing() -> None:
    run = subprocess.run(
        [str(HADOLINT), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout == ""


def test_hadolint_does_flag_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install requests\n")
    run = subprocess.run(
        [str(HADOLINT), "--no-color", "--format", "json", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    codes = {finding["code"] for finding in json.loads(run.stdout)}
    assert run.returncode != 0
    assert {"DL3007", "DL3042"} <= codes  # `latest`, and pip keeping its cache


def test_multi_stage_on_a_pinned_slim_base() -> None:
    build, runtime = stages()
    assert last(build, "FROM") == "${PYTHON_IMAGE} AS build"
    assert last(runtime, "FROM") == "${PYTHON_IMAGE}"
    (default,) = [
        rest.split("=", 1)[1]
        for keyword, rest in instructions(DOCKERFILE.read_text())
        if keyword == "ARG" and rest.startswith("PYTHON_IMAGE=")
    ]
    assert re.fullmatch(r"python:3\.11\.\d+-slim-[a-z]+", default), default


def test_the_image_installs_the_tracing_extra_by_default() -> None:
    """The OTEL_* variables turn traces on in the image too: the otel extra is installed
    unless the build says otherwise, and it is one of the package's extras."""
    build, _ = stages()
    args = dict(rest.split("=", 1) for k, rest in build if k == "ARG" and "=" in rest)
    assert args["EXTRAS"] == "otel"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "otel" in extras["optional-dependencies"]


def test_the_runtime_stage_holds_only_the_virtualenv() -> None:
    build, runtime = stages()
    build_run = " ".join(rest for k, rest in build if k == "RUN")
    assert 'pip install --no-cache-dir ".${EXTRAS:+[$EXTRAS]}"' in build_run
    assert "pip uninstall --yes pip setuptools" in build_run  # no build tools are carried over
    assert env_of(build)["PIP_NO_CACHE_DIR"] == "1"
    copies = [rest for k, rest in runtime if k == "COPY"]
    assert copies == ["--from=build /opt/venv /opt/venv"]
    runtime_run = " ".join(rest for k, rest in runtime if k == "RUN")
    assert "pip" not in runtime_run and "apt-get" not in runtime_run


def test_non_root_read_only_friendly_and_serving() -> None:
    _, runtime = stages()
    assert last(runtime, "USER") == "10001:10001"
    assert "--uid 10001" in last(runtime, "RUN")
    assert "chown 10001:10001 /var/lib/tool-proxy" in last(runtime, "RUN")
    assert json.loads(last(runtime, "VOLUME")) == ["/var/lib/tool-proxy", "/tmp"]
    assert json.loads(last(runtime, "ENTRYPOINT")) == ["tool-proxy", "serve"]
    env = env_of(runtime)
    assert env["TOOL_PROXY_CONFIG"] == "/etc/tool-proxy/config.yaml"
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"  # nothing written next to the code
    assert env["PATH"].startswith("/opt/venv/bin:")
    assert last(runtime, "EXPOSE") == "8080"


def healthcheck_command() -> list[str]:
    _, runtime = stages()
    options, _, command = last(runtime, "HEALTHCHECK").partition("CMD ")
    assert "--timeout=3s" in options
    argv: list[str] = json.loads(command)
    return argv


def test_healthcheck_passes_on_a_live_proxy_and_fails_without_one() -> None:
    argv = healthcheck_command()
    assert argv[0] == "python"
    _, runtime = stages()
    url = env_of(runtime)["TOOL_PROXY_HEALTHCHECK_URL"]
    assert url == "http://127.0.0.1:8080/_proxy/healthz"

    config = parse_config(
        {"store": {"url": "memory://"}, "routes": [route()]},
        env={},
    )
    server = ThreadServer(create_app(config)).start()
    try:
        live = url.replace(":8080/", f":{server.port}/")
        assert probe(argv, live).returncode == 0
    finally:
        server.stop()
    closed = url.replace(":8080/", f":{free_port()}/")
    assert probe(argv, closed).returncode != 0


def route() -> dict[str, str]:
    return {"name": "t", "path_prefix": "/t", "upstream": "http://127.0.0.1:9"}


def probe(argv: list[str], url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *argv[1:]],
        env={**os.environ, "TOOL_PROXY_HEALTHCHECK_URL": url},
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_the_build_context_holds_what_the_build_copies() -> None:
    build, _ = stages()
    sources = [s for k, rest in build if k == "COPY" for s in rest.split()[:-1]]
    assert sources == ["pyproject.toml", "README.md", "proxy"]
    for source in sources:
        assert (ROOT / source).exists(), source
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["readme"] in sources  # the build reads it
    allowed = [
        line[1:].rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    ]
    assert sorted(allowed) == sorted(sources)


@pytest.fixture(scope="module")
def chart_defaults() -> dict[str, object]:
    with helm.Chart.load(ROOT / "helm" / "tool-proxy") as chart:
        return {"values": chart.values, "appVersion": chart.metadata["appVersion"]}


def test_the_chart_matches_the_image(chart_defaults: dict[str, object]) -> None:
    values = chart_defaults["values"]
    assert isinstance(values, dict)
    assert values["containerSecurityContext"]["runAsUser"] == 10001
    assert values["podSecurityContext"]["fsGroup"] == 10001
    assert values["containerPort"] == 8080
    assert values["store"]["sqlite"]["path"].startswith("/var/lib/tool-proxy/")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert chart_defaults["appVersion"] == pyproject["project"]["version"]
    _, runtime = stages()
    assert last(runtime, "ARG") == f"VERSION={pyproject['project']['version']}"
    assert yaml.safe_load((ROOT / "helm" / "tool-proxy" / "Chart.yaml").read_text())["name"] == (
        "tool-proxy"
    )
