"""The command line, run as a real process."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from proxy.config import ENV_HOST, parse_config
from proxy.errors import ConfigError
from tests.servers import ROOT, free_port


def cli(
    *args: str, stdin: bytes = b"", env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy.cli", *args],
        input=stdin.decode(),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", **(env or {})},
    )


EXAMPLES = sorted((ROOT / "config").glob("*.yaml"))
# What the examples in config/ read from the environment.
EXAMPLE_ENV = {
    "TOOL_PROXY_CLIENT_SECRET": "example-client-secret",
    "TOOL_PROXY_TOKEN_CACHE_KEY": "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=",
    "TOOL_PROXY_SEALING_KEY": "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=",
}


def test_config_holds_the_example_deployments() -> None:
    assert {p.stem for p in EXAMPLES} >= {
        "standalone-sqlite",
        "sidecar",
        "redis-offload-s3",
        "auth-token-exchange",
        "postgres",
        "redis-cluster",
        "redis-sentinel",
    }


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_example_configuration_passes_check_config(example: Path) -> None:
    result = cli("check-config", str(example), env=EXAMPLE_ENV)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok: ")


def write(tmp_path: Path, config: object) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


GOOD = {
    "store": {"url": "memory://"},
    "routes": [
        {
            "name": "t",
            "path_prefix": "/t",
            "upstream": "http://127.0.0.1:9",
            "idempotency": {"lock_ttl": "2m"},
        }
    ],
}


def test_check_config_accepts_a_valid_file(tmp_path: Path) -> None:
    result = cli("check-config", write(tmp_path, GOOD))
    assert result.returncode == 0
    assert "1 route(s), 1 guarded" in result.stdout


def test_check_config_lists_every_problem(tmp_path: Path) -> None:
    bad = {
        "store": {"url": "mysql://x"},
        "colour": "blue",
        "routes": [
            {
                "name": "t",
                "path_prefix": "/t",
                "upstream": "not a url",
                "timeout": "soon",
                "idempotency": {"methods": ["POST"], "lock": 1},
            }
        ],
    }
    result = cli("check-config", write(tmp_path, bad))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    for expected in (
        "store.url:",
        "colour: unknown key",
        "routes[0].upstream: not an absolute",
        "routes[0].timeout: not a duration",
        "routes[0].idempotency.lock: unknown key",
    ):
        assert expected in result.stderr


def test_check_config_names_durability_on_a_store_without_replicas(tmp_path: Path) -> None:
    config = {**GOOD, "store": {"url": "memory://", "durability": {"replicas": 1}}}
    result = cli("check-config", write(tmp_path, config))
    assert result.returncode == 2
    assert "store.durability: only for Redis stores" in result.stderr
    redis = {"url": "redis+sentinel://s:26379/m", "durability": {"replicas": 1}}
    assert cli("check-config", write(tmp_path, {**GOOD, "store": redis})).returncode == 0


def test_check_config_on_unreadable_or_broken_files(tmp_path: Path) -> None:
    missing = cli("check-config", str(tmp_path / "absent.yaml"))
    assert missing.returncode == 2 and "cannot read" in missing.stderr
    broken = tmp_path / "broken.yaml"
    broken.write_text("routes: [unclosed")
    result = cli("check-config", str(broken))
    assert result.returncode == 2 and "not valid YAML" in result.stderr
    assert "Traceback" not in result.stderr + missing.stderr


def test_key_prints_the_composite_key() -> None:
    """Checked against the shared test vectors (what every client computes), not against
    the function the command calls."""
    vectors = json.loads((ROOT / "clients" / "test-vectors" / "keys.json").read_text())
    vector = vectors["vectors"][0]
    body = json.dumps(dict(reversed(vector["arguments"].items())), indent=2).encode()
    result = cli("key", "--plan", vector["plan"], "--step", str(vector["step"]), stdin=body)
    assert result.returncode == 0
    assert result.stdout.strip() == vector["key"]
    body = b'{"b": 1, "a": "x"}'
    python = cli(
        "key", "--plan", "p", "--step", "1", "--canonicalization", "python-json", stdin=body
    )
    args_hash = hashlib.sha256(b'{"a":"x","b":1}').hexdigest()  # sorted, no spaces
    assert python.stdout.strip() == f"p:1:{args_hash}"


def test_key_names_the_bad_field() -> None:
    result = cli("key", "--plan", "has space", "--step", "1")
    assert result.returncode == 2
    assert "--plan: must be 1..128 characters" in result.stderr
    big = cli("key", "--plan", "p", "--step", "1", stdin=b'{"n": 12345678901234567890}')
    assert big.returncode == 2 and "stdin:" in big.stderr and "Traceback" not in big.stderr


def test_serve_refuses_memory_store_with_several_workers(tmp_path: Path) -> None:
    result = cli(
        "serve", "--config", write(tmp_path, GOOD), "--workers", "2", "--port", str(free_port())
    )
    assert result.returncode == 2
    assert "--workers" in result.stderr and "memory://" in result.stderr


def test_serve_refuses_an_invalid_config(tmp_path: Path) -> None:
    result = cli("serve", "--config", write(tmp_path, {"routes": []}))
    assert result.returncode == 2
    assert "routes:" in result.stderr


POSITIVE = "--graceful-timeout: must be a positive, finite number of seconds"
PORT = "--port: must be a port number from 1 to 65535"
HOST = "--host: not a host name or an IP address (no scheme, port or path)"


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--graceful-timeout", "nan"], POSITIVE),
        (["--graceful-timeout", "inf"], POSITIVE),
        (["--graceful-timeout", "1e400"], POSITIVE),
        (["--graceful-timeout", "0"], POSITIVE),
        (["--port", "70000"], PORT),
        (["--port", "-1"], PORT),
        (["--port", "0"], PORT),
        (["--host", "\udcff"], HOST),  # a byte 0xff from the shell
        (["--host", "http://127.0.0.1"], HOST),
        (["--host", "127.0.0.1:8080"], HOST),
        (["--host", "[::1]"], "--host: write an IPv6 address without brackets: '::1'"),
        (["--host", ""], "--host: empty"),
    ],
)
def test_serve_names_a_bad_flag_before_it_listens(
    flags: list[str], expected: str, tmp_path: Path
) -> None:
    """Each was a traceback (NaN, infinity, a host the idna codec refuses), a port that
    uvicorn said it listened on but did not (70000 is 4464), or the file's port (0)."""
    result = cli("serve", "--config", write(tmp_path, GOOD), *flags, timeout=20)
    assert result.returncode == 2, result.stderr
    assert f"error: {expected}" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1",
        "0.0.0.0",
        "::",
        "::1",
        "fe80::1%eth0",
        "localhost",
        "tool-proxy.tools.svc.cluster.local",
        "tool_proxy",  # a container's name
        "example.com.",
    ],
)
def test_server_host_is_a_host_name_or_an_ip_address(host: str) -> None:
    assert parse_config({**GOOD, "server": {"host": host}}, env={}).server.host == host


@pytest.mark.parametrize(
    "host",
    ["http://localhost", "localhost:8080", "localhost/", "[::1]", "", "a b", "999.1.1.1", "-a.b"],
)
def test_check_config_names_a_server_host_that_is_not_one(host: str) -> None:
    """``server.host: http://localhost`` passed, and serve failed on "Name or service not
    known" without saying where the name came from."""
    for config, env in (({**GOOD, "server": {"host": host}}, {}), (GOOD, {ENV_HOST: host})):
        if not host and env:
            continue  # an empty TOOL_PROXY_HOST is not set
        with pytest.raises(ConfigError) as caught:
            parse_config(config, env=env)
        named = f"server.host (from {ENV_HOST})" if env else "server.host"
        assert [p.split(":")[0] for p in caught.value.problems] == [named]


def test_check_config_names_the_server_host(tmp_path: Path) -> None:
    result = cli("check-config", write(tmp_path, {**GOOD, "server": {"host": "http://localhost"}}))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "error: server.host: not a host name or an IP address" in result.stderr


def _secret_configs(path: str) -> list[tuple[dict[str, Any], str]]:
    """A configuration reading the secret at ``path`` and the field it is read for: the
    admin token, a route's client secret."""
    token = {
        "mode": "client_credentials",
        "token_endpoint": "https://idp.example/token",
        "client_id": "tool-proxy",
        "client_secret_file": path,
    }
    routed = {**GOOD, "routes": [{**GOOD["routes"][0], "token": token}]}  # type: ignore[index]
    return [
        ({**GOOD, "admin": {"token_file": path}}, "admin.token_file: "),
        (routed, "routes[0].token.client_secret_file: "),
    ]


def test_check_config_names_a_secret_file_that_is_not_text(tmp_path: Path) -> None:
    """A file of random bytes (``openssl rand 32 > FILE``) and a path holding a NUL byte
    were a UnicodeDecodeError and a ValueError."""
    binary = tmp_path / "random"
    binary.write_bytes(b"\xff\xfe" + bytes(range(30)))
    for path, said in (
        (str(binary), f"{binary} is not UTF-8 text (byte 0)"),
        (f"{tmp_path}/a\x00b", "cannot be read (the path holds a NUL byte)"),
    ):
        for config, field in _secret_configs(path):
            result = cli("check-config", write(tmp_path, config))
            assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
            assert f"error: {field}" in result.stderr and said in result.stderr


def test_check_config_names_a_secret_variable_that_is_not_text(tmp_path: Path) -> None:
    """Bytes that are not UTF-8 in the environment (lone surrogates to Python) could be no
    request's bearer token or form field."""
    token = {
        "mode": "client_credentials",
        "token_endpoint": "https://idp.example/token",
        "client_id": "tool-proxy",
        "client_secret_env": "TP_SECRET",
    }
    for config, field in (
        ({**GOOD, "admin": {"token_env": "TP_SECRET"}}, "admin.token_env"),
        ({**GOOD, "routes": [{**GOOD["routes"][0], "token": token}]}, "routes[0].token."),  # type: ignore[index]
    ):
        result = cli("check-config", write(tmp_path, config), env={"TP_SECRET": "s\udcff"})
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        expected = f"{field}client_secret_env" if field.endswith(".") else field
        assert f"error: {expected}: environment variable TP_SECRET is not UTF-8" in result.stderr


ASYNC_ROUTE = {**GOOD["routes"][0], "async": {"credentials": "clear"}}  # type: ignore[index]


@pytest.mark.parametrize(
    ("command", "url"),
    [
        (command, url)
        for command in ("records", "operations", "serve")
        for url in ("redis://h:abc/0", "rediss://h:6379/0?ssl_cert_reqs=bogus")
    ]
    + [(command, "sqlite:///tmp/a\x00b.db") for command in ("records", "operations", "serve")],
)
def test_a_store_url_no_store_is_made_of_is_named(command: str, url: str, tmp_path: Path) -> None:
    """Its store's own error (a port that is not a number, a NUL byte in the path) was a
    traceback; the configuration's checks may name it first, this is the last line."""
    config = write(tmp_path, {"store": {"url": url}, "routes": [ASYNC_ROUTE]})
    argv = ["serve", "--config", config] if command == "serve" else [command, "list"]
    result = cli(*argv, "--config", config, timeout=20)
    assert result.returncode == 2, result.stderr
    assert "error: store.url: " in result.stderr and "Traceback" not in result.stderr


def test_demo_lines_work_in_a_fresh_shell_and_its_console_shows_the_plan() -> None:
    demo = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "proxy.cli",
            "demo",
            "--port",
            str(free_port()),
            "--tool-port",
            str(free_port()),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin"},
    )
    try:
        assert demo.stdout is not None
        lines: list[str] = []
        while not (lines and lines[-1].lstrip().startswith(sys.executable.rpartition("/")[0])):
            line = demo.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
        text = "".join(lines)
        console = re.search(r"The operator console: (\S+)", text)
        token = re.search(r"sign in with the admin token (\S+)", text)
        assert console is not None and token is not None, text
        page = httpx.get(console.group(1), headers={"Authorization": f"Bearer {token.group(1)}"})
        assert page.status_code == 200 and "Step 1" in page.text and "state-completed" in page.text
        typed = text.split("Try it yourself (Ctrl-C to stop):\n")[1]
        shell = subprocess.run(
            ["bash", "-e", "-c", typed + "\n"],
            capture_output=True,
            text=True,
            timeout=30,
            env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"},
        )
        assert shell.returncode == 0, shell.stderr
        assert "HTTP/1.1 201" in shell.stdout and '"plan": "my-plan"' in shell.stdout
    finally:
        demo.terminate()
        demo.communicate(timeout=20)


def test_demo_shows_a_conflict_and_a_replay() -> None:
    result = cli("demo", "--once", "--port", str(free_port()), "--tool-port", str(free_port()))
    assert result.returncode == 0, result.stderr
    assert "-> 409, Retry-After: 1" in result.stdout
    assert "-> 201, Idempotent-Replayed: true" in result.stdout
    assert "executed the charge 1 time(s)" in result.stdout
