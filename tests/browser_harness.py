"""The dashboard in a real browser, for the test modules that drive it: the real app (`create_app`) served by uvicorn
on a free port in a thread, headless Chromium (Playwright), and a `Tab` that records what went wrong on its page.

A test module imports the fixtures `browser` and `tab` into its own namespace so that pytest finds them (under
their function names, which leave the fixture names free for the tests' arguments)::

    from browser_harness import Site, Tab, browser_fixture, serve, tab_fixture  # noqa: F401

and writes its own data before it serves the database (`with serve(db_url) as site: yield site`, or
`with serve_fresh(tmp_path_factory, name, write_runs) as site: yield site`).
Importing this module skips the importing test module where Playwright is not installed.
Screenshots land in `test-artifacts/` at the repository root.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from crossdc.dashboard.app import create_app
from crossdc.db.engine import upgrade
from crossdc.experiment.processes import free_port, wait_for_port

playwright_sync = pytest.importorskip("playwright.sync_api")

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "test-artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]


@dataclass
class Site:
    """The served app: its base URL and its database."""

    base: str
    db_url: str

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.base + path, timeout=30)


@contextlib.contextmanager
def serve(db_url: str, *, lock_reads: bool = False) -> Iterator[Site]:
    """The dashboard over `db_url` (reads locked if asked: `crossdc serve --lock-reads`), served by uvicorn on a free
    port in a thread until the block ends."""
    port = free_port()
    app = create_app(db_url, lock_reads=lock_reads)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", ws="none"))
    thread = threading.Thread(target=server.run, name="dashboard-under-test", daemon=True)
    thread.start()
    try:
        wait_for_port("127.0.0.1", port, timeout_s=30)
        yield Site(f"http://127.0.0.1:{port}", db_url)
    finally:
        server.should_exit = True
        thread.join(timeout=15)


@contextlib.contextmanager
def serve_fresh(tmp_path_factory: pytest.TempPathFactory, name: str, write: Callable[[str], None], *,
                lock_reads: bool = False) -> Iterator[Site]:
    """A new SQLite database (folder `name`) at the schema's head, filled by `write(db_url)`, served by :func:`serve`."""
    db_url = f"sqlite:///{tmp_path_factory.mktemp(name) / 'crossdc.db'}"
    upgrade(db_url)
    write(db_url)
    with serve(db_url, lock_reads=lock_reads) as served:
        yield served


@pytest.fixture(name="browser", scope="module")
def browser_fixture() -> Iterator[Any]:
    """Headless Chromium, one per test module."""
    with playwright_sync.sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@dataclass
class Tab:
    """A browser page, the console errors and uncaught exceptions it produced, and the URLs it requested."""

    page: Any
    errors: list[str] = field(default_factory=list)
    requested: list[str] = field(default_factory=list)

    def goto(self, url: str) -> Any:
        return self.page.goto(url, wait_until="load")

    def open_run(self, base: str, run_id: str) -> None:
        """The run page of `run_id`, which must answer 200."""
        response = self.goto(f"{base}/runs/{run_id}")
        assert response.status == 200

    def counts(self, div_id: str) -> list[int]:
        """Points per trace of the plotly chart in `div_id`."""
        return self.page.evaluate("id => document.getElementById(id).data.map(t => t.x.length)", div_id)

    def traces(self, div_id: str) -> list[dict[str, Any]]:
        """The plotly traces drawn in `div_id`: name, mode, x, y, text, customdata, line, marker colour."""
        return self.page.evaluate(
            """id => document.getElementById(id).data.map(t => ({
                 name: t.name, mode: t.mode, x: Array.from(t.x), y: Array.from(t.y), text: t.text || null,
                 customdata: t.customdata || null, line: t.line || null,
                 marker_color: t.marker ? t.marker.color : null }))""", div_id)

    def wait_for_charts(self, ids: list[str]) -> None:
        """Until plotly has drawn every chart in `ids`."""
        self.page.wait_for_function(
            "ids => ids.every(id => { const el = document.getElementById(id); return el && el.data && el._fullLayout; })",
            arg=ids, timeout=20_000)

    def wait_for_gossip_loads(self, loads: int) -> None:
        """Until the page's script has read and drawn the gossip views `loads` times."""
        self.page.wait_for_function("n => window.crossdc.gossip.loads >= n", arg=loads, timeout=20_000)

    def screenshot(self, name: str) -> Path:
        ARTIFACTS.mkdir(exist_ok=True)
        path = ARTIFACTS / name
        self.page.screenshot(path=str(path), full_page=True)
        return path


@pytest.fixture(name="tab")
def tab_fixture(browser: Any) -> Iterator[Tab]:
    """A fresh page (its own browser context) in `browser`."""
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    found = Tab(page)
    page.on("console", lambda message: found.errors.append(f"console: {message.text}") if message.type == "error" else None)
    page.on("pageerror", lambda error: found.errors.append(f"pageerror: {error}"))
    page.on("request", lambda request: found.requested.append(request.url))
    try:
        yield found
    finally:
        context.close()
