"""Record views and pages on every store, and ``tool-proxy records`` on a SQLite file."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from proxy import records
from proxy.cli import main
from proxy.errors import InvalidField
from proxy.outcome import StoredResponse
from proxy.store import RecordKey, State, Store
from tests.conftest import Later, ProxyFactory, new_key, route
from tests.servers import CountingTool

BODY = {"db": "orders"}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def store(opened: Store) -> Store:
    return opened


def key(plan: str, step: int, route_name: str = "tool") -> RecordKey:
    return RecordKey(f"{route_name}||{plan}|{step}", f"{step:064x}")


async def done(store: Store, at: RecordKey, state: State = State.COMPLETED) -> None:
    assert (await store.claim(at, "fp", "owner", 5.0, 60.0)).claimed
    payload = StoredResponse.of(200, [(b"content-type", b"text/plain")], b"ok").encode()
    assert await store.complete(at, "owner", "fp", state, payload, 60.0)


def test_ids_round_trip_and_refuse_others() -> None:
    at = key("plan-1", 3)
    assert records.parse_id(records.record_id(at)) == at
    for bad in ("", "!!", records.record_id(RecordKey("no-bars", "x"))):
        with pytest.raises(InvalidField):
            records.parse_id(bad)


@pytest.mark.anyio
async def test_a_lapsed_lease_shows_as_failed_and_lapsed(store: Store, later: Later) -> None:
    at = key("plan-lapsed", 1)
    assert (await store.claim(at, "fp", "gone", 0.05, 60.0)).claimed
    await later(0.1)
    assert not (await store.claim(at, "fp", "retry", 5.0, 60.0)).claimed
    (record,) = await store.records(at.scope)
    view = records.record_view(record, body=True)
    assert (view["state"], view["lapsed"], view["status"], view["replayable"]) == (
        "failed",
        True,
        None,
        False,
    )
    assert view["response"] is None
    assert view["replays"] == 1  # the retry was answered "outcome unknown" from the record


@pytest.mark.anyio
async def test_pages_cover_every_record_once_across_scan_pages(store: Store) -> None:
    keys = [key(f"plan-{i % 9}", i) for i in range(450)]
    await asyncio.gather(
        *(
            done(store, k, State.FAILED if i % 7 == 0 else State.COMPLETED)
            for i, k in enumerate(keys)
        )
    )
    for where, expected in (
        (records.Filter(), set(keys)),
        (records.Filter(state=State.FAILED), {k for i, k in enumerate(keys) if i % 7 == 0}),
        (records.Filter(plan="plan-4"), {k for i, k in enumerate(keys) if i % 9 == 4}),
    ):
        seen: list[RecordKey] = []
        page = await records.list_records(store, where, 60)
        pages = 1
        seen += [r.key for r in page.records if r.key]
        while page.cursor:
            page = await records.list_records(store, where, 60, page.cursor)
            seen += [r.key for r in page.records if r.key]
            pages += 1
        assert len(seen) == len(set(seen)), where  # no record on two pages
        assert set(seen) == expected, where
        assert pages >= -(-len(expected) // 60)  # at least ceil(n / limit)


# -- the CLI ---------------------------------------------------------------------------


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any, str]:
    """``tool-proxy records ...`` in this process: exit code, JSON output, stderr."""
    capsys.readouterr()  # the in-process proxy's own log lines
    try:
        code = main(["records", *argv])
    except SystemExit as exc:  # argparse's own usage errors
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, json.loads(out) if out.strip() else None, err


@pytest.fixture
def cli_setup(tool: CountingTool, make_proxy: ProxyFactory, tmp_path: Path) -> tuple[Any, str]:
    store = f"sqlite://{tmp_path}/state.db"
    spec = route(tool.url, name="quick", timeout="0.5s")
    proxy = make_proxy(spec, store=store)
    config = tmp_path / "proxy.yaml"
    config.write_text(yaml.safe_dump({"store": {"url": store}, "routes": [spec]}))
    return proxy, str(config)


def test_cli_lists_shows_resolves_and_deletes(
    cli_setup: tuple[Any, str],
    tool: CountingTool,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    proxy, config = cli_setup
    failed_key = new_key(BODY, 1, "plan-cli")
    done_key = new_key(BODY, 2, "plan-cli")
    url = f"{proxy.url}/tools/x"
    assert (
        httpx.post(f"{url}?delay=2", json=BODY, headers={"Idempotency-Key": failed_key}).status_code
        == 504
    )
    assert httpx.post(url, json=BODY, headers={"Idempotency-Key": done_key}).status_code == 200
    code, listed, _ = run(capsys, "list", "--config", config, "--plan", "plan-cli")
    assert code == 0 and [r["step"] for r in listed["records"]] == ["1", "2"]
    failed, completed = listed["records"]
    code, page, _ = run(capsys, "list", "--config", config, "--limit", "1", "--state", "failed")
    assert code == 0 and [r["id"] for r in page["records"]] == [failed["id"]]
    code, shown, _ = run(capsys, "show", "--config", config, completed["id"], "--body")
    assert code == 0 and shown["response"]["status"] == 200
    body = tmp_path / "answer.json"
    body.write_text('{"db": "restored"}')
    code, resolved, err = run(
        capsys,
        "resolve",
        "--config",
        config,
        failed["id"],
        "--as",
        "completed",
        "--status",
        "200",
        "--header",
        "content-type: application/json",
        "--body-file",
        str(body),
        "--reason",
        "the tool's log shows it ran",
    )
    assert code == 0, err
    assert resolved["record"]["state"] == "completed"
    audit = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    assert [e["event"] for e in audit] == ["admin_record_resolved"]
    assert audit[0]["admin"].startswith("cli user=") and audit[0]["level"] == "warning"
    assert audit[0]["reason"] == "the tool's log shows it ran"
    replay = httpx.post(f"{url}?delay=2", json=BODY, headers={"Idempotency-Key": failed_key})
    assert (replay.status_code, replay.json()) == (200, {"db": "restored"})
    assert replay.headers["idempotent-replayed"] == "true"
    assert tool.arrived[failed_key] == 1
    code, _, err = run(
        capsys, "resolve", "--config", config, completed["id"], "--as", "released", "--reason", "r"
    )
    assert code == 1 and "only a failed record" in err
    code, _, err = run(capsys, "delete", "--config", config, completed["id"], "--reason", "cleanup")
    assert code == 0 and "admin_record_deleted" in err
    code, _, err = run(capsys, "show", "--config", config, completed["id"])
    assert code == 1 and "no record" in err


def test_cli_releases_a_failed_record(
    cli_setup: tuple[Any, str], capsys: pytest.CaptureFixture[str]
) -> None:
    proxy, config = cli_setup
    key = new_key(BODY, 1, "plan-cli-release")
    post = {"json": BODY, "headers": {"Idempotency-Key": key}}
    assert httpx.post(f"{proxy.url}/tools/x?delay=2", **post).status_code == 504  # type: ignore[arg-type]
    code, listed, _ = run(
        capsys, "list", "--config", config, "--route", "quick", "--state", "failed"
    )
    (failed,) = listed["records"]
    code, answer, err = run(
        capsys,
        "resolve",
        "--config",
        config,
        failed["id"],
        "--as",
        "released",
        "--reason",
        "never ran",
    )
    assert code == 0 and answer == {"id": failed["id"], "resolved": "released"}
    assert '"admin_record_released"' in err
    code, listed, _ = run(capsys, "list", "--config", config, "--all")
    assert listed["records"] == []


RESOLVE_200 = ["resolve", "ID0", "--as", "completed", "--status", "200", "--reason", "r"]


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["list", "--state", "done"], "--state"),
        (["list", "--older-than", "soon"], "--older-than"),
        (["list", "--limit", "0"], "--limit"),
        (["list", "--cursor", "!!"], "--cursor"),
        (["show", "not-an-id"], "ID"),
        (["resolve", "ID0", "--as", "completed", "--reason", "r"], "--status"),
        (["resolve", "ID0", "--as", "maybe", "--reason", "r"], "--as"),
        (["resolve", "ID0", "--as", "released", "--status", "200", "--reason", "r"], "--status"),
        (
            [
                "resolve",
                "ID0",
                "--as",
                "completed",
                "--status",
                "200",
                "--header",
                "nocolon",
                "--reason",
                "r",
            ],
            "--header",
        ),
        (
            [
                "resolve",
                "ID0",
                "--as",
                "completed",
                "--status",
                "200",
                "--body-file",
                "/no/such",
                "--reason",
                "r",
            ],
            "--body-file",
        ),
        (["resolve", "ID0", "--as", "completed", "--status", "700", "--reason", "r"], "--status"),
        (["resolve", "ID0", "--as", "released", "--reason", " "], "--reason"),
        (["delete", "ID0"], "--reason"),
        # Bytes from the shell that are not UTF-8 (lone surrogates): the store refused them
        # with a traceback.
        (["list", "--route", "t", "--principal", "p", "--plan", "\udcff"], "--plan: not UTF-8"),
        (["list", "--cursor", "\udcff"], "--cursor"),
        (["delete", "ID0", "--reason", "\udcff"], "--reason: not UTF-8 text"),
        (["list", "--older-than", "5 min"], "--older-than: not a duration: '5 min'"),
        (
            [*RESOLVE_200, "--header", "x: \u20ac"],
            "--header: the value of 'x' is not Latin-1 text",
        ),
        (
            [*RESOLVE_200, "--header", "x: a\x01b"],
            "--header: the value of 'x' holds control characters",
        ),
    ],
)
def test_cli_names_the_bad_flag(
    argv: list[str], flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "proxy.yaml"
    spec = route("http://127.0.0.1:9")
    config.write_text(
        yaml.safe_dump({"store": {"url": f"sqlite://{tmp_path}/s.db"}, "routes": [spec]})
    )
    valid = records.record_id(RecordKey("tool||plan|1", "a" * 64))
    argv = [valid if a == "ID0" else a for a in argv]
    code, _, err = run(capsys, argv[0], "--config", str(config), *argv[1:])
    assert code == 2, err
    assert flag in err and "Traceback" not in err


def test_an_age_is_a_duration_or_a_number_of_seconds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As the message for one that is neither says: ``--older-than 5`` was refused with
    "use a number of seconds"."""
    config = tmp_path / "proxy.yaml"
    spec = route("http://127.0.0.1:9")
    config.write_text(
        yaml.safe_dump({"store": {"url": f"sqlite://{tmp_path}/s.db"}, "routes": [spec]})
    )
    for flag, value in (("--older-than", "5"), ("--newer-than", "1.5"), ("--older-than", "2m")):
        code, listed, err = run(capsys, "list", "--config", str(config), flag, value)
        assert code == 0 and listed["records"] == [], err
    assert records.parse_filter({"older_than": "600", "newer_than": "7d"}) == records.Filter(
        older_than=600.0, newer_than=7 * 86400.0
    )
    for value in ("0", "-5", "5 s s", "\u0665"):  # an Arabic-Indic five: not a number here
        with pytest.raises(InvalidField):
            records.parse_filter({"older_than": value})
