"""``tool-proxy``: serve, check-config, key, demo, records, operations."""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import math
import os
import sys
import tempfile
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any

import structlog

from proxy import records
from proxy.auth.sealing import load_key
from proxy.auth.tokens import load_secrets
from proxy.config import Config, load_config
from proxy.config.server import MAX_PORT, MIN_PORT, check_listen_host
from proxy.errors import (
    ConfigError,
    InvalidField,
    OperationConflict,
    OperationNotFound,
    ProxyError,
)
from proxy.keys import Canonicalization, composite_key, is_key_part, is_text
from proxy.metrics import ENV_MULTIPROC_DIR
from proxy.outcome import StoredResponse
from proxy.store import Store, make_store

EXIT_USAGE = 2
# A records command that could not be done (no such record, not FAILED, store down).
EXIT_FAILED = 1


def _fail(problems: list[str]) -> int:
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return EXIT_USAGE


def _load(path: str | None) -> Config:
    config = load_config(path)
    load_secrets(list(config.routes))  # missing client secrets are configuration errors too
    if config.auth is not None and config.auth.token_cache_key_env:
        load_key(config.auth.token_cache_key_env)
    if (sealing := config.sealing_key_env()) is not None:
        load_key(*sealing)
    if config.admin is not None:
        from proxy.admin import load_admin_token

        load_admin_token(config.admin)
    return config


def _serve_flags(args: argparse.Namespace) -> list[str]:
    """The problems of serve's own flags (each named), before anything is started."""
    problems = []
    if args.host is not None:
        try:
            check_listen_host(args.host)
        except ValueError as exc:
            problems.append(f"--host: {exc}")
    if args.port is not None and not MIN_PORT <= args.port <= MAX_PORT:
        problems.append(f"--port: must be a port number from {MIN_PORT} to {MAX_PORT}")
    if args.workers < 1:
        problems.append("--workers: must be at least 1")
    graceful = args.graceful_timeout
    if graceful is not None and not (math.isfinite(graceful) and graceful > 0):
        problems.append("--graceful-timeout: must be a positive, finite number of seconds")
    return problems


def cmd_serve(args: argparse.Namespace) -> int:
    config = _load(args.config)
    if problems := _serve_flags(args):
        return _fail(problems)
    try:
        _make_store(config)  # a URL no store can be made of, named before the workers start
    except InvalidField as exc:
        return _fail([exc.detail])
    if args.workers > 1 and config.store.url.startswith("memory://"):
        return _fail(
            [
                "--workers: the memory:// store lives in one process; use sqlite://, redis:// "
                "or postgresql:// with more than one worker"
            ]
        )
    from proxy.app import shutdown_seconds
    from proxy.journal import check_directory
    from proxy.server import serve

    journal_dir = config.journal_dir()
    if journal_dir is not None and (problem := check_directory(journal_dir)):
        return _fail([problem])
    if args.workers > 1 and not os.environ.get(ENV_MULTIPROC_DIR):
        # every worker writes its metrics here, so one scrape sees the whole server
        os.environ[ENV_MULTIPROC_DIR] = tempfile.mkdtemp(prefix="tool-proxy-metrics-")
    host = args.host if args.host is not None else config.server.host
    port = args.port if args.port is not None else config.server.port
    graceful = args.graceful_timeout or shutdown_seconds(config)
    limits = config.limits
    serve(
        args.config,
        host,
        port,
        args.workers,
        args.log_level,
        graceful,
        limits.max_header_bytes,
        limits.header_timeout,
        limits.body_timeout,
    )
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    """Apply the PostgreSQL schema (idempotent; safe while replicas start): say what it
    was and is at. Other stores have no schema to apply."""
    url = load_config(args.config).store.url
    if url.partition("://")[0] not in ("postgresql", "postgres"):
        return _fail([f"store.url: migrate applies the PostgreSQL schema; {url} has none"])
    from proxy.store.postgres import apply_schema, parse_postgres_url

    schema = parse_postgres_url(url).schema
    try:
        before, after = asyncio.run(apply_schema(url))
    except ProxyError as exc:
        print(f"error: {exc.detail}", file=sys.stderr)
        return EXIT_FAILED
    done = f"migrated from version {before}" if before < after else "already up to date"
    print(f"ok: schema {schema} at version {after} ({done})")
    return 0


def cmd_check_config(args: argparse.Namespace) -> int:
    config = _load(args.file)
    guarded = sum(1 for r in config.routes if r.idempotency is not None)
    print(f"ok: {len(config.routes)} route(s), {guarded} guarded, store {config.store.url}")
    return 0


def cmd_key(args: argparse.Namespace) -> int:
    problems = [
        f"{flag}: must be 1..128 characters of [A-Za-z0-9._-]"
        for flag, value in (("--plan", args.plan), ("--step", args.step))
        if not is_key_part(value)
    ]
    if problems:
        return _fail(problems)
    body = sys.stdin.buffer.read()
    try:
        print(composite_key(args.plan, args.step, body, args.canonicalization))
    except ProxyError as exc:
        return _fail([f"stdin: {exc.detail}"])
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from proxy.demo.walkthrough import run

    return run(port=args.port, tool_port=args.tool_port, once=args.once)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _audit_log() -> Any:
    """JSON audit lines on stderr (stdout carries the command's JSON)."""
    return structlog.wrap_logger(
        structlog.PrintLogger(sys.stderr),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.JSONRenderer(),
        ],
    )


def _operator() -> str:
    try:
        user = getpass.getuser()
    except (OSError, KeyError):
        user = str(os.getuid())
    return f"cli user={user}"


def _header(value: str) -> tuple[str, str]:
    name, sep, text = value.partition(":")
    if not sep:
        raise InvalidField("--header", f"{value!r} is not 'name: value'")
    return name.strip(), text.strip()


def _answer(args: argparse.Namespace) -> StoredResponse:
    """The response of ``resolve --as completed``, from its flags."""
    if args.status is None:
        raise InvalidField("--status", "required with --as completed")
    body = b""
    if args.body_file is not None:
        try:
            body = Path(args.body_file).read_bytes()
        except OSError as exc:
            problem = f"cannot read {args.body_file} ({exc.strerror})"
            raise InvalidField("--body-file", problem) from None
    headers = [_header(h) for h in args.header]
    flags = {"status": "--status", "headers": "--header"}
    return records.answer(args.status, headers, body, flags.__getitem__)


def _check_text(args: argparse.Namespace) -> None:
    """``InvalidField`` for an argument of a records or operations command that is not UTF-8
    (the shell passes any bytes; Python keeps those as lone surrogates, which no store takes
    and the HTTP API never sees)."""
    for name in (*records.FILTERS, "cursor", "id", "reason", "header"):
        value = getattr(args, name, None)
        texts = value if isinstance(value, list) else [value]
        if any(isinstance(text, str) and not is_text(text) for text in texts):
            raise InvalidField("ID" if name == "id" else _flag(name), "not UTF-8 text")


def _check_records_flags(args: argparse.Namespace) -> None:
    """Every flag of a records command checked before the store is opened."""
    _check_text(args)
    if args.action == "resolve" and args.outcome == "released":
        given = [f for f, v in (("--status", args.status), ("--body-file", args.body_file)) if v]
        if given or args.header:
            raise InvalidField(given[0] if given else "--header", "only with --as completed")
    if args.action != "list":
        args.key = records.parse_id(args.id, "ID")
    if args.action in ("resolve", "delete"):
        args.reason = records.check_reason(args.reason, "--reason")
    if args.action == "resolve" and args.outcome == "completed":
        args.response = _answer(args)


def _make_store(config: Config) -> Store:
    """The configured store, not yet opened; ``InvalidField`` naming ``store.url`` when its
    URL makes none (the configuration's own checks are the first line of defence)."""
    from redis.exceptions import RedisError  # redis-py's, for some options of a URL

    try:
        return make_store(config.store.url, config.store.durable())
    except (ValueError, RedisError, ProxyError) as exc:
        detail = exc.detail if isinstance(exc, ProxyError) else str(exc)
        raise InvalidField("store.url", detail) from None


async def _open_store(config: Config) -> Store:
    """The configured store, opened (a store that cannot be reached raises as it does)."""
    store = _make_store(config)
    try:
        await store.open()
    except ValueError as exc:  # e.g. a NUL byte in a SQLite path: the URL, most likely
        raise InvalidField("store.url", f"the store did not open with it: {exc}") from None
    return store


async def _records(args: argparse.Namespace, config: Config) -> Any:
    """Run one records command against the configured store; its JSON result."""
    _check_records_flags(args)
    store = await _open_store(config)
    try:
        return await _change(args, records.Records(store, config.routes, _audit_log()))
    finally:
        await store.close()


async def _change(args: argparse.Namespace, desk: records.Records) -> Any:
    if args.action == "list":
        return await _list(args, desk.store)
    if args.action == "show":
        return records.record_view(await desk.get(args.key), body=args.body)
    if args.action == "delete":
        record = await desk.delete(args.key, args.reason, _operator())
        return {"deleted": True, "record": records.record_view(record)}
    if args.outcome == "released":
        await desk.release(args.key, args.reason, _operator())
        return {"id": args.id, "resolved": "released"}
    record = await desk.resolve(args.key, args.response, args.reason, _operator())
    return {"resolved": "completed", "record": records.record_view(record)}


async def _list(args: argparse.Namespace, store: Store) -> dict[str, Any]:
    where = records.parse_filter({f: getattr(args, f) for f in records.FILTERS}, _flag)
    limit = records.parse_limit(args.limit, "--limit")
    page = await records.list_records(store, where, limit, args.cursor, "--cursor")
    found = list(page.records)
    while args.all and page.cursor:
        page = await records.list_records(store, where, limit, page.cursor, "--cursor")
        found += page.records
    return {
        "records": [records.record_view(r) for r in found],
        "next_cursor": page.cursor or None,
    }


def cmd_records(args: argparse.Namespace) -> int:
    return _print_result(_records(args, load_config(args.config)))


def _print_result(command: Coroutine[Any, Any, Any]) -> int:
    """Run a store command: its JSON result on stdout, or its error on stderr (exit 2 for
    a bad flag, named; 1 for what cannot be done)."""
    try:
        result = asyncio.run(command)
    except InvalidField as exc:
        return _fail([exc.detail])
    except ProxyError as exc:
        print(f"error: {exc.detail}", file=sys.stderr)
        return EXIT_FAILED
    print(json.dumps(result, indent=2))
    return 0


def _add_records(sub: Any) -> None:
    """``tool-proxy records list|show|resolve|delete``: the admin API, on the store itself."""
    parser = sub.add_parser("records", help="list, show, resolve or delete idempotency records")
    actions = parser.add_subparsers(dest="action", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", help="YAML file (default: $TOOL_PROXY_CONFIG)")
    listing = actions.add_parser("list", parents=[common], help="list records (JSON)")
    for name in records.FILTERS:
        listing.add_argument(_flag(name), dest=name, help=f"only records of this {name}")
    listing.add_argument("--limit", help=f"records per page (default {records.DEFAULT_LIMIT})")
    listing.add_argument("--cursor", default="", help="next_cursor of the previous page")
    listing.add_argument("--all", action="store_true", help="follow the cursors to the end")
    show = actions.add_parser("show", parents=[common], help="show one record (JSON)")
    show.add_argument("id", help="the record's id (from list)")
    show.add_argument("--body", action="store_true", help="include the recorded response")
    resolve = actions.add_parser("resolve", parents=[common], help="resolve a failed record")
    resolve.add_argument("id", help="the record's id (from list)")
    resolve.add_argument(
        "--as",
        dest="outcome",
        required=True,
        choices=["completed", "released"],
        help="completed: the tool ran (record this answer); released: it did not (a retry runs)",
    )
    resolve.add_argument("--status", type=int, help="the answer's status (--as completed)")
    resolve.add_argument(
        "--header", action="append", default=[], help="'name: value' of the answer (repeat)"
    )
    resolve.add_argument("--body-file", help="a file holding the answer's body")
    resolve.add_argument("--reason", required=True, help="why (the audit log keeps it)")
    delete = actions.add_parser("delete", parents=[common], help="delete a record")
    delete.add_argument("id", help="the record's id (from list)")
    delete.add_argument("--reason", required=True, help="why (the audit log keeps it)")
    parser.set_defaults(func=cmd_records)


async def _operations(args: argparse.Namespace, config: Config) -> Any:
    """Run one operations command against the configured store; its JSON result."""
    from proxy.jobs import listing, requeue
    from proxy.operations import STATES, check_cursor, is_operation_id, parse_limit
    from proxy.store import JobState, make_queue

    _check_text(args)
    state = None
    if args.action == "list" and args.state is not None:
        state = STATES.get(args.state)
        if state is None:
            raise InvalidField("--state", f"one of {', '.join(STATES)}")
    if args.action == "list":
        check_cursor(args.cursor, "--cursor")
    else:
        if not is_operation_id(args.id):
            raise InvalidField("ID", "not an operation id")
        args.reason = records.check_reason(args.reason, "--reason")
    limit = parse_limit(getattr(args, "limit", None), "--limit")
    store = await _open_store(config)
    try:
        queue = make_queue(store)
        if args.action == "list":
            cursor, page = await queue.list(state, args.cursor, limit)
            found = list(page)
            while args.all and cursor:
                cursor, page = await queue.list(state, cursor, limit)
                found += page
            return {"operations": [listing(j) for j in found], "next_cursor": cursor or None}
        job = await queue.get(args.id)
        routes = {r.name: r for r in config.routes if r.runs_jobs()}
        if job is None or job.route not in routes:
            raise OperationNotFound(f"no operation {args.id} (it may have expired)")
        if job.state is not JobState.DEAD:
            raise OperationConflict(f"the operation is {job.state.value}: only a dead one")
        requeued = await requeue(job, routes[job.route], store, queue)
        if requeued is None:
            raise OperationConflict(
                "its Idempotency-Key was used again since it died: not queued again"
            )
        _audit_log().warning(
            "job_requeued", route=job.route, job=job.id, admin=_operator(), reason=args.reason
        )
        return listing(requeued)
    finally:
        await store.close()


def cmd_operations(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    if not any(r.runs_jobs() for r in config.routes):
        return _fail(["no route of this configuration has async: there are no operations"])
    return _print_result(_operations(args, config))


def _add_operations(sub: Any) -> None:
    """``tool-proxy operations list|requeue``: the admin operations API, on the store."""
    parser = sub.add_parser("operations", help="list long calls' operations, requeue dead ones")
    actions = parser.add_subparsers(dest="action", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", help="YAML file (default: $TOOL_PROXY_CONFIG)")
    listing = actions.add_parser("list", parents=[common], help="list operations (JSON)")
    listing.add_argument("--state", help="only operations in this state (e.g. dead)")
    listing.add_argument("--limit", help="operations per page (default 100)")
    listing.add_argument("--cursor", default="", help="next_cursor of the previous page")
    listing.add_argument("--all", action="store_true", help="follow the cursors to the end")
    again = actions.add_parser("requeue", parents=[common], help="queue a dead operation again")
    again.add_argument("id", help="the operation's id (from list)")
    again.add_argument("--reason", required=True, help="why (the audit log keeps it)")
    parser.set_defaults(func=cmd_operations)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tool-proxy", description="An idempotent reverse proxy for agent tool calls."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the proxy")
    serve.add_argument("--config", help="YAML file (default: $TOOL_PROXY_CONFIG)")
    serve.add_argument("--host", help="listen address (overrides server.host)")
    serve.add_argument("--port", type=int, help="listen port (overrides server.port)")
    serve.add_argument("--workers", type=int, default=1, help="worker processes (default 1)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument(
        "--graceful-timeout",
        type=float,
        help="seconds a shutdown waits for requests before it cancels them (their calls are "
        "then recorded FAILED); default: the longest a call can take, plus 5",
    )
    serve.set_defaults(func=cmd_serve)

    migrate = sub.add_parser(
        "migrate", help="apply the PostgreSQL store's schema now (else each replica's start does)"
    )
    migrate.add_argument("--config", help="YAML file (default: $TOOL_PROXY_CONFIG)")
    migrate.set_defaults(func=cmd_migrate)

    check = sub.add_parser("check-config", help="validate a configuration file")
    check.add_argument("file")
    check.set_defaults(func=cmd_check_config)

    key = sub.add_parser("key", help="print the composite Idempotency-Key for a body on stdin")
    key.add_argument("--plan", required=True, help="plan_session_id")
    key.add_argument("--step", required=True, help="step_index")
    key.add_argument(
        "--canonicalization", default="jcs", choices=[c.value for c in Canonicalization]
    )
    key.set_defaults(func=cmd_key)

    demo = sub.add_parser("demo", help="run the proxy in front of a demo tool and show a replay")
    demo.add_argument("--port", type=int, default=8080, help="proxy port (default 8080)")
    demo.add_argument("--tool-port", type=int, default=9000, help="demo tool port (default 9000)")
    demo.add_argument("--once", action="store_true", help="exit after the walkthrough")
    demo.set_defaults(func=cmd_demo)
    _add_records(sub)
    _add_operations(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as exc:
        return _fail(exc.problems)


if __name__ == "__main__":
    sys.exit(main())
