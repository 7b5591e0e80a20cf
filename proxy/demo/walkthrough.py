"""``tool-proxy demo``: the proxy on the embedded store in front of the demo tool.

It starts both, then plays an agent whose call times out: the duplicate sent while the
first call works gets 409, the retry after it finished gets the stored response. The
operator console (``/_proxy/console/``) is on, with a fresh admin token, and the printed
lines work as they are in any shell (they name this virtualenv's ``tool-proxy``).
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from email.message import Message
from pathlib import Path

import uvicorn
import yaml

from proxy.console import CONSOLE_PATH
from proxy.demo.tool import create_tool_app
from proxy.keys import composite_key

TOOL_DELAY_SECONDS = 2.0


def demo_config(port: int, tool_port: int, store_path: Path, token_file: Path) -> dict[str, object]:
    """The configuration the demo runs with (also a small example of the format)."""
    return {
        "store": {"url": f"sqlite://{store_path}"},
        "admin": {"token_file": str(token_file)},
        "server": {"host": "127.0.0.1", "port": port},
        "routes": [
            {
                "name": "charge",
                "path_prefix": "/tools/charge",
                "upstream": f"http://127.0.0.1:{tool_port}",
                "timeout": "30s",
                "idempotency": {
                    "methods": ["POST"],
                    "lock_ttl": "30s",
                    "result_ttl": "1h",
                    "retry_after": "1s",
                },
            }
        ],
    }


def _call(url: str, body: bytes | None = None, key: str | None = None) -> tuple[int, Message, str]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Idempotency-Key"] = key
    request = urllib.request.Request(url, body, headers, method="POST" if body else "GET")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.headers, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read().decode()


def _wait_ready(url: str, proxy: subprocess.Popen[bytes], seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proxy.poll() is not None:
            raise RuntimeError("the proxy exited; see its log above")
        try:
            if _call(url)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not become ready in {seconds:.0f} s")


def _wait_in_flight(tool: str, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if json.loads(_call(f"{tool}/tools/charge/executions")[2])["in_flight"]:
            return
        time.sleep(0.02)
    raise RuntimeError("the first call did not reach the demo tool")


def _start_tool(port: int) -> uvicorn.Server:
    server = uvicorn.Server(
        uvicorn.Config(create_tool_app(), host="127.0.0.1", port=port, log_level="warning")
    )
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server


def _walk(base: str, tool: str) -> str:
    """The walkthrough; the plan session it made."""
    args = {"account": "acme", "amount": 42, "delay": TOOL_DELAY_SECONDS}
    body = json.dumps(args).encode()
    plan = f"demo-{uuid.uuid4().hex[:8]}"
    key = composite_key(plan, 1, args)
    url = f"{base}/tools/charge"
    print(f"1. POST {url}\n   Idempotency-Key: {key}\n   body: {body.decode()}")
    print(
        f"   The tool takes {TOOL_DELAY_SECONDS:.0f} s; meanwhile the agent times out and retries."
    )
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(_call, url, body, key)
        _wait_in_flight(tool)
        status, headers, text = _call(url, body, key)
        print(
            f"2. Duplicate while the first is in flight -> {status}, "
            f"Retry-After: {headers.get('Retry-After')}\n   {text}"
        )
        status, headers, text = first.result()
    print(f"3. The first call finishes -> {status}\n   {text}")
    status, headers, text = _call(url, body, key)
    print(
        f"4. Retry after completion -> {status}, "
        f"Idempotent-Replayed: {headers.get('Idempotent-Replayed')}\n   {text}"
    )
    executions = json.loads(_call(f"{tool}/tools/charge/executions")[2])["executions"]
    print(f"   The tool executed the charge {executions} time(s).\n")
    return plan


def _try_it(base: str, config: Path, plan: str) -> None:
    """Lines to paste in a fresh shell: this virtualenv's ``tool-proxy``, not the PATH's."""
    command = shlex.quote(str(Path(sys.executable).with_name("tool-proxy")))
    print("Try it yourself (Ctrl-C to stop):")
    print('  BODY=\'{"account":"acme","amount":7}\'')
    print(f'  KEY=$(echo "$BODY" | {command} key --plan my-plan --step 1)')
    print(
        f'  curl -i {base}/tools/charge -H "Idempotency-Key: $KEY" '
        "-H 'Content-Type: application/json' -d \"$BODY\""
    )
    print(f"  {command} records list --config {shlex.quote(str(config))} --plan my-plan")


def run(port: int, tool_port: int, once: bool) -> int:
    """Start the demo, walk through it, and serve until Ctrl-C (or return if ``once``)."""
    workdir = Path(tempfile.mkdtemp(prefix="tool-proxy-demo-"))
    config_path = workdir / "config.yaml"
    token, token_file = secrets.token_urlsafe(18), workdir / "admin-token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    config = demo_config(port, tool_port, workdir / "state.db", token_file)
    config_path.write_text(yaml.safe_dump(config))
    log_path = workdir / "proxy.log"
    tool = _start_tool(tool_port)
    base, tool_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{tool_port}"
    env = {k: v for k, v in os.environ.items() if k != "TOOL_PROXY_STORE_URL"}
    with log_path.open("wb") as log:
        proxy = subprocess.Popen(
            [sys.executable, "-m", "proxy.cli", "serve", "--config", str(config_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        _wait_ready(f"{base}/_proxy/readyz", proxy)
        print(f"tool-proxy demo: {base} -> demo tool {tool_url}")
        print(f"config {config_path}, store {workdir / 'state.db'}, JSON logs in {log_path}\n")
        plan = _walk(base, tool_url)
        print(f"The operator console: {base}{CONSOLE_PATH}plans?plan={plan}")
        print(f"   sign in with the admin token {token} (also in {token_file})\n")
        if once:
            return 0
        _try_it(base, config_path, plan)
        sys.stdout.flush()
        proxy.wait()
    except KeyboardInterrupt:
        pass
    except RuntimeError as exc:
        print(f"error: {exc}\n{log_path.read_text()}", file=sys.stderr)
        return 1
    finally:
        proxy.terminate()
        proxy.wait(10)
        tool.should_exit = True
    return 0
