"""The operator console: server-rendered pages under ``/_proxy/console/``.

A browser face of the admin API, with its credential and its operations: the same
``records.Records`` changes (and audit events) as ``/_proxy/admin/records``, the same
``operations.Operations`` requeue and cancel as ``/_proxy/admin/operations``. Only when
``admin`` is configured (else every path under it is 404, like the admin API).

- Sign-in: the operator pastes the admin token (or a JWT with ``admin.role``); it is kept
  in an ``HttpOnly``, ``SameSite=Strict`` cookie scoped to the console and checked by
  ``AdminAuth`` on every request. An ``Authorization: Bearer`` header works as well.
- Every change is a POST form with a CSRF token (an HMAC of the credential: nothing to
  keep per session, every replica agrees) and, where it changes a record, a reason and
  a confirmation. A foreign ``Origin`` is refused.
- Pages are readable without JavaScript; ``static/console.js`` (no inline script: the
  ``Content-Security-Policy`` forbids it) asks before a change and swaps each page's
  ``data-live`` region with what ``live/{view}`` streams (SSE) when the store changes.
- Output is escaped (Jinja2 autoescape): a tool's answer holding HTML shows as text;
  headers and JSON fields named like credentials are redacted as in the logs.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from datetime import UTC, datetime
from importlib import resources
from typing import Any
from urllib.parse import quote, urlencode

import jinja2
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Route

from proxy import records
from proxy.admin import READ_ONLY, AdminAuth
from proxy.auth.callers import Authenticator, bearer_token
from proxy.config import Config, LimitConfig, RouteConfig
from proxy.errors import (
    Forbidden,
    InvalidField,
    OperationNotFound,
    ProxyError,
    RecordNotFound,
    StoredResponseUnavailable,
    Unauthorized,
)
from proxy.job_events import Hub
from proxy.jobs import RouteJobs, listing
from proxy.logs import REDACTED, is_secret
from proxy.offload import Offload
from proxy.operations import STATES, Caller, Operations, check_cursor
from proxy.problems import problem_response
from proxy.store import JobState, Queue, Record, RecordKey, State, Store, make_buckets, make_locks
from proxy.store.buckets import Buckets, Entry, GroupState
from proxy.store.locks import Locks, LocksHeld

CONSOLE_PATH = "/_proxy/console/"
COOKIE = "tool_proxy_console"
# What a console page may load: its own script and style sheet, nothing inline, no frames.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",  # not no-referrer: Chrome then posts Origin: null
    "Cache-Control": "no-store",
}
# Seconds between two looks at the store for a page's live region (per open page).
LIVE_SECONDS = 2.0
# Records per page of the records view, and listing requests a plan look-up makes at
# most (each one bounded as the admin API's: records.SCAN_CALLS x records.SCAN_COUNT).
PAGE_RECORDS = 50
PLAN_PAGES = 20
# Operations per page of the operations view.
PAGE_OPERATIONS = 100
# Entries of each kind (rate buckets, slot sets, pauses) one look at a route's limits
# reads at most, and locks held per policy; the routes view lists this many locks.
LIMIT_ENTRIES = 100
LOCKS_SHOWN = 20
# The policies whose resource locks the routes view lists (their fencing scopes).
LOCK_POLICIES = ("lock", "versioning")
# How the records view orders a page: what needs attention first.
ATTENTION = {State.FAILED: 0, State.IN_PROGRESS: 1, State.COMPLETED: 2}
STATIC = {"console.css": "text/css", "console.js": "text/javascript"}
_CSRF_CONTEXT = b"tool-proxy console csrf"

Params = Mapping[str, str]
"""A view's parameters: the query string and the path's ``id``, as text."""


def csrf_token(credential: str) -> str:
    """The CSRF token of forms for one credential: an HMAC of it (the credential sits in
    an HttpOnly cookie, so another site can neither read it nor compute this)."""
    return hmac.new(credential.encode(), _CSRF_CONTEXT, hashlib.sha256).hexdigest()


def secret(name: str) -> bool:
    """A header or field named like a credential, as the logs judge it (``x-api-key``
    too: header names spell ``api_key`` with a hyphen)."""
    return is_secret(name.replace("-", "_"))


def redact_json(value: Any) -> Any:
    """A JSON value with every member named like a credential replaced, as in the logs."""
    if isinstance(value, dict):
        return {k: REDACTED if secret(k) else redact_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact_json(v) for v in value]
    return value


def shown_body(text: str, content_type: str) -> str:
    """A text body as the console shows it: JSON pretty-printed and redacted."""
    if "json" not in content_type:
        return text
    try:
        return json.dumps(redact_json(json.loads(text)), indent=2, ensure_ascii=False)
    except ValueError:
        return text


def response_detail(record: Record) -> dict[str, Any] | None:
    """The recorded answer of a record for the detail page, secrets redacted."""
    view = records.record_view(record, body=True)["response"]
    if view is None:
        return None
    headers = [[n, REDACTED if secret(n) else v] for n, v in view["headers"]]
    content_type = next((v for n, v in headers if n == "content-type"), "")
    if view.get("body_encoding") == "utf-8":
        view["body"] = shown_body(view["body"], content_type)
    return {"body_offloaded": None, "body_encoding": None, **view, "headers": headers}


def policies(route: RouteConfig) -> dict[str, Any]:
    """A route's configuration as the routes view lists it, credentials redacted."""

    def leaves(value: Any) -> Any:
        if isinstance(value, dict):
            return {
                k: REDACTED if secret(k) and not isinstance(v, dict | list) else leaves(v)
                for k, v in value.items()
            }
        return [leaves(v) for v in value] if isinstance(value, list) else value

    dumped = route.model_dump(mode="json", exclude_none=True, by_alias=True)
    return {k: leaves(v) for k, v in dumped.items() if k not in ("name",)}


def _in_limit(name: str, key: str) -> bool:
    """Whether a bucket or slot set's key is one of limit ``name``'s (``name`` alone, or
    ``name|<digest of the caller's key value>``)."""
    return key == name or key.startswith(name + "|")


def _until(now: float, seconds: float) -> str:
    """When something ``seconds`` from ``now`` ends, to the second (UTC): a time, not a
    countdown, so a live region changes when the state does, not every second."""
    return datetime.fromtimestamp(math.ceil(now + seconds), UTC).strftime("%H:%M:%S UTC")


def rate_left(config: LimitConfig, ahead: float) -> tuple[int, int]:
    """Whole units a rate's bucket holds now, ``ahead`` seconds of use in it; its burst."""
    quota, period = config.quota_period()
    interval = period / quota
    burst = config.burst if config.burst is not None else quota
    left = math.floor((interval * burst - ahead) / interval + 1e-6)
    return max(min(left, int(burst)), 0), int(burst)


def limit_now(config: LimitConfig, state: GroupState, now: float) -> dict[str, Any]:
    """One limit as the store holds it now: a sentence, and whether it refuses calls
    (a bucket empty, or every slot taken) for some caller."""
    if config.rate is not None:
        return _rate_now(config, [e for e in state.rates if _in_limit(config.name, e.key)], now)
    return _slots_now(config, [e for e in state.slots if _in_limit(config.name, e.key)])


def _rate_now(config: LimitConfig, entries: list[Entry], now: float) -> dict[str, Any]:
    lefts = [(rate_left(config, e.seconds)[0], e.seconds) for e in entries]
    burst = rate_left(config, 0.0)[1]
    if config.key == "route":
        left, ahead = lefts[0] if lefts else (burst, 0.0)
        refill = f"; full again at {_until(now, ahead)}" if ahead > 0 else ""
        return {"text": f"{left} of {burst} left now{refill}", "limited": left == 0}
    empty = sum(1 for left, _ in lefts if left == 0)
    text = f"{len(lefts)} callers' buckets in use, {empty} of them empty"
    if lefts:
        text += f" (the lowest: {min(left for left, _ in lefts)} of {burst} left)"
    return {"text": text, "limited": empty > 0}


def _slots_now(config: LimitConfig, entries: list[Entry]) -> dict[str, Any]:
    capacity = config.max_in_flight or 0
    if config.key == "route":
        held = entries[0].held if entries else 0
        return {"text": f"{held} of {capacity} slots taken", "limited": held >= capacity}
    full = sum(1 for e in entries if e.held >= capacity)
    most = max((e.held for e in entries), default=0)
    text = f"{len(entries)} callers with calls in flight (the most: {most} of {capacity})"
    return {"text": text + (f", {full} of them full" if full else ""), "limited": full > 0}


def pauses_now(state: GroupState, now: float) -> dict[str, Any]:
    """The pauses the tool set on a route: the whole route's, and its callers'."""
    route = next((p.seconds for p in state.pauses if not p.key), None)
    callers = [p.seconds for p in state.pauses if p.key]
    return {
        "route": None if route is None else _until(now, route),
        "callers": len(callers),
        "longest": _until(now, max(callers)) if callers else None,
    }


def locks_now(policy: str, held: LocksHeld, now: float) -> list[dict[str, Any]]:
    """The locks a route's ``policy`` holds: the resource (a digest of its key's value,
    never the value), the fencing token, the lease left."""
    return [
        {
            "policy": policy,
            "resource": lock.key.rpartition("|")[2],
            "token": lock.token,
            "until": _until(now, lock.expires_in),
        }
        for lock in held.locks
    ]


def _text(params: Params, name: str) -> str | None:
    """A parameter, None when absent or empty (an empty form field means "any")."""
    value = params.get(name, "").strip()
    return value or None


def _form_headers(text: str) -> list[tuple[str, str]]:
    """``name: value`` lines of the resolve form."""
    pairs = []
    for line in text.splitlines():
        if not line.strip():
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise InvalidField("headers", f"{line.strip()!r} is not a 'name: value' line")
        pairs.append((name.strip(), value.strip()))
    return pairs


def _status(text: str | None) -> int:
    try:
        return int(text or "")
    except ValueError:
        raise InvalidField("status", "must be an HTTP status from 200 to 599") from None


def _confirmed(form: FormData) -> None:
    if form.get("confirm") != "yes":
        raise InvalidField("confirm", "tick the confirmation box to make this change")


class Operator:
    """Who is signed in: the audit identity, the CSRF token of their forms, and whether
    they may change anything (not with ``admin.read_role``)."""

    def __init__(self, identity: str, credential: str) -> None:
        self.identity = identity
        self.csrf = csrf_token(credential)
        self.can_change = not identity.endswith(READ_ONLY)


Handler = Callable[[Request], Awaitable[Response]]
View = Callable[[Params], Awaitable[dict[str, Any]]]


class Console:
    """The console's pages, live regions and forms."""

    def __init__(
        self,
        config: Config,
        store: Store,
        auth: AdminAuth,
        desk: records.Records,
        operations: Operations | None,
        offload: Offload | None,
        max_body: int,
    ) -> None:
        self.config = config
        self.offload = offload
        self.store = store
        self.auth = auth
        self.desk = desk
        self.operations = operations
        self.max_body = max_body
        self.buckets: Buckets | None = _part(make_buckets, store)
        self.locks: Locks | None = _part(make_locks, store)
        self.templates = jinja2.Environment(
            loader=jinja2.PackageLoader("proxy", "templates/console"),
            autoescape=True,
            undefined=jinja2.StrictUndefined,
        )
        self.templates.globals.update(base=CONSOLE_PATH, iso=records.iso)
        self.views: dict[str, tuple[View, str]] = {
            "records": (self.records_view, "records.html"),
            "record": (self.record_view, "record.html"),
            "plan": (self.plan_view, "plan.html"),
            "operations": (self.operations_view, "operations.html"),
            "operation": (self.operation_view, "operation.html"),
            "routes": (self.routes_view, "routes.html"),
        }

    # -- responses ---------------------------------------------------------------------

    def render(self, template: str, context: dict[str, Any], status: int = 200) -> Response:
        context = {"operator": None, "notice": None, "live": None, **context}
        html = self.templates.get_template(template).render(context)
        return HTMLResponse(html, status, headers=SECURITY_HEADERS)

    def live_html(self, template: str, context: dict[str, Any]) -> str:
        """The page's ``live`` block alone, as its SSE events carry it."""
        page = self.templates.get_template(template)
        return "".join(page.blocks["live"](page.new_context(context)))

    def problem(self, exc: ProxyError, operator: Operator | None) -> Response:
        context = {"operator": operator, "error": exc, "title": exc.title}
        return self.render("error.html", context, exc.status)

    # -- sign-in -----------------------------------------------------------------------

    @staticmethod
    def credential(request: Request) -> str | None:
        return bearer_token(request.headers.get("authorization")) or request.cookies.get(COOKIE)

    async def operator(self, request: Request, looking: bool = True) -> Operator:
        """Who is signed in; ``looking`` (a view) accepts ``admin.read_role`` too."""
        credential = self.credential(request)
        identity = await self.auth.verify(credential, looking=looking)
        return Operator(identity, credential or "")

    async def login_page(self, request: Request) -> Response:
        after = _after_login(request.query_params.get("next"))
        context = {"error": None, "title": "Sign in", "next": after}
        return self.render("login.html", context)

    async def login(self, request: Request) -> Response:
        _same_origin(request)
        form = await request.form()
        credential = str(form.get("token", "")).strip()
        after = _after_login(str(form.get("next", "")))
        try:
            await self.auth.verify(credential or None, looking=True)
        except (Unauthorized, Forbidden) as exc:
            context = {"error": exc, "title": "Sign in", "next": after}
            return self.render("login.html", context, exc.status)
        response = RedirectResponse(after, 303, headers=SECURITY_HEADERS)
        response.set_cookie(
            COOKIE,
            credential,
            path=CONSOLE_PATH,
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
        return response

    async def logout(self, request: Request) -> Response:
        await self._change(request, looking=True)
        response = RedirectResponse(CONSOLE_PATH + "login", 303, headers=SECURITY_HEADERS)
        response.delete_cookie(COOKIE, path=CONSOLE_PATH)
        return response

    async def _change(self, request: Request, looking: bool = False) -> tuple[Operator, FormData]:
        """The operator and form of a change: same origin, a valid CSRF token, and (unless
        ``looking``: signing out) a credential that may change things."""
        _same_origin(request)
        operator = await self.operator(request, looking=looking)
        form = await request.form(max_fields=1000, max_part_size=self.max_body)
        token = str(form.get("csrf", ""))
        if not hmac.compare_digest(token.encode(), operator.csrf.encode()):
            raise Forbidden("the form's CSRF token is missing or wrong: reload the page")
        return operator, form

    def guard(self, handler: Handler) -> Handler:
        """Errors as pages: a page asked without a (valid) sign-in cookie leads to the
        sign-in (an expired JWT, too); anything else shows the problem. A client that
        asks for JSON (``wants_problem``) gets the RFC 9457 document instead."""

        async def guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except ProxyError as exc:
                if wants_problem(request):
                    response = problem_response(exc)
                    response.headers.update(SECURITY_HEADERS)
                    return response
                if isinstance(exc, Unauthorized | Forbidden) and _to_login(request):
                    back = request.url.path + (f"?{request.url.query}" if request.url.query else "")
                    login = f"{CONSOLE_PATH}login?{urlencode({'next': back})}"
                    return RedirectResponse(login, 303, SECURITY_HEADERS)
                return self.problem(exc, None)

        return guarded

    # -- pages -------------------------------------------------------------------------

    def page(self, name: str) -> Handler:
        view, template = self.views[name]

        async def show(request: Request) -> Response:
            operator = await self.operator(request)
            params = {**request.query_params, **request.path_params}
            context = {**await view(params), "operator": operator}
            seen = _digest(self.live_html(template, context))
            live = f"{CONSOLE_PATH}live/{name}?{_query({**params, 'seen': seen})}"
            notice = request.query_params.get("done")
            context.update(live=live, notice=notice)
            return self.render(template, context)

        return show

    async def live(self, request: Request) -> Response:
        """SSE: the page's live region again whenever what it shows changes."""
        operator = await self.operator(request)
        name = request.path_params["view"]
        if name not in self.views:
            raise InvalidField("view", "not a console view")
        view, template = self.views[name]
        params = dict(request.query_params)
        shown = params.pop("seen", None)  # the digest of the region the page holds now

        async def events() -> AsyncIterator[ServerSentEvent]:
            nonlocal shown
            while True:
                try:
                    context = await view(params)
                    html = self.live_html(template, {**context, "operator": operator})
                except ProxyError as exc:  # e.g. the record was deleted, the store is down
                    html = self.live_html("error.html", {"error": exc})
                if _digest(html) != shown:
                    shown = _digest(html)
                    yield ServerSentEvent(data=html, event="live")
                await asyncio.sleep(LIVE_SECONDS)

        return EventSourceResponse(events(), ping=15, headers=SECURITY_HEADERS)

    async def static(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name not in STATIC:
            raise InvalidField("name", "no such file")
        data = resources.files("proxy").joinpath("static", name).read_bytes()
        headers = {**SECURITY_HEADERS, "Cache-Control": "no-cache"}
        return Response(data, media_type=STATIC[name], headers=headers)

    async def body(self, request: Request) -> Response:
        """A recorded body as a download (offloaded, or bytes that are not text): never
        rendered by the browser (``attachment``, ``application/octet-stream``)."""
        await self.operator(request)
        record = await self.desk.get(records.parse_id(request.path_params["id"]))
        response = records.stored(record)
        if response is None:
            raise RecordNotFound("nothing is recorded for this record")
        content: bytes | AsyncIterator[bytes] = response.body
        if response.ref is not None:
            if self.offload is None:
                raise StoredResponseUnavailable(
                    "the body was offloaded, but no object store is configured now"
                )
            content = await self.offload.get(response.ref)
        headers = {**SECURITY_HEADERS, "Content-Disposition": "attachment; filename=body.bin"}
        if isinstance(content, bytes):
            return Response(content, media_type="application/octet-stream", headers=headers)
        return StreamingResponse(content, media_type="application/octet-stream", headers=headers)

    # -- views (each: parameters -> template context) --------------------------------

    def _routes_named(self) -> list[str]:
        return [r.name for r in self.config.routes if r.idempotency is not None]

    async def records_view(self, params: Params) -> dict[str, Any]:
        raw = {name: _text(params, name) for name in ("route", "state", "plan", "older_than")}
        where = records.parse_filter(raw)
        page = await records.list_records(self.store, where, PAGE_RECORDS, params.get("cursor", ""))
        found = sorted(page.records, key=lambda r: (ATTENTION[r.state], -r.created_at))
        return {
            "title": "Records",
            "filters": {k: v or "" for k, v in raw.items()},
            "routes": self._routes_named(),
            "states": [s.value for s in State],
            "records": [records.record_view(r) for r in found],
            "next_cursor": page.cursor,
        }

    async def record_view(self, params: Params) -> dict[str, Any]:
        key = records.parse_id(params.get("id", ""))
        record = await self.desk.get(key)
        view = records.record_view(record)
        return {
            "title": f"Record {view['route']} {view['plan'] or ''} {view['step'] or ''}",
            "record": view,
            "fingerprint": record.fingerprint,
            "owner": record.owner,
            "response": response_detail(record),
        }

    async def plan_view(self, params: Params) -> dict[str, Any]:
        plan = _text(params, "plan")
        context: dict[str, Any] = {"title": "Plan sessions", "plan": plan or "", "steps": []}
        if plan is None:
            return context
        where = records.Filter(plan=plan)
        found: list[Record] = []
        cursor, complete = "", False
        for _ in range(PLAN_PAGES):
            page = await records.list_records(self.store, where, records.MAX_LIMIT, cursor)
            found += page.records
            cursor = page.cursor
            if not cursor:
                complete = True
                break
        context.update(steps=plan_steps(found), complete=complete)
        return context

    async def operations_view(self, params: Params) -> dict[str, Any]:
        ops = self._ops()
        state_name = _text(params, "state")
        state = None if state_name is None else STATES.get(state_name)
        if state_name is not None and state is None:
            raise InvalidField("state", f"one of {', '.join(STATES)}")
        after = check_cursor(params.get("cursor", ""))
        cursor, page = await ops.queue.list(state, after, PAGE_OPERATIONS)
        return {
            "title": "Operations",
            "state": state_name or "",
            "states": list(STATES),
            "operations": [listing(j) for j in page],
            "next_cursor": cursor,
        }

    async def operation_view(self, params: Params) -> dict[str, Any]:
        job, _ = await self._ops().find(params.get("id", ""))
        events = await self._ops().queue.events(job.id, 0) or []
        record = records.record_id(RecordKey(job.slot, job.name))
        return {
            "title": f"Operation {job.id}",
            "operation": {"error": None, **listing(job), "sent": job.sent},
            "record_id": record,
            "events": [{"error": None, **listing(e), "seq": e.seq} for e in events],
        }

    async def routes_view(self, params: Params) -> dict[str, Any]:
        counts, partial = await self._in_progress()
        jobs = await self._job_counts()
        live = await asyncio.gather(*(self._route_now(r) for r in self.config.routes))
        return {
            "title": "Routes and limits",
            "routes": [
                {
                    "name": r.name,
                    "policies": policies(r),
                    "in_progress": counts.get(r.name, 0),
                    "operations": jobs.get(r.name, {}),
                    **now,
                }
                for r, now in zip(self.config.routes, live, strict=True)
            ],
            "counts_partial": partial,
        }

    async def _in_progress(self) -> tuple[dict[str, int], bool]:
        """Records in progress per route (calls in flight on every replica), and whether
        the listing stopped before it saw them all."""
        page = await records.list_records(
            self.store, records.Filter(state=State.IN_PROGRESS), records.MAX_LIMIT
        )
        counts: dict[str, int] = {}
        for record in page.records:
            route = records.Address.of(record.key).route if record.key else ""
            counts[route] = counts.get(route, 0) + 1
        return counts, bool(page.cursor)

    async def _job_counts(self) -> dict[str, dict[str, int]]:
        """Queued, running and dead operations per route."""
        jobs: dict[str, dict[str, int]] = {}
        if self.operations is not None:
            for state in (JobState.QUEUED, JobState.RUNNING, JobState.DEAD):
                _, page = await self.operations.queue.list(state, "", 1000)
                for job in page:
                    jobs.setdefault(job.route, {}).setdefault(state.value, 0)
                    jobs[job.route][state.value] += 1
        return jobs

    async def _route_now(self, route: RouteConfig) -> dict[str, Any]:
        """What the store holds for a route's limits and locks now (every replica's)."""
        now = time.time()
        limits: list[dict[str, Any]] = []
        pauses = {"route": None, "callers": 0, "longest": None}
        complete = True
        if route.limits and self.buckets is not None:
            state = await self.buckets.state(route.name, LIMIT_ENTRIES)
            limits = [{"name": c.name, **limit_now(c, state, now)} for c in route.limits]
            pauses, complete = pauses_now(state, now), state.complete
        held: list[dict[str, Any]] = []
        for policy in [p for p in LOCK_POLICIES if getattr(route, p) is not None]:
            found = await self._held(route.resource_scope(policy))
            held += locks_now(policy, found, now)
            complete = complete and found.complete
        return {"limits": limits, "pauses": pauses, "locks": held, "state_partial": not complete}

    async def _held(self, scope: str) -> LocksHeld:
        """The locks held in a fencing scope (none if the store keeps no locks)."""
        return LocksHeld() if self.locks is None else await self.locks.held(scope, LOCKS_SHOWN)

    def _ops(self) -> Operations:
        if self.operations is None:
            raise OperationNotFound("no route runs long calls (async)")
        return self.operations

    # -- changes -----------------------------------------------------------------------

    async def resolve(self, request: Request) -> Response:
        operator, form = await self._change(request)
        key = records.parse_id(request.path_params["id"])
        reason = records.check_reason(form.get("reason"))
        _confirmed(form)
        outcome = form.get("as")
        if outcome == "released":
            await self.desk.release(key, reason, operator.identity)
        elif outcome == "completed":
            response = records.answer(
                _status(str(form.get("status", ""))),
                _form_headers(str(form.get("headers", ""))),
                str(form.get("body", "")).encode(),
            )
            await self.desk.resolve(key, response, reason, operator.identity)
        else:
            raise InvalidField("as", "must be completed (the tool ran) or released (it did not)")
        return _done(f"records/{request.path_params['id']}", f"resolved as {outcome}")

    async def delete(self, request: Request) -> Response:
        operator, form = await self._change(request)
        key = records.parse_id(request.path_params["id"])
        reason = records.check_reason(form.get("reason"))
        _confirmed(form)
        await self.desk.delete(key, reason, operator.identity)
        return _done("records", "record deleted")

    async def requeue(self, request: Request) -> Response:
        operator, form = await self._change(request)
        _confirmed(form)
        reason = _text({"r": str(form.get("reason", ""))}, "r")
        ids = _ids(form)
        for job_id in ids:
            job, jobs = await self._ops().find(job_id)
            await self._ops().requeue_job(job, jobs, operator.identity, reason)
        return _done(_back(ids), f"{len(ids)} requeued")

    async def cancel(self, request: Request) -> Response:
        _, form = await self._change(request)
        _confirmed(form)
        ids = _ids(form)
        for job_id in ids:
            job, jobs = await self._ops().find(job_id)
            await self._ops().cancel_job(job, jobs)
        return _done(_back(ids), f"{len(ids)} cancelled")


def _part(make: Callable[[Store], Any], store: Store) -> Any:
    """The store's rate buckets or locks (``make_buckets``, ``make_locks``); None for a
    store that keeps none (the routes view then shows the configuration only)."""
    try:
        return make(store)
    except TypeError:
        return None


def plan_steps(found: Sequence[Record]) -> list[dict[str, Any]]:
    """A plan's records as a timeline: one entry per step (in step order), each with its
    attempts oldest first; a step with several args hashes is one the agent replanned."""
    steps: dict[str, list[dict[str, Any]]] = {}
    for record in sorted(found, key=lambda r: r.created_at):
        view = records.record_view(record)
        steps.setdefault(view["step"] or "", []).append(view)
    ordered = sorted(steps.items(), key=lambda s: (len(s[0]), s[0]))
    return [
        {
            "step": step,
            "calls": calls,
            "args_hashes": len({c["args_hash"] for c in calls}),
            "started": calls[0]["created_at"],
        }
        for step, calls in ordered
    ]


def _ids(form: FormData) -> list[str]:
    ids = [str(v) for v in form.getlist("ids") if str(v)]
    if not ids:
        raise InvalidField("ids", "select at least one operation")
    return ids


def _back(ids: list[str]) -> str:
    return f"operations/{ids[0]}" if len(ids) == 1 else "operations"


def _done(path: str, notice: str) -> Response:
    """Post/redirect/get: back to the page, with what was done."""
    return RedirectResponse(f"{CONSOLE_PATH}{path}?done={quote(notice)}", 303, SECURITY_HEADERS)


def _query(params: Params) -> str:
    return urlencode({k: v for k, v in params.items() if k != "done"})


def _after_login(target: str | None) -> str:
    """Where sign-in leads: the console page asked for, never elsewhere (no open redirect)."""
    if not target or not target.startswith(CONSOLE_PATH) or "//" in target or "\\" in target:
        return CONSOLE_PATH
    return target


def wants_problem(request: Request) -> bool:
    """Whether the client asks for JSON rather than a page (``Accept`` names JSON, such
    as ``application/problem+json``, and not HTML): scripts get problem documents."""
    accept = request.headers.get("accept", "").lower()
    return "json" in accept and "text/html" not in accept


def _to_login(request: Request) -> bool:
    """A page asked by a browser without a bearer token: the sign-in is the answer."""
    return request.method == "GET" and "authorization" not in request.headers


def _digest(html: str) -> str:
    return hashlib.sha256(html.encode()).hexdigest()[:16]


def _same_origin(request: Request) -> None:
    """Refuse a change posted from another site (its ``Origin`` is not ours)."""
    origin = request.headers.get("origin")
    if origin is None:
        return
    ours = f"{request.url.scheme}://{request.headers.get('host', '')}"
    if origin != ours:
        raise Forbidden("the form was posted from another origin")


def console_routes(
    config: Config,
    store: Store,
    authenticator: Authenticator | None,
    log: Any,
    jobs: dict[str, RouteJobs],
    queue: Queue | None,
    hub: Hub | None,
    caller: Caller,
    offload: Offload | None,
) -> Sequence[Route]:
    """The console, when ``admin`` is configured (none otherwise: 404 like the admin API);
    its operations view when some route runs long calls."""
    if config.admin is None:
        return []
    desk = records.Records(store, config.routes, log)
    auth = AdminAuth(config.admin, authenticator)
    operations = None
    if queue is not None and hub is not None:
        operations = Operations(jobs, queue, hub, caller, auth)
    console = Console(config, store, auth, desk, operations, offload, config.limits.max_body_bytes)
    base, guard = CONSOLE_PATH, console.guard
    return [
        Route(base, guard(console.page("records")), methods=["GET"]),
        Route(f"{base}login", console.login_page, methods=["GET"]),
        Route(f"{base}login", guard(console.login), methods=["POST"]),
        Route(f"{base}logout", guard(console.logout), methods=["POST"]),
        Route(f"{base}static/{{name}}", guard(console.static), methods=["GET"]),
        Route(f"{base}live/{{view}}", guard(console.live), methods=["GET"]),
        Route(f"{base}records", guard(console.page("records")), methods=["GET"]),
        Route(f"{base}records/{{id}}", guard(console.page("record")), methods=["GET"]),
        Route(f"{base}records/{{id}}/body", guard(console.body), methods=["GET"]),
        Route(f"{base}records/{{id}}/resolve", guard(console.resolve), methods=["POST"]),
        Route(f"{base}records/{{id}}/delete", guard(console.delete), methods=["POST"]),
        Route(f"{base}plans", guard(console.page("plan")), methods=["GET"]),
        Route(f"{base}operations", guard(console.page("operations")), methods=["GET"]),
        Route(f"{base}operations/requeue", guard(console.requeue), methods=["POST"]),
        Route(f"{base}operations/cancel", guard(console.cancel), methods=["POST"]),
        Route(f"{base}operations/{{id}}", guard(console.page("operation")), methods=["GET"]),
        Route(f"{base}routes", guard(console.page("routes")), methods=["GET"]),
    ]
