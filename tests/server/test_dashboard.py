"""The dashboard (kiln/server/dashboard.py): its routes and who sees what, in process; then the page in a
real headless Chromium (Playwright driving Debian's `chromium`, which `make test` installs when missing)
against real `kiln serve`s, with sessions made over gRPC."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kiln.client import Client
from kiln.engine.sampler import SamplingParams
from kiln.server.app import ServeOptions, try_it
from kiln.server.auth import ApiKeys, identity_of
from kiln.server.dashboard_state import DashboardState
from kiln.server.http import build_http_app
from kiln.server.metrics import Metrics
from kiln.server.service import RuntimeService

ADMIN_KEYS = """
[keys.alice]
key_sha256 = "{alice}"
[keys.bob]
key_sha256 = "{bob}"
[keys.ops]
key_sha256 = "{ops}"
admin = true
"""


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def keyed_http(tiny_llm, tmp_path) -> tuple[TestClient, dict[str, str]]:
    """An in-process HTTP app with keys alice, bob and the admin ops, and one session of alice and one of
    bob (alice's has had a turn); returns the client and each owner's session id."""
    digests = {name: hashlib.sha256(name.encode()).hexdigest() for name in ("alice", "bob", "ops")}
    keys_file = tmp_path / "keys.toml"
    keys_file.write_text(ADMIN_KEYS.format(**digests))
    llm = tiny_llm("llama")
    store = llm.sessions
    owned = {name: store.create([1, 2, 3, 4, 5], owner=identity_of(name)) for name in ("alice", "bob")}
    store.generate(owned["alice"], SamplingParams(max_tokens=4), owner=identity_of("alice")).result()
    app = build_http_app(RuntimeService(llm, "tiny"), ApiKeys(keys_file=str(keys_file)), Metrics(llm))
    return TestClient(app), owned


def test_a_key_sees_its_own_sessions_and_an_admin_key_sees_all(keyed_http):
    http, owned = keyed_http
    alice = http.get("/dashboard/state.json", headers=bearer("alice")).json()
    assert [row["id"] for row in alice["sessions"]] == [owned["alice"]]
    assert alice["sees_all"] is False and alice["sessions"][0]["owner"] is None  # no owner column for a key
    row = alice["sessions"][0]
    assert row["history"] == 9 and row["turns"] == 1 and row["state"] == "idle"
    assert row["reused"] + row["prefilled"] == 5
    everyone = http.get("/dashboard/state.json", headers=bearer("ops")).json()
    assert sorted(row["id"] for row in everyone["sessions"]) == sorted(owned.values())
    assert everyone["sees_all"] is True
    assert everyone["pool"]["used"] + everyone["pool"]["cached"] > 0
    assert everyone["invariant_violations"] == {"inv1": 0, "inv2": 0}

    detail = http.get(f"/dashboard/sessions/{owned['alice']}.json", headers=bearer("alice")).json()
    assert [(t["reused_tokens"] + t["prefilled_tokens"], t["generated_tokens"]) for t in detail["turns"]] == [(5, 4)]
    assert detail["pages_by_group"]["global"] + detail["pages_by_group"]["sliding_window"] == detail["pages"]
    # another key's session does not exist for this caller; the admin's drill-down reaches it
    assert http.get(f"/dashboard/sessions/{owned['bob']}.json", headers=bearer("alice")).status_code == 404
    assert http.get(f"/dashboard/sessions/{owned['bob']}.json", headers=bearer("ops")).status_code == 200


def test_the_page_is_open_its_data_is_not_and_unknown_paths_are_404(keyed_http):
    http, _ = keyed_http
    page = http.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/dashboard/app.js" in page.text and "https://" not in page.text  # nothing from a CDN
    assert http.get("/dashboard/app.js").status_code == 200
    assert http.get("/dashboard/style.css").status_code == 200
    assert http.get("/dashboard/state.json").status_code == 401
    assert http.get("/dashboard/state.json", headers=bearer("mallory")).status_code == 401
    # an unauthenticated caller learns nothing about which paths exist; an authenticated one gets 404
    assert http.get("/dashboard/nope").status_code == 401
    assert http.get("/dashboard/nope", headers=bearer("alice")).status_code == 404
    assert http.get("/dashboard/", headers=bearer("alice")).status_code == 404
    assert http.get("/dashboard/sessions/unknown.json", headers=bearer("ops")).status_code == 404
    paths = http.get("/openapi.json", headers=bearer("alice")).json()["paths"]
    assert not [path for path in paths if path.startswith("/dashboard")]  # a page, not part of the API


def test_polls_share_one_reading(tiny_llm, monkeypatch):
    """A flood of polls costs one survey of the sessions per refresh interval, not one each."""
    llm = tiny_llm("llama")
    surveys = []
    real = llm.sessions.survey
    monkeypatch.setattr(llm.sessions, "survey", lambda **kw: surveys.append(1) or real(**kw))
    state = DashboardState(llm, health=dict, refresh_s=3600)
    readings = {id(state.reading()) for _ in range(50)}
    assert len(readings) == 1 and len(surveys) == 1


def test_the_banner_names_the_dashboard():
    assert "Dashboard (" in try_it(ServeOptions(http_port=8123), auth=False)
    assert "http://127.0.0.1:8123/dashboard (it asks for an API key)" in try_it(ServeOptions(http_port=8123), auth=True)


# ---- in a real browser -----------------------------------------------------------------------------------

def _chromium() -> str:
    """Debian's Chromium binary (the wrapper script /usr/bin/chromium sets flags Playwright replaces)."""
    for candidate in ("/usr/lib/chromium/chromium", shutil.which("chromium"), shutil.which("chromium-browser")):
        if candidate and Path(candidate).exists():
            return candidate
    pytest.skip("no chromium: `apt-get install chromium` (make test installs it when run as root)")


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed: pip install -e '.[dev]'")
    executable = _chromium()
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox", "--disable-gpu"])
        yield launched
        launched.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    yield context.new_page()
    context.close()


POOL_USED = "JSON.parse(document.querySelector('#chart-pool').dataset.last || '{}').used"


def test_the_page_shows_a_new_session_and_the_pool_moving(tiny_server, page, tmp_path):
    page.goto(f"{tiny_server.http_url}/dashboard")
    page.wait_for_selector("#health.ok", timeout=10_000)
    page.wait_for_function(f"Number.isInteger({POOL_USED})", timeout=10_000)  # the first point of the pool chart
    used_before = page.evaluate(POOL_USED)
    with Client(tiny_server.grpc_address, tokenizer="server") as client:
        session = client.create_session()
        session.append_text("The dashboard watches this session. " * 4)
        "".join(session.generate_text(max_tokens=24))
        history = session.info().history_tokens
        row = f"#sessions tr[data-id='{session.id}']"
        page.wait_for_selector(row, timeout=10_000)
        page.wait_for_function("([row, n]) => document.querySelector(row + ' td.history')?.textContent === n",
                               arg=[row, f"{history:,}"], timeout=10_000)
        # the session's pages show on the pool chart
        page.wait_for_function(f"{POOL_USED} > {used_before}", timeout=10_000)
        page.locator(row).click()
        page.wait_for_selector("#chart-turns rect", state="attached", timeout=10_000)  # the drill-down plots its turn
        assert page.text_content("#detail-id") == session.id
        shot = tmp_path / "dashboard.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 10_000
        session.close()


def test_with_keys_the_page_asks_for_one_and_shows_only_its_sessions(auth_server, page):
    page.goto(f"{auth_server.http_url}/dashboard")
    page.wait_for_selector("#key-form:not([hidden])", timeout=10_000)
    assert page.is_hidden("#main")
    page.fill("#key", "not-a-key")
    page.click("#key-form button")
    page.wait_for_function("document.querySelector('#key-message').textContent.includes('refused')", timeout=10_000)
    assert page.is_hidden("#main")

    with Client(auth_server.grpc_address, api_key="key-a") as mine, Client(auth_server.grpc_address, api_key="key-b") as theirs:
        own, other = mine.create_session(), theirs.create_session()
        page.fill("#key", "key-a")
        page.click("#key-form button")
        page.wait_for_selector(f"#sessions tr[data-id='{own.id}']", timeout=10_000)
        assert page.query_selector(f"#sessions tr[data-id='{other.id}']") is None
        own.close()
        other.close()
