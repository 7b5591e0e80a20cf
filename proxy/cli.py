"""``tool-proxy``: serve, check-config, key, demo."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Sequence

from proxy.auth.sealing import load_key
from proxy.auth.tokens import load_secrets
from proxy.config import Config, load_config
from proxy.errors import ConfigError, ProxyError
from proxy.keys import Canonicalization, composite_key, is_key_part
from proxy.metrics import ENV_MULTIPROC_DIR

EXIT_USAGE = 2


def _fail(problems: list[str]) -> int:
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return EXIT_USAGE


def _load(path: str | None) -> Config:
    config = load_config(path)
    load_secrets(list(config.routes))  # missing client secrets are configuration errors too
    if config.auth is not None and config.auth.token_cache_key_env:
        load_key(config.auth.token_cache_key_env)
    return config


def cmd_serve(args: argparse.Namespace) -> int:
    config = _load(args.config)
    if args.workers < 1:
        return _fail(["--workers: must be at least 1"])
    if args.workers > 1 and config.store.url.startswith("memory://"):
        return _fail(
            [
                "--workers: the memory:// store lives in one process; use sqlite:// or redis:// "
                "with more than one worker"
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
    if args.graceful_timeout is not None and args.graceful_timeout <= 0:
        return _fail(["--graceful-timeout: must be a positive number of seconds"])
    host = args.host or config.server.host
    port = args.port or config.server.port
    graceful = args.graceful_timeout or shutdown_seconds(config)
    limit = config.limits.max_header_bytes
    serve(args.config, host, port, args.workers, args.log_level, graceful, limit)
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as exc:
        return _fail(exc.problems)


if __name__ == "__main__":
    sys.exit(main())
