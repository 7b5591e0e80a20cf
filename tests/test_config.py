from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from proxy.config import (
    DEFAULT_LOCK_TTL,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_JSON_DEPTH,
    DEFAULT_STORE_URL,
    ENV_CONFIG,
    ENV_STORE_URL,
    MAX_JSON_DEPTH_LIMIT,
    load_config,
    parse_config,
    parse_duration,
    parse_wait,
)
from proxy.config.idempotency import MIN_LOCK_TTL
from proxy.errors import ConfigError

ROUTE = {"name": "r", "path_prefix": "/r/", "upstream": "http://h:1/base/"}


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        (5, 5.0),
        (0.25, 0.25),
        ("250ms", 0.25),
        ("5s", 5.0),
        ("2m", 120.0),
        ("24h", 86400.0),
        ("7d", 604800.0),
        ("1.5s", 1.5),
    ],
)
def test_durations(text: object, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    "text",
    [
        "",
        "5",
        "5 parsecs",
        "-1s",
        "0s",
        0,
        True,
        None,
        "1w",
        float("nan"),
        float("inf"),
        pytest.param(10**400, id="10**400"),
    ],
)
def test_bad_durations(text: object) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


def test_a_wait_may_be_zero_but_not_negative() -> None:
    assert parse_wait(0) == parse_wait("0s") == parse_wait(-0.0) == 0
    assert parse_wait("250ms") == 0.25
    with pytest.raises(ValueError, match="a wait must be zero or more"):
        parse_wait(-1)
    with pytest.raises(ValueError, match="finite"):
        parse_wait(10**400)


def test_a_huge_number_of_seconds_in_yaml_is_not_a_duration(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    huge = "1" + "0" * 400
    path.write_text(
        f"routes:\n  - {{name: r, path_prefix: /r, upstream: http://h, timeout: {huge}}}\n"
    )
    with pytest.raises(ConfigError, match=r"routes\[0\]\.timeout: a duration must be a finite"):
        load_config(path, env={})


def test_defaults() -> None:
    config = parse_config({"routes": [{**ROUTE, "idempotency": {}}]}, env={})
    assert config.store.url == DEFAULT_STORE_URL
    route = config.routes[0]
    assert route.path_prefix == "/r" and route.upstream == "http://h:1/base"
    assert route.idempotency is not None
    assert route.idempotency.lock_ttl == DEFAULT_LOCK_TTL
    assert route.idempotency.methods == ("POST", "PATCH")
    assert route.idempotency.conflict_wait == 0


def test_every_problem_is_reported_with_its_field() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(
            {
                "server": {"port": 70000},
                "limits": {"max_body_bytes": -1},
                "routes": [
                    {
                        **ROUTE,
                        "idempotency": {
                            "key": "uuid",
                            "canonicalization": "xml",
                            "lock_ttl": "1h",
                            "result_ttl": "1m",
                        },
                    },
                    {"name": "r", "path_prefix": "/_proxy/x", "upstream": "http://h"},
                ],
            },
            env={},
        )
    problems = caught.value.problems
    fields = [p.split(":", 1)[0] for p in problems]
    assert "server.port" in fields
    assert "limits.max_body_bytes" in fields
    assert "routes[0].idempotency.key" in fields
    assert "routes[0].idempotency.canonicalization" in fields
    assert "routes[1].path_prefix" in fields


def test_cross_field_checks() -> None:
    with pytest.raises(ConfigError, match="result_ttl must be at least lock_ttl"):
        parse_config(
            {"routes": [{**ROUTE, "idempotency": {"lock_ttl": "1h", "result_ttl": "1m"}}]}, env={}
        )
    with pytest.raises(ConfigError, match=r"routes\[1\].name: 'r' is used by another route"):
        parse_config({"routes": [ROUTE, {**ROUTE, "path_prefix": "/other"}]}, env={})


def test_a_file_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_bytes(b"\xff\xferoutes: []\n")
    with pytest.raises(ConfigError, match=r"config\.yaml: not UTF-8 text \(byte 0\)"):
        load_config(path, env={})


def test_missing_routes_and_non_mapping() -> None:
    with pytest.raises(ConfigError, match="routes: required"):
        parse_config({}, env={})
    with pytest.raises(ConfigError, match="must be a mapping"):
        parse_config(["routes"], env={})
    with pytest.raises(ConfigError, match=r"^\(top level\): the configuration is empty$"):
        parse_config(None, env={})


@pytest.mark.parametrize("text", ["", "# routes: to come\n", "---\n"])
def test_an_empty_file_is_said_to_be_empty(tmp_path: Path, text: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"c\.yaml: the file is empty"):
        load_config(path, env={})


def test_environment_overrides(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "store: {url: memory://}\nroutes:\n  - {name: r, path_prefix: /r, upstream: http://h}\n"
    )
    env = {ENV_CONFIG: str(path), ENV_STORE_URL: "redis://cache:6379/1"}
    assert load_config(env=env).store.url == "redis://cache:6379/1"
    with pytest.raises(ConfigError, match="no configuration"):
        load_config(env={})
    with pytest.raises(ConfigError, match=r"^store\.url \(from TOOL_PROXY_STORE_URL\): must be"):
        load_config(path, env={ENV_STORE_URL: "mysql://x"})  # postgres:// is a store now


def test_input_limits_have_defaults_and_bounds() -> None:
    limits = parse_config({"routes": [ROUTE]}, env={}).limits
    assert limits.max_json_depth == DEFAULT_MAX_JSON_DEPTH
    assert limits.max_header_bytes == DEFAULT_MAX_HEADER_BYTES
    bad = {"max_json_depth": MAX_JSON_DEPTH_LIMIT + 1, "max_header_bytes": 100}
    with pytest.raises(ConfigError) as caught:
        parse_config({"routes": [ROUTE], "limits": bad}, env={})
    fields = " ".join(caught.value.problems)
    assert "limits.max_json_depth" in fields
    assert "limits.max_header_bytes" in fields


def test_a_key_given_twice_is_refused_with_its_lines(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "routes:\n"
        "  - name: a\n"
        "    path_prefix: /a\n"
        "    upstream: http://h:1\n"
        "    upstream: http://h:2\n"
        "    idempotency: {lock_ttl: 5s, lock_ttl: 6s}\n"
        "routes:\n"
        "  - {name: b, path_prefix: /b, upstream: http://h}\n"
    )
    with pytest.raises(ConfigError) as caught:
        load_config(path, env={})
    assert caught.value.problems == [
        f"{path}: line 5: duplicate key 'upstream' (first on line 4): "
        "YAML would keep only the last; write it once",
        f"{path}: line 6: duplicate key 'lock_ttl' (first on line 6): "
        "YAML would keep only the last; write it once",
        f"{path}: line 7: duplicate key 'routes' (first on line 1): "
        "YAML would keep only the last; write it once",
    ]


def test_merge_keys_still_work_and_may_be_overridden(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "routes:\n"
        "  - &a {name: a, path_prefix: /a, upstream: http://h, timeout: 5s}\n"
        "  - &b {<<: *a, name: b, path_prefix: /b, timeout: 7s, idempotency: {}}\n"
        "  - {<<: *b, name: c, path_prefix: /c}\n"
        "  - <<: [*a]\n"
        "    name: d\n"
        "    path_prefix: /d\n"
    )
    routes = load_config(path, env={}).routes
    assert [(r.name, r.path_prefix, r.timeout) for r in routes] == [
        ("a", "/a", 5.0),
        ("b", "/b", 7.0),
        ("c", "/c", 7.0),
        ("d", "/d", 5.0),
    ]
    assert [r.idempotency is not None for r in routes] == [False, True, True, False]


@pytest.mark.parametrize(
    ("value", "kind"),
    [("1" + "0" * 5000, "int"), ("2024-13-45", "timestamp"), ("!!float x", "float")],
)
def test_a_value_yaml_cannot_read_is_named_with_its_line(
    tmp_path: Path, value: str, kind: str
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"routes:\n  - name: {value}\n")
    with pytest.raises(ConfigError, match=rf"(?s)not valid YAML: not a valid {kind}: .*line 2"):
        load_config(path, env={})


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("redis://h:abc/0", "Port could not be cast to integer value as 'abc'"),
        ("redis://h:70000/0", "Port out of range"),
        ("redis://[::1", "Invalid IPv6 URL"),
        ("redis+cluster://[::1:1", "Invalid IPv6 URL"),
        ("redis+cluster://h:1,h:70000", "Port out of range"),
        ("redis://localhost/0?socket_timeout=abc", "Invalid value for 'socket_timeout'"),
        ("redis://localhost/0?sockettimeout=1", "unknown query parameter 'sockettimeout'"),
        ("redis+sentinel://s:26379/m?bogus=1", "unknown query parameter 'bogus'"),
        ("rediss://h/0?ssl_cert_reqs=bogus", "Invalid SSL Certificate Requirements Flag"),
        ("redis://localhost/abc", r"the path is the database's number \(/0\), not /abc"),
        ("sqlite:///tmp/y.db?synchronous=bogus", "synchronous must be one of full, normal"),
        ("sqlite:///tmp/y.db?synchronus=normal", "unknown query parameter 'synchronus'"),
        ("sqlite://?synchronous=normal", "needs a file path"),
        ("sqlite:///tmp/a\x00b.db", "the file path holds a NUL byte"),
        ("postgresql://u@h:notaport/db", "Port could not be cast to integer value as 'notaport'"),
        ("postgresql://h1:5432,h2:x/db", "Port could not be cast to integer value as 'x'"),
        ("postgres://[::1/db", "Invalid IPv6 URL"),
    ],
)
def test_a_store_url_its_store_cannot_use_is_named(url: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=rf"^store\.url: .*{problem}"):
        parse_config({"store": {"url": url}, "routes": [ROUTE]}, env={})


@pytest.mark.parametrize(
    "url",
    [
        "redis://localhost",
        "redis://localhost:6379/",
        "rediss://u:p@h:6380/15?socket_timeout=5&ssl_cert_reqs=none",
        "redis://[::1]:6379/2?db=3",
        "redis+cluster://a:1,[::1]:2?socket_timeout=1",
        "rediss+sentinel://:pw@s:26379,t:26380/mymaster",
        "sqlite:///var/lib/x.db?synchronous=normal",
        "sqlite://relative.db",
        "postgresql://u@h1:5432,h2:5433/db?sslmode=require",
        "postgres://db/tp",
    ],
)
def test_store_urls_their_stores_can_use_pass(url: str) -> None:
    assert parse_config({"store": {"url": url}, "routes": [ROUTE]}, env={}).store.url == url


def test_a_section_left_empty_for_its_variable_is_filled_by_it() -> None:
    """``store:`` with its keys commented out and the URL in TOOL_PROXY_STORE_URL (a
    Kubernetes secret, say) loads; without the variable it is the empty section."""
    written = {"store": None, "server": None, "routes": [ROUTE]}
    env = {"TOOL_PROXY_STORE_URL": "memory://", "TOOL_PROXY_HOST": "0.0.0.0"}
    config = parse_config(written, env=env)
    assert (config.store.url, config.server.host) == ("memory://", "0.0.0.0")
    with pytest.raises(ConfigError) as caught:
        parse_config(written, env={})
    assert [p.split(":")[0] for p in caught.value.problems] == ["store", "server"]


def test_a_section_given_empty_is_refused_not_turned_off(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "store:\n"
        "auth:\n"
        "  issuers: [{issuer: https://idp, jwks_url: https://idp/keys, audiences: [x]}]\n"
        "admin:\n"
        "routes:\n"
        "  - name: a\n"
        "    path_prefix: /a\n"
        "    upstream: http://h\n"
        "    auth:\n"
        "      # required: true\n"
        "    idempotency:\n"
        "      # lock_ttl: 5s\n"
        "    limits:\n"
        "    timeout: soon\n"
    )
    with pytest.raises(ConfigError) as caught:
        load_config(path, env={})  # with TOOL_PROXY_STORE_URL, store: is its to fill
    assert caught.value.problems == [
        "store: empty; write {} for the defaults, or remove it",
        "admin: empty; give its keys, or remove it",  # {} is no admin section either
        "routes[0].auth: empty; write {} for the defaults, or remove it",
        "routes[0].idempotency: empty; write {} for the defaults, or remove it",
        "routes[0].limits: empty; write [] for an empty list, or remove it",
        "routes[0].timeout: not a duration: 'soon' (use a number of seconds or 250ms, 5s, 2m)",
    ]
    with pytest.raises(ConfigError) as caught:
        parse_config({"routes": None, "auth": {"issuers": None}}, env={})
    assert caught.value.problems == [
        "routes: empty; at least one entry is needed",
        "auth.issuers: empty; at least one entry is needed",
    ]
    issuer = {"issuer": "https://idp", "discovery": True, "audiences": ["x"]}
    written = {
        "store": {},
        "auth": {"issuers": [issuer]},
        "routes": [{**ROUTE, "auth": {}, "idempotency": {}, "limits": []}],
    }
    route = parse_config(written, env={}).routes[0]
    assert route.auth is not None and route.idempotency is not None and route.limits == ()


def test_a_field_is_named_without_pydantic_tags_or_a_spurious_too_short() -> None:
    mcp = {**ROUTE, "name": "m", "path_prefix": "/m", "protocol": "mcp", "mcp": {"guard": 5}}
    cost = {"name": "l", "rate": "1/1s", "cost": {"request": [1]}}
    with pytest.raises(ConfigError) as caught:
        parse_config({"routes": [{**ROUTE, "limits": [cost], "str": 1}, mcp]}, env={})
    assert caught.value.problems == [
        "routes[0].limits[0].cost.request: Input should be a valid number",
        "routes[0].limits[0].cost.request: Input should be a valid string",
        "routes[0].str: unknown key",
        "routes[1].mcp.guard: Input should be 'all' or 'annotated'",
        "routes[1].mcp.guard: Input should be a valid tuple",
    ]
    with pytest.raises(ConfigError, match=r"^routes: Tuple should have at least 1 item"):
        parse_config({"routes": []}, env={})  # a list that is too short is still said to be
    with pytest.raises(ConfigError, match=r"^store: must be a mapping of its keys, not list$"):
        parse_config({"routes": [ROUTE], "store": [1]}, env={})


@pytest.mark.parametrize("store", ["[1]", "memory"])
def test_an_override_of_a_section_that_is_not_a_mapping_is_an_error(
    tmp_path: Path, store: str
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        f"store: {store}\nserver: [1]\nroutes:\n  - {{name: r, path_prefix: /r, upstream: http://h}}\n"
    )
    env = {ENV_STORE_URL: "memory://", "TOOL_PROXY_HOST": "0.0.0.0"}
    with pytest.raises(ConfigError) as caught:
        load_config(path, env=env)
    kind = "list" if store == "[1]" else "str"
    assert caught.value.problems == [
        f"store: must be a mapping of its keys, not {kind}",
        "server: must be a mapping of its keys, not list",
    ]


def _problems(data: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_config(data, env={})
    return caught.value.problems


ISSUER = {"issuer": "https://idp", "jwks_url": "https://idp/jwks", "audiences": ["a"]}


@pytest.mark.parametrize(
    ("upstream", "problem"),
    [
        ("http://127.0.0.1:99999", "routes[0].upstream: not a port in '127.0.0.1:99999'"),
        ("http://127.0.0.1:abc", "routes[0].upstream: not a port in '127.0.0.1:abc'"),
        ("http://h:0/base", "routes[0].upstream: not a port in 'h:0'"),
        ("http://[::1", "routes[0].upstream: not a URL"),
        ("http://h/a b", "routes[0].upstream: a URL has no spaces or control characters"),
        ("http://h/a\tb", "routes[0].upstream: a URL has no spaces or control characters"),
        ("not a url", "routes[0].upstream: not an absolute http(s) URL"),
        ("http://user:pw@h", "routes[0].upstream: an upstream has no user or password"),
    ],
)
def test_an_upstream_that_cannot_be_sent_to_is_refused(upstream: str, problem: str) -> None:
    """Accepted, such an upstream made every call fail in flight (a port yarl refuses:
    recorded FAILED though nothing was sent; a space: a broken request line sent)."""
    problems = _problems({"routes": [{**ROUTE, "upstream": upstream}]})
    assert any(p.startswith(problem) for p in problems), problems


def test_ports_in_range_are_upstreams() -> None:
    for upstream in ("http://h:65535", "https://[::1]:443/x", "http://h:1"):
        parse_config({"routes": [{**ROUTE, "upstream": upstream}]}, env={})


def test_the_identity_providers_urls_are_checked() -> None:
    bad_keys = {**ISSUER, "jwks_url": "https://idp:99999/jwks"}
    problems = _problems({"auth": {"issuers": [bad_keys]}, "routes": [ROUTE]})
    assert any(p.startswith("auth.issuers[0].jwks_url: not a port") for p in problems)
    discovered = {"issuer": "idp", "discovery": True, "audiences": ["a"]}
    problems = _problems({"auth": {"issuers": [discovered]}, "routes": [ROUTE]})
    assert any(p.startswith("auth.issuers[0]: issuer: not an absolute") for p in problems)
    # Without discovery an issuer is only compared with the tokens' iss: any string.
    named = {**ISSUER, "issuer": "accounts.example.com"}
    parse_config({"auth": {"issuers": [named]}, "routes": [ROUTE]}, env={})
    token = {
        "mode": "client_credentials",
        "token_endpoint": "https://idp:70000/token",
        "client_id": "c",
        "client_secret_env": "SECRET",
    }
    problems = _problems({"routes": [{**ROUTE, "token": token}]})
    assert any(p.startswith("routes[0].token.token_endpoint: not a port") for p in problems)


@pytest.mark.parametrize(
    ("limit", "problem"),
    [
        ({"cost": {"request": math.nan}}, "limits[0].cost.request: a cost must be a finite"),
        ({"cost": {"request": math.inf}}, "limits[0].cost.request: a cost must be a finite"),
        ({"rate": "9" * 400 + "/1s"}, "limits[0].rate: a rate's quota must be a finite"),
        ({"rate": "9" * 300 + "/0." + "0" * 320 + "1s"}, "limits[0].rate: the period is too"),
        ({"rate": "0.5/1s"}, "limits[0]: the rate's quota (0.5), its burst, is below the 1"),
        ({"rate": "10/1m", "cost": {"request": 20}}, "limits[0]: the rate's quota (10), its"),
        ({"rate": "100/1m", "burst": 50, "cost": {"request": 60}}, "limits[0]: burst (50) is"),
    ],
)
def test_a_rate_no_call_could_pass_is_refused(limit: dict[str, Any], problem: str) -> None:
    """A NaN cost, an infinite quota or an interval of 0 made every call fail in flight
    (ValueError, ZeroDivisionError); a burst below what every call costs refused every
    call for ever."""
    spec = {"name": "l", "rate": "10/1s", **limit}
    problems = _problems({"routes": [{**ROUTE, "limits": [spec]}]})
    assert any(p.startswith(f"routes[0].{problem}") for p in problems), problems


def test_a_rate_whose_burst_fits_a_call_is_accepted() -> None:
    fits = [
        {"name": "half", "rate": "0.5/1s", "cost": {"request": 0.5}},
        {"name": "body", "rate": "0.5/1s", "cost": {"request": "json:/n"}},  # any number
        {"name": "every2s", "rate": "1/2s"},
        {"name": "tokens", "rate": "100/1m", "burst": 60, "cost": {"request": 60}},
    ]
    parse_config({"routes": [{**ROUTE, "limits": fits}]}, env={})
    problems = _problems({"routes": [{**ROUTE, "limits": [{"name": "l", "rate": "0.5/1m"}]}]})
    assert any("(write 0.5/60s as 1/120s)" in p for p in problems), problems


@pytest.mark.parametrize("claims", [[], [""], ["sub", " "]])
def test_a_principal_needs_a_claim_name(claims: list[str]) -> None:
    """Without one, every caller had the same principal: records and private cache
    entries were shared across callers."""
    problems = _problems({"auth": {"issuers": [ISSUER], "principal": claims}, "routes": [ROUTE]})
    assert any(p.startswith("auth.principal: one claim name at least") for p in problems)


@pytest.mark.parametrize(
    ("statuses", "problem"),
    [
        ([503, 200], "200 means the call ran"),
        ([201], "201 means the call ran"),
        ([100], "100 is informational"),
    ],
)
def test_release_on_status_refuses_answers_of_a_call_that_ran(
    statuses: list[int], problem: str
) -> None:
    """Releasing the key on a 2xx let the retry run the call a second time."""
    guarded = {**ROUTE, "idempotency": {"release_on_status": statuses}}
    problems = _problems({"routes": [guarded]})
    assert any(
        p.startswith(f"routes[0].idempotency.release_on_status: {problem}") for p in problems
    )
    redirects = {**ROUTE, "idempotency": {"release_on_status": [307, 408, 599]}}
    parse_config({"routes": [redirects]}, env={})


def test_a_reconcile_look_up_is_a_read() -> None:
    """The look-up is sent again on retries and by every replica: a POST could act."""
    spec = {**ROUTE, "idempotency": {}, "reconcile": {"method": "post", "path": "/c/{key}"}}
    problems = _problems({"routes": [spec]})
    assert any(p.startswith("routes[0].reconcile.method: POST is not a read") for p in problems)
    for method in ("get", "HEAD"):
        read = {**spec, "reconcile": {"method": method, "path": "/c/{key}"}}
        route = parse_config({"routes": [read]}, env={}).routes[0]
        assert route.reconcile is not None and route.reconcile.method == method.upper()


def test_lock_ttl_has_a_floor() -> None:
    """A lease renewed every third of 0.001 ms lapsed at once (and spun the loop)."""
    for lease in ("0.001ms", "99ms"):
        problems = _problems({"routes": [{**ROUTE, "idempotency": {"lock_ttl": lease}}]})
        assert any(p.startswith("routes[0].idempotency.lock_ttl: at least 100ms") for p in problems)
    config = parse_config({"routes": [{**ROUTE, "idempotency": {"lock_ttl": "100ms"}}]}, env={})
    assert config.routes[0].idempotency is not None
    assert config.routes[0].idempotency.lock_ttl == MIN_LOCK_TTL
