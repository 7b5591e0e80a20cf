"""The operator console end to end in a real headless browser: Debian's chromium driven
by Playwright (one browser and one proxy on SQLite for the module, a fresh browser
context per test). Sign in, find a plan, resolve an unknown outcome with a reason and see
the record change, requeue a dead operation, see a tool's ``<script>`` as text, the CSRF
refusal, the CSP, labels and the keyboard, live updates over SSE, the routes' limits.

``CONSOLE_SCREENSHOTS=docs/console`` keeps the screenshots of each view there (the ones
in docs/console.md); otherwise they go to the test's temporary directory."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Dialog, Page, sync_playwright

from proxy.console import CONSOLE_PATH, COOKIE
from tests.conftest import ProxyFactory, new_key
from tests.test_console import (  # noqa: F401 (fixtures: console_tool ... live_soon)
    BODY,
    LATE,
    SCRIPT,
    TOKEN,
    ConsoleTool,
    Setup,
    console_tool,
    fresh_tool,
    live_soon,
    module_proxy,
    start,
)

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# Every field a person fills in has a name a screen reader reads out.
UNLABELLED = """() => Array.from(document.querySelectorAll('input, select, textarea, button'))
  .filter(el => el.type !== 'hidden')
  .filter(el => !(el.labels && el.labels.length) && !el.getAttribute('aria-label')
                && !(el.tagName === 'BUTTON' && el.textContent.trim()))
  .map(el => el.outerHTML)"""


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """Module-scoped: Playwright's sync API keeps its event loop marked running while it
    is open, and every later `asyncio.run` in the session would refuse to start."""
    if not Path(CHROMIUM).exists():
        pytest.fail("chromium is not installed: scripts/install installs it (Debian package)")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield launched
        launched.close()


@pytest.fixture(scope="module")
def setup(
    console_tool: ConsoleTool,  # noqa: F811
    module_proxy: ProxyFactory,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Setup:
    return start(console_tool, module_proxy, f"sqlite://{tmp_path_factory.mktemp('db')}/state.db")


@pytest.fixture
def fresh(browser: Browser, setup: Setup) -> Iterator[Page]:
    """A page of a fresh browser context, not signed in; closed before the next test (its
    live streams end with it)."""
    context = browser.new_context(viewport={"width": 1280, "height": 900}, reduced_motion="reduce")
    opened = context.new_page()
    opened.set_default_timeout(10_000)
    yield opened
    context.close()


@pytest.fixture
def page(fresh: Page, setup: Setup) -> Page:
    """A fresh page signed in already (the cookie the sign-in sets: the sign-in itself is
    test_find_a_plan_and_resolve_its_unknown_outcome's)."""
    fresh.context.add_cookies(
        [
            {
                "name": COOKIE,
                "value": TOKEN,
                "domain": "127.0.0.1",
                "path": CONSOLE_PATH,
                "httpOnly": True,
                "sameSite": "Strict",
            }
        ]
    )
    return fresh


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    where = Path(os.environ.get("CONSOLE_SCREENSHOTS", tmp_path))
    where.mkdir(parents=True, exist_ok=True)
    return where


def sign_in(page: Page, setup: Setup) -> None:
    page.goto(setup.url)
    assert "/_proxy/console/login?next=" in page.url
    page.get_by_label("Admin token or JWT").fill(TOKEN)
    page.keyboard.press("Enter")
    page.wait_for_url(setup.url)


def answering(page: Page, accept: bool) -> list[str]:
    """Accept (or dismiss) every dialog (the console's confirmations); their messages."""
    messages: list[str] = []

    def answer(dialog: Dialog) -> None:
        messages.append(dialog.message)
        if accept:
            dialog.accept()
        else:
            dialog.dismiss()

    page.on("dialog", answer)
    return messages


def labelled(page: Page) -> None:
    assert page.evaluate(UNLABELLED) == []


def test_find_a_plan_and_resolve_its_unknown_outcome(
    fresh: Page, setup: Setup, shots: Path
) -> None:
    page = fresh
    plan = "plan-browser"
    assert setup.call(new_key(BODY, 1, plan)).status_code == 201
    assert setup.call(new_key({"n": 2}, 2, plan), body={"n": 2}, delay=LATE).status_code == 504
    assert setup.call(new_key({"n": 3}, 2, plan), body={"n": 3}).status_code == 201
    dialogs = answering(page, accept=True)

    sign_in(page, setup)
    labelled(page)
    page.screenshot(path=shots / "records.png", full_page=True)

    page.get_by_role("link", name="Plan sessions").click()
    page.get_by_label("Plan session id").fill(plan)
    page.get_by_role("button", name="Find").click()
    page.get_by_text("replanned: 2 args hashes").wait_for()
    labelled(page)
    page.screenshot(path=shots / "plan.png", full_page=True)

    page.locator("tr.row-failed a").click()  # the failed call of step 2
    page.get_by_role("heading", name="Resolve this unknown outcome").wait_for()
    labelled(page)
    page.get_by_label("Body (the tool's answer)").fill('{"resolved": true}')
    page.locator("#reason-c").fill("INC-7: the tool's log shows the call")
    page.get_by_label("I checked the tool: the call ran").check()
    page.screenshot(path=shots / "record.png", full_page=True)
    page.get_by_role("button", name="Resolve as completed").click()
    page.get_by_role("status").get_by_text("resolved as completed").wait_for()
    assert dialogs and "replay" in dialogs[0]
    assert page.locator(".state-completed").first.is_visible()
    replay = setup.call(new_key({"n": 2}, 2, plan), body={"n": 2}, delay=LATE)
    assert replay.json() == {"resolved": True}


def test_a_tool_answer_with_a_script_is_text_and_csp_holds(page: Page, setup: Setup) -> None:
    assert setup.call(new_key(BODY, 1, "plan-xss")).status_code == 201
    dialogs = answering(page, accept=False)
    page.goto(f"{setup.url}records?plan=plan-xss")
    with page.expect_response(lambda r: "/records/" in r.url) as shown:
        page.get_by_role("link", name="details").click()
    csp = shown.value.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp
    assert SCRIPT in page.locator("pre.body").inner_text()
    assert page.locator("pre.body script").count() == 0
    assert "tok-s3cr3t" not in page.content()
    page.wait_for_load_state("load")
    assert dialogs == []  # the tool's script never ran


def test_a_form_with_a_wrong_csrf_token_is_refused(page: Page, setup: Setup) -> None:
    assert setup.call(new_key(BODY, 1, "plan-csrf"), delay=LATE).status_code == 504
    answering(page, accept=True)
    page.goto(f"{setup.url}records?plan=plan-csrf")
    page.get_by_role("link", name="details").click()
    page.evaluate("document.querySelectorAll('input[name=csrf]').forEach(i => i.value = 'x')")
    page.locator("#reason-r").fill("never arrived")
    page.get_by_label("I checked the tool: the call did not run").check()
    page.get_by_role("button", name="Release").click()
    page.get_by_text("CSRF token").wait_for()
    page.goto(f"{setup.url}records?plan=plan-csrf")
    assert page.locator(".state-failed").count() == 1  # unchanged


def test_requeue_a_dead_operation_and_follow_it_live(page: Page, setup: Setup, shots: Path) -> None:
    job = setup.job()
    answering(page, accept=True)
    page.goto(setup.url)
    page.get_by_role("link", name="Operations").click()
    page.get_by_label("State").select_option("dead")
    page.get_by_role("button", name="Filter").click()
    box = page.get_by_label(f"Select operation {job}")
    box.wait_for()
    labelled(page)
    page.screenshot(path=shots / "operations.png", full_page=True)
    box.check()
    page.get_by_label("Reason (audit log)").fill("the tool is back")
    page.get_by_label("Confirm").check()
    setup.tool.broken = False
    page.get_by_role("button", name="Requeue selected (dead)").click()
    page.get_by_role("status").get_by_text("1 requeued").wait_for()
    # the operation's page follows it without a reload: queued, running, completed
    page.locator("[data-live] .state-completed").first.wait_for()
    assert page.locator("ol.events li").count() >= 5
    page.screenshot(path=shots / "operation.png", full_page=True)


def test_live_records_keyboard_and_routes(page: Page, setup: Setup, shots: Path) -> None:
    page.goto(f"{setup.url}records?plan=plan-live")
    page.get_by_text("No record matches").wait_for()
    setup.call(new_key(BODY, 1, "plan-live"))
    page.get_by_role("cell", name="plan-live", exact=True).wait_for()  # no reload: SSE
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.textContent") == "Skip to content"
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.textContent") == "tool-proxy console"
    for _ in range(2):
        page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.textContent") == "Plan sessions"
    page.keyboard.press("Enter")
    page.wait_for_url("**/plans")
    page.goto(f"{setup.url}routes")
    paced = page.locator("article", has=page.get_by_role("heading", name="paced"))
    paced.get_by_text("5 of 5 left now").wait_for()
    assert (
        setup.call(new_key(BODY, 1, "plan-routes"), path="paced", caller="ana").status_code == 201
    )
    slowed = setup.call(new_key(BODY, 2, "plan-routes"), path="paced", status="429", caller="ana")
    assert slowed.status_code == 429
    paced.get_by_text("Paused by the tool for 1 caller").wait_for()  # no reload: SSE
    assert "3 of 5 left now" in paced.inner_text()
    assert paced.locator("tr.row-limited").count() == 1
    labelled(page)
    page.screenshot(path=shots / "routes.png", full_page=True)
