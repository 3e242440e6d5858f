"""A small WebDriver BiDi client: drives Debian's stock Firefox headless for the dashboard test.

Playwright's own Firefox build cannot be downloaded offline, stock Firefox lacks Playwright's Juggler
protocol, and Playwright's BiDi path (channel "moz-firefox") sends commands Firefox ESR does not know
yet (emulation.setMediaFeaturesOverride), so the test speaks the W3C protocol itself: one websocket to
ws://127.0.0.1:PORT/session, commands as {id, method, params} answered by {id, type: success|error},
events as {type: event, method, params}. Only what the test needs: a tab of a given size, navigation,
script evaluation, screenshots, and the page's JavaScript errors (log.entryAdded).
"""

from __future__ import annotations

import base64
import itertools
import json
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from websockets.sync.client import ClientConnection, connect

from tests.server.conftest import watch_log

LISTENING = "WebDriver BiDi listening on"
START_TIMEOUT_S = 60.0
# A fresh profile that neither phones home nor shows first-run pages.
PREFS = """
user_pref("browser.shell.checkDefaultBrowser", false);
user_pref("browser.startup.homepage_override.mstone", "ignore");
user_pref("datareporting.policy.dataSubmissionEnabled", false);
user_pref("toolkit.telemetry.reportingpolicy.firstRun", false);
user_pref("app.update.disabledForTesting", true);
user_pref("browser.aboutwelcome.enabled", false);
"""


class BidiError(RuntimeError):
    """A command the browser answered with an error, or a script that threw."""


def firefox_executable() -> str | None:
    """Debian's Firefox binary (the /usr/bin wrapper only execs it)."""
    for candidate in ("/usr/lib/firefox-esr/firefox-esr", shutil.which("firefox-esr"), shutil.which("firefox")):
        if candidate and Path(candidate).exists():
            return candidate
    return None


class BidiSession:
    """One WebDriver BiDi session over a websocket: `command` sends and waits for its answer; events
    arriving meanwhile are kept in `events` (oldest first)."""

    def __init__(self, socket: ClientConnection, timeout_s: float = 30.0) -> None:
        self.socket = socket
        self.timeout_s = timeout_s
        self.events: list[dict] = []
        self._ids = itertools.count(1)

    def command(self, method: str, **params: object) -> dict:
        command_id = next(self._ids)
        self.socket.send(json.dumps({"id": command_id, "method": method, "params": params}))
        deadline = time.monotonic() + self.timeout_s
        while True:
            message = json.loads(self.socket.recv(timeout=max(0.0, deadline - time.monotonic())))
            if message.get("type") == "event":
                self.events.append(message)
            elif message.get("id") == command_id:
                if message.get("type") == "error":
                    raise BidiError(f"{method}: {message.get('error')}: {message.get('message')}")
                return message["result"]


class Tab:
    """A browsing context (tab) of a BiDi session."""

    def __init__(self, session: BidiSession, width: int, height: int) -> None:
        self.session = session
        self.context = session.command("browsingContext.create", type="tab")["context"]
        session.command("browsingContext.setViewport", context=self.context, viewport={"width": width, "height": height})

    def goto(self, url: str) -> None:
        self.session.command("browsingContext.navigate", context=self.context, url=url, wait="complete")

    def evaluate(self, expression: str) -> object:
        """The value of a JavaScript expression (a promise is awaited): JSON-serialisable results only,
        so pages answer through JSON.stringify where a value is not a primitive."""
        answer = self.session.command("script.evaluate", expression=f"JSON.stringify(({expression}))",
                                      target={"context": self.context}, awaitPromise=True, resultOwnership="none")
        if answer["type"] == "exception":
            raise BidiError(f"{expression[:80]!r} threw: {answer['exceptionDetails'].get('text')}")
        value = answer["result"].get("value")
        return None if value is None else json.loads(value)

    def wait_for(self, expression: str, timeout_s: float = 10.0) -> object:
        """Poll a JavaScript expression until it is truthy; returns its value. TimeoutError otherwise."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"{expression[:120]!r} stayed falsy for {timeout_s} s")
            time.sleep(0.1)

    def screenshot(self, path: Path) -> None:
        """The whole document as PNG."""
        answer = self.session.command("browsingContext.captureScreenshot", context=self.context, origin="document")
        path.write_bytes(base64.b64decode(answer["data"]))

    def javascript_errors(self) -> list[str]:
        """Errors the page's scripts raised or logged so far (log.entryAdded)."""
        return [event["params"].get("text", "") for event in self.session.events
                if event.get("method") == "log.entryAdded" and event["params"].get("level") == "error"]


@contextmanager
def firefox(executable: str, port: int) -> Iterator[BidiSession]:
    """Stock Firefox, headless with a fresh profile, its BiDi session subscribed to log entries; the
    browser is stopped (by its process) and the profile removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="kiln-firefox-") as profile:
        Path(profile, "user.js").write_text(PREFS)
        process = subprocess.Popen(
            [executable, "--headless", "--no-remote", "--profile", profile, f"--remote-debugging-port={port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        try:
            _wait_listening(process)
            with connect(f"ws://127.0.0.1:{port}/session", max_size=None, open_timeout=START_TIMEOUT_S) as socket:
                session = BidiSession(socket)
                session.command("session.new", capabilities={})
                session.command("session.subscribe", events=["log.entryAdded"])
                yield session
                session.command("session.end")
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_listening(process: subprocess.Popen) -> None:
    """Until Firefox prints that its BiDi server is up (its stderr is read on a thread from then on)."""
    log: list[str] = []
    ready = watch_log(process, log, LISTENING)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready.wait(0.2):
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("firefox's BiDi server did not start: " + "".join(log[-20:]))
