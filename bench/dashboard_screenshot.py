"""The README's dashboard screenshot: agents.py's kiln-grpc workload (`--agents` agents, `--turns` turns,
persistence on) against a fresh `kiln serve` on the embedded model, while headless Chromium (Playwright,
as tests/server/test_dashboard.py drives it) shows /dashboard at 1280x800; once `--history-points`
seconds of charts are in and generations are in flight (the agents still run), the busiest session's
drill-down is opened and the page saved to docs/dashboard.png.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import threading
from pathlib import Path

import agents
import common
import servers

OUTPUT = common.BENCH_DIR.parent / "docs" / "dashboard.png"


def chromium() -> str:
    for candidate in ("/usr/lib/chromium/chromium", shutil.which("chromium")):
        if candidate and Path(candidate).exists():
            return candidate
    raise SystemExit("no chromium: apt-get install chromium (make chromium)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--first-tokens", type=int, default=400)
    parser.add_argument("--new-tokens", type=int, default=50)
    parser.add_argument("--gen-tokens", type=int, default=24)
    parser.add_argument("--history-points", type=int, default=40)
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    common.set_threads()
    loaded = common.load_reference()
    scripts = agents.agent_scripts(loaded, args.agents, args)
    with tempfile.TemporaryDirectory() as snapshots:
        server = servers.start(extra_args=["--max-num-seqs", "32", "--snapshot-dir", snapshots])
        try:
            work = threading.Thread(target=agents.kiln_agents, args=(server, scripts, args.gen_tokens), daemon=True)
            work.start()
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
                page = browser.new_page(viewport={"width": 1280, "height": 800})
                page.goto(server.http_url + "/dashboard")
                page.wait_for_function(f"document.querySelector('#chart-pool').dataset.last && "
                                       f"document.querySelectorAll('#sessions tbody tr').length >= {args.agents}",
                                       timeout=300_000)
                page.wait_for_timeout(args.history_points * 1000)
                page.wait_for_selector("#requests tbody tr", timeout=60_000)  # generations in flight now
                page.click("#sessions th[data-key='history']")  # longest history first
                page.click("#sessions th[data-key='history']")
                page.locator("#sessions tbody tr").first.click()
                page.wait_for_selector("#chart-turns rect", state="attached")
                page.wait_for_timeout(1500)
                page.screenshot(path=str(args.output), full_page=True)
                browser.close()
            work.join()
        finally:
            server.stop()
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
