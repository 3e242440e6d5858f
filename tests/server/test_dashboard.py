"""The dashboard (kiln/server/dashboard.py): its routes and who sees what, in process; then the page in
real headless browsers against real `kiln serve`s, with sessions made over gRPC: Chromium (Playwright
driving Debian's `chromium`) and Firefox (Debian's `firefox-esr` over WebDriver BiDi,
tests/server/webdriver_bidi.py); `make test` installs both when missing."""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kiln.client import Client, Session
from kiln.engine.sampler import SamplingParams
from kiln.engine.stream import GenerationStream
from kiln.server.app import ServeOptions, try_it
from kiln.server.auth import ApiKeys, identity_of
from kiln.server.dashboard_state import EVICTION_REASONS, HISTORY_STEP_S, DashboardState
from kiln.server.http import build_http_app
from kiln.server.metrics import Metrics
from kiln.server.service import RuntimeService
from kiln.snapshots.manifest import Manifest, session_snapshot_id
from tests.server.conftest import free_port
from tests.server.webdriver_bidi import BidiSession, Tab, firefox, firefox_executable
from tests.snapshots.synthetic import blob_place

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


def _stored_bytes(root: Path, snapshot_id: str) -> int:
    """A snapshot's size as the dashboard defines it, measured on disk: its manifest file plus the blob
    blobs it references (their lengths in the packs' indexes, read from the files)."""
    manifest = Manifest.from_json((root / "manifests" / f"{snapshot_id}.json").read_bytes(), snapshot_id)
    blobs = sum(blob_place(root, digest)[1].length for digest in manifest.digests())
    return (root / "manifests" / f"{snapshot_id}.json").stat().st_size + blobs


def test_sessions_evicted_to_snapshots_are_listed_with_their_snapshots(tiny_llm, tmp_path):
    """A session the LRU cap evicted is listed, for its owner only, as "evicted to snapshot" with its
    history and last snapshot (time and size); a drill-down lists a session's snapshot and checkpoint;
    after a restart every saved session is listed so, read from the store."""
    llm = tiny_llm("llama", snapshot_dir=str(tmp_path), max_sessions=2, speculative=None)
    store, alice, bob = llm.sessions, identity_of("alice"), identity_of("bob")
    evicted = store.create(list(range(1, 40)), owner=alice)
    store.generate(evicted, SamplingParams(max_tokens=6, temperature=0.0), owner=alice).result()
    kept = store.create([5, 6, 7], owner=bob)
    checkpoint = store.snapshot(kept, owner=bob)
    store.create([8, 9], owner=bob)  # the cap evicts alice's session, least recently used
    assert llm.persistence.flush(30)
    state = DashboardState(llm, health=dict, refresh_s=0)

    rows = {row["id"]: row for row in state.reading().view(alice, sees_all=False)["sessions"]}
    assert list(rows) == [evicted]
    row = rows[evicted]
    assert row["state"] == "evicted to snapshot" and row["history"] == 45 and row["resident_bytes"] == 0
    assert abs(row["last_saved_at"] - time.time()) < 60
    assert row["snapshot_bytes"] == _stored_bytes(tmp_path, session_snapshot_id(evicted))
    bobs = state.reading().view(bob, sees_all=False)["sessions"]
    assert evicted not in {row["id"] for row in bobs} and {row["state"] for row in bobs} == {"idle"}
    assert all(row["snapshot_bytes"] == _stored_bytes(tmp_path, session_snapshot_id(row["id"])) for row in bobs)
    assert state.reading().session(evicted, bob, sees_all=False) is None

    detail = state.reading().session(kept, bob, sees_all=False)
    assert {(s["id"], s["kind"]) for s in detail["snapshots"]} == {(session_snapshot_id(kept), "session"),
                                                                  (checkpoint, "checkpoint")}
    assert {s["id"]: s["bytes"] for s in detail["snapshots"]}[checkpoint] == _stored_bytes(tmp_path, checkpoint)
    assert state.reading().session(evicted, alice, sees_all=False)["snapshots"][0]["history"] == 45

    llm.close()  # a restart: nothing is in memory, everything is in the store
    again = DashboardState(tiny_llm("llama", snapshot_dir=str(tmp_path), speculative=None), health=dict, refresh_s=0)
    everyone = again.reading().view(None, sees_all=True)["sessions"]
    assert {row["state"] for row in everyone} == {"evicted to snapshot"} and len(everyone) == 3
    assert {row["id"]: row["snapshot_bytes"] for row in everyone}[evicted] == row["snapshot_bytes"]
    assert {s["id"] for s in again.reading().session(kept, bob, sees_all=False)["snapshots"]} == {
        checkpoint, session_snapshot_id(kept)}


def test_evictions_are_charted_by_reason(tiny_llm):
    """Prefix-cache pages taken for new content count as "cached" K/V evicted (tokens per second)."""
    llm = tiny_llm("llama", kv_pages=12, speculative=None)
    state = DashboardState(llm, health=dict, refresh_s=0)
    state.reading()
    for seed in range(6):  # each stateless prompt leaves its full pages cached; later ones need their pages
        llm.generate([[(seed * 37 + i * 11) % 256 for i in range(40)]], SamplingParams(max_tokens=2, temperature=0.0))
    time.sleep(HISTORY_STEP_S)
    reading = state.reading()
    assert reading.overview["pool"]["evicted_tokens"]["cached"] > 0
    assert reading.overview["history"][-1]["evicted_cached"] > 0
    assert set(reading.overview["pool"]["evicted_tokens"]) == set(EVICTION_REASONS)


def test_requests_in_flight_are_listed_and_fill_the_latency_percentiles(tiny_llm):
    """Generations still running (held here: their consumers stopped reading) are listed with their age and
    tokens so far, a session's and a stateless one, each to its owner and both to an admin; with no turn
    finished yet, TTFT and turn-time percentiles are numbers (the turns in flight, their age so far)."""
    llm = tiny_llm("llama", speculative=None)
    state = DashboardState(llm, health=dict, refresh_s=0)
    alice, bob = identity_of("alice"), identity_of("bob")
    session = llm.sessions.create(list(range(1, 11)), owner=alice)
    long = SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)
    streams = [llm.sessions.generate(session, long, owner=alice),
               llm.start(list(range(20, 32)), long, GenerationStream(llm.engine.cancel), caller=bob)]
    for stream in streams:
        next(iter(stream))
        stream.request.paused.set()
    state.reading()
    time.sleep(HISTORY_STEP_S)
    reading = state.reading()
    own = reading.view(alice, sees_all=False)["requests"]
    assert [(r["session"], r["prompt"]) for r in own] == [(session, 10)]
    assert own[0]["generated"] >= 1 and own[0]["age_s"] > HISTORY_STEP_S and own[0]["max_tokens"] == 900
    assert [(r["session"], r["prompt"]) for r in reading.view(bob, sees_all=False)["requests"]] == [(None, 12)]
    assert {r["state"] for r in reading.view(None, sees_all=True)["requests"]} <= {"running", "paused"}
    assert len(reading.view(None, sees_all=True)["requests"]) == 2
    latest = reading.overview["history"][-1]
    assert all(latest[key] is not None for key in ("ttft_p50", "ttft_p95", "turn_p50", "turn_p95"))
    assert latest["turn_p50"] >= HISTORY_STEP_S and latest["ttft_p95"] < latest["turn_p50"]
    for stream in streams:
        stream.cancel()


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
ROW_HISTORY = "document.querySelector(\"#sessions tr[data-id='{id}'] td.history\")?.textContent === '{history:,}'"


def watched_session(client: Client, sentence: str) -> tuple[Session, int]:
    """A new session with some history (the sentence four times, 24 tokens generated), and its length."""
    session = client.create_session()
    session.append_text(sentence * 4)
    "".join(session.generate_text(max_tokens=24))
    return session, session.info().history_tokens


def test_the_page_shows_a_new_session_and_the_pool_moving(tiny_server, page, tmp_path):
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(f"{tiny_server.http_url}/dashboard")
    page.wait_for_selector("#health.ok", timeout=10_000)
    page.wait_for_function(f"Number.isInteger({POOL_USED})", timeout=10_000)  # the first point of the pool chart
    used_before = page.evaluate(POOL_USED)
    with Client(tiny_server.grpc_address, tokenizer="server") as client:
        session, history = watched_session(client, "The dashboard watches this session. ")
        row = f"#sessions tr[data-id='{session.id}']"
        page.wait_for_selector(row, timeout=10_000)
        page.wait_for_function(ROW_HISTORY.format(id=session.id, history=history), timeout=10_000)
        # the session's pages show on the pool chart
        page.wait_for_function(f"{POOL_USED} > {used_before}", timeout=10_000)
        page.locator(row).click()
        page.wait_for_selector("#chart-turns rect", state="attached", timeout=10_000)  # the drill-down plots its turn
        assert page.text_content("#detail-id") == session.id
        shot = tmp_path / "dashboard.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 10_000
        session.close()
    assert errors == []


@contextlib.contextmanager
def generations_running(server) -> Iterator[None]:
    """Long generations (900 tokens on the tiny model, a few seconds each) back to back on a thread, each
    on a new session, until the block ends: something is always in flight. Re-raises the thread's error."""
    done, errors = threading.Event(), []

    def work() -> None:
        try:
            with Client(server.grpc_address, tokenizer="server") as client:
                while not done.is_set():
                    session = client.create_session()
                    session.append_text("Still running. ")
                    for _ in session.generate(max_tokens=900, ignore_eos=True):
                        pass
                    session.close()
        except Exception as error:  # noqa: BLE001 - handed to the test
            errors.append(error)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=60)
    assert errors == []


IN_FLIGHT_ROW = ("[...document.querySelectorAll('#requests tbody tr')].some((tr) => tr.querySelector('td.session').textContent"
                 ".length === 10 && /^[1-9][0-9,]* \\/ 900$/.test(tr.querySelector('td.generated').textContent)"
                 " && /[0-9] (ms|s)$/.test(tr.querySelector('td.age_s').textContent))")
LATENCY_CARDS = ("[...document.querySelectorAll('.card')].filter((c) => /^(TTFT|turn) p50/.test(c.querySelector('.label')"
                 ".textContent)).map((c) => c.querySelector('.value').textContent)")
# the pool chart's top is 1.1 x the most pages used or cached on it, far below the pool's 16k pages
POOL_SCALED = ("(() => { const h = view.state.history, top = Number(document.querySelector('#chart-pool').dataset.top);"
               " const most = Math.max(...h.flatMap((p) => [p.used, p.cached]));"
               " return h.length > 1 && most > 0 && Math.abs(top - 1.1 * most) < 1e-6 && top < view.state.pool.pages / 10; })()")
# no horizontal overflow: the page is the window's width, each table its box's
FITS = ("document.documentElement.scrollWidth <= window.innerWidth && ['sessions', 'requests'].every((id) =>"
        " document.getElementById(id).scrollWidth <= document.getElementById(id).parentElement.clientWidth)")
WIDEST_ROW = ("{id: 'Xk3_9aQwErTyUiOpAsDfGh', owner: 'c481fd9f', state: 'evicted to snapshot', history: 1048576,"
              " resident_tokens: 1048576, resident_bytes: 1023.9 * 2 ** 30, host_bytes: 0, disk_bytes: 0,"
              " tier_bytes: 1023.9 * 2 ** 30, policy: 'sink_window', reused: 1048576, prefilled: 1048576, last_turn_s: 119.9,"
              " idle_s: 7199, ttl_s: 30 * 86400, last_saved_at: Date.now() / 1000 - 7000, snapshot_bytes: 1023.9 * 2 ** 30,"
              " save_failures: 1000}")


def test_the_page_shows_what_is_running_now(tiny_server, page, tmp_path):
    """With a generation running: the in-flight table lists it (its session, age, tokens so far), the TTFT and
    turn-time percentiles are numbers, the pool chart is scaled to the pages in use, and at 1280 px neither
    table overflows, even with the widest value of every sessions column."""
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(f"{tiny_server.http_url}/dashboard")
    page.wait_for_selector("#health.ok", timeout=10_000)
    with generations_running(tiny_server):
        page.wait_for_function(IN_FLIGHT_ROW, timeout=20_000)
        page.wait_for_function(f"{LATENCY_CARDS}.every((v) => /^[0-9.]+ m?s \\/ [0-9.]+ m?s$/.test(v))", timeout=20_000)
        page.wait_for_function(POOL_SCALED, timeout=20_000)
        assert page.evaluate(FITS)
        page.screenshot(path=str(tmp_path / "running.png"), full_page=True)
    page.evaluate(f"clearTimeout(timer); renderTable([{WIDEST_ROW}])")  # polling stopped: the row stays
    assert page.evaluate(FITS)
    assert errors == []


@pytest.fixture(scope="module")
def firefox_session() -> BidiSession:
    executable = firefox_executable()
    if executable is None:
        pytest.skip("no firefox: `apt-get install firefox-esr` (make test installs it when run as root)")
    with firefox(executable, free_port()) as session:
        yield session


def test_the_page_works_in_firefox(tiny_server, firefox_session, tmp_path):
    """The same page in stock Firefox: it loads without script errors, a session made over gRPC shows as a
    row with its history length, the pool chart draws the session's pages, a screenshot is taken; a
    running generation is listed in flight, the pool chart scaled to use, and nothing overflows 1280 px."""
    tab = Tab(firefox_session, 1280, 800)
    tab.goto(f"{tiny_server.http_url}/dashboard")
    tab.wait_for("document.querySelector('#health.ok') !== null")
    tab.wait_for(f"Number.isInteger({POOL_USED})")
    used_before = tab.evaluate(POOL_USED)
    with Client(tiny_server.grpc_address, tokenizer="server") as client:
        session, history = watched_session(client, "Firefox watches this session. ")
        tab.wait_for(ROW_HISTORY.format(id=session.id, history=history))
        tab.wait_for(f"{POOL_USED} > {used_before}")
        assert tab.evaluate("document.querySelector('#chart-pool path[data-series=used]').getAttribute('d')").startswith("M")
        assert tab.evaluate("document.querySelector('#chart-evictions path[data-series=evicted_cached]') !== null")
        shot = tmp_path / "dashboard-firefox.png"
        tab.screenshot(shot)
        assert shot.stat().st_size > 10_000
        session.close()
    with generations_running(tiny_server):
        tab.wait_for(IN_FLIGHT_ROW, timeout_s=20)
        tab.wait_for(POOL_SCALED, timeout_s=20)
        assert tab.evaluate(FITS)
    assert tab.javascript_errors() == []


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
