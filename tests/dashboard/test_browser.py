"""The real app in real headless Chromium (Debian's package, driven by Playwright): a compare link, end to end.

Skips where /usr/bin/chromium is missing (CI: `apt-get install -y chromium chromium-driver`); never downloads
a browser. Leaves a screenshot in the test's tmp dir and at /tmp/dashboard-compare.png, to be looked at.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import REDIS_URL, REPO
from tests.dashboard.conftest import APP

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
SCREENSHOT_COPY = Path("/tmp/dashboard-compare.png")

pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium "
                                "(apt-get install -y chromium chromium-driver)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def dashboard_url(seeded, tmp_path):
    port = free_port()
    env = {**os.environ, "SERVELAB_DATABASE_URL": seeded.database_url, "SERVELAB_REDIS_URL": REDIS_URL,
           "SERVELAB_KEY_PREFIX": seeded.key_prefix}
    log = (tmp_path / "streamlit.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "streamlit", "run", str(APP), "--server.headless", "true",
                             "--server.port", str(port), "--server.address", "127.0.0.1",
                             "--browser.gatherUsageStats", "false"], cwd=REPO, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if urllib.request.urlopen(f"{base}/_stcore/health", timeout=2).read() == b"ok":
                    break
            except OSError:
                pass
            assert proc.poll() is None, (tmp_path / "streamlit.log").read_text()
            assert time.monotonic() < deadline, "streamlit did not answer within 60 s"
            time.sleep(0.3)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.close()


def test_a_compare_link_shows_the_verdict_and_charts_in_chromium(dashboard_url, seeded, tmp_path) -> None:
    from playwright.sync_api import sync_playwright

    link = f"{dashboard_url}/?baseline={','.join(seeded.baseline_ids)}&candidates={','.join(seeded.candidate_ids)}"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            # NOTE: a tall viewport: Streamlit scrolls inside its own container, so a full-page shot would crop.
            page = browser.new_page(viewport={"width": 1500, "height": 4200})
            page.goto(link, timeout=60_000)
            page.get_by_text(f"against {seeded.baseline_name}").first.wait_for(timeout=90_000)
            page.locator(".vega-embed canvas, .vega-embed svg").nth(6).wait_for(timeout=60_000)
            page.wait_for_timeout(1500)  # let the last charts finish drawing
            body = page.inner_text("body")
            # NOTE: the seeded plan makes accept certain: bf16 weights are exactly x0.5 of fp32's in every run (an
            # interval of width 0 under the x0.75 goal), and its quality and TPOT limits (a drop of 1.0, x1e300)
            # cannot fail or be unsure on any measurement
            assert f"ACCEPT: {seeded.candidate_name} against {seeded.baseline_name}" in body, \
                body[body.find("Verdict"):][:1500]
            assert "REJECT" not in body and "INCONCLUSIVE" not in body
            assert "Verdict" in body and "Side by side" in body and "Traceback" not in body
            assert page.locator(".vega-embed").count() >= 7  # no cost chart: the runs had no price, and it says so
            assert "no price set" in body
            # the plan's limits, in the sidebar, as a table a reader can scan (never a JSON dump)
            sidebar = page.locator('[data-testid="stSidebar"]')
            limits = sidebar.locator("table")
            assert limits.count() == 1, sidebar.inner_text()
            table = limits.inner_text()
            assert all(word in table for word in ("criterion", "limit", "direction", "LAMBADA accuracy drop",
                                                  "at most", "gain: weight_bytes")), table
            assert "{" not in sidebar.inner_text()
            shot = tmp_path / "dashboard-compare.png"
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    assert shot.stat().st_size > 50_000
    shutil.copy(shot, SCREENSHOT_COPY)
