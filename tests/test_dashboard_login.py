"""The dashboard of a service with locked reads (`crossdc serve --lock-reads`) in a real browser: headless Chromium
logs in through the login form with a read token, lands on the page it asked for, and logs out.
(Over HTTP, cookie by cookie: tests/test_api_security.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from browser_harness import Site, Tab, browser_fixture, serve_fresh, tab_fixture  # noqa: F401

from crossdc.db.engine import make_engine
from crossdc.db.runlog import RunLog
from crossdc.db.security import create_token

RUN = "login-run"
TOKENS: dict[str, str] = {}


def write_run_and_token(db_url: str) -> None:
    with RunLog(db_url) as log:
        log.start_run(run_id=RUN, name="behind-the-login", strategy="fedavg", config={}, rounds_planned=2)
        log.flush(timeout=30)
    TOKENS["read"] = create_token(make_engine(db_url), "browser-reader", "read")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    with serve_fresh(tmp_path_factory, "login", write_run_and_token, lock_reads=True) as served:
        yield served


def test_a_browser_logs_in_with_a_read_token_sees_the_runs_and_logs_out(site: Site, tab: Tab) -> None:
    page: Any = tab.page
    tab.goto(f"{site.base}/")
    assert page.url == f"{site.base}/login?next=%2F"
    page.fill("#token", "cdx_not-a-token")
    page.click("button[type=submit]")
    assert "unknown, revoked or expired" in page.text_content("#login-error")
    assert tab.errors == ["console: Failed to load resource: the server responded with a status of 401 (Unauthorized)"]
    tab.errors.clear()  # the form again, answered 401: the one error expected
    page.fill("#token", TOKENS["read"])
    page.click("button[type=submit]")
    page.wait_for_url(f"{site.base}/")
    assert "behind-the-login" in page.text_content("main") and page.text_content("#dashboard-user") == "browser-reader"
    cookie = next(c for c in page.context.cookies() if c["name"] == "crossdc_session")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and TOKENS["read"] not in cookie["value"]
    tab.screenshot("dashboard-login.png")
    page.click("#logout")
    page.wait_for_url(f"{site.base}/login")
    assert tab.goto(f"{site.base}/runs/{RUN}").url.startswith(f"{site.base}/login?next=")
    assert tab.errors == [], tab.errors
