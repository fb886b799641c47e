"""/dashboard in a real headless browser: Debian's chromium driven by selenium.

``scripts/install.sh`` installs ``chromium`` and ``chromium-driver`` (apt) when they are
missing; without them this test skips and says why. The screenshot is saved under the
test's temporary directory (its path is printed, and kept with ``--basetemp``).
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


def browser(tmp_path: Path):
    if not Path(CHROMIUM).exists() or not Path(CHROMEDRIVER).exists():
        pytest.skip("needs Debian's chromium and chromium-driver (scripts/install.sh installs them as root with apt)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (pip install -e '.[test]')")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'chromium-profile'}",
                "--window-size=1400,1300"):  # fmt: skip
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(CHROMEDRIVER, log_output=str(tmp_path / "chromedriver.log")), options=opts)


def load(url: str, stop: threading.Event, count: list[int]) -> None:
    """Streaming requests, one at a time per thread, until told to stop (bounded)."""
    for i in range(60):
        if stop.is_set():
            return
        body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": f"Tell me fact number {i} about owls."}],
                "max_tokens": 16, "stream": True}  # fmt: skip
        try:
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
                for _ in r.iter_lines():
                    pass
            count[0] += 1
        except httpx.HTTPError:
            pass


def test_dashboard_draws_live_heatmap_without_console_errors(obs_server, tmp_path):
    driver = browser(tmp_path)
    stop, count = threading.Event(), [0]
    threads = [threading.Thread(target=load, args=(obs_server.url, stop, count), daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        driver.get(f"{obs_server.url}/dashboard")
        assert driver.title == "gemel dashboard"
        deadline = time.monotonic() + 90
        state = {}
        while time.monotonic() < deadline:
            state = driver.execute_script(
                "const d = window.gemelDashboard || {};"
                "const c = window.echarts && echarts.getInstanceByDom(document.getElementById('chart-heatmap'));"
                "return {polls: d.polls, cells: d.heatmapCells, points: (d.points || []).length, error: d.lastError,"
                " drawn: c ? c.getOption().series[0].data.length : -1,"
                " gen: document.getElementById('c-gen').textContent,"
                " ttft: document.getElementById('c-ttft').textContent};"
            )
            if state.get("drawn", 0) >= 5 and state.get("polls", 0) >= 3 and count[0] >= 2:
                break
            time.sleep(0.5)
        assert state.get("drawn", 0) > 0 and state["cells"] > 0 and state["points"] > 0, state
        assert state["error"] is None, state
        assert state["ttft"] != "– / – / –", state  # TTFT percentiles filled in
        canvases = driver.execute_script("return document.querySelectorAll('#chart-heatmap canvas').length")
        assert canvases >= 1  # ECharts drew on a canvas
        time.sleep(1.5)  # one more refresh, so the screenshot shows the latest state
        shot = tmp_path / "dashboard.png"
        driver.save_screenshot(str(shot))
        assert shot.stat().st_size > 10_000
        print(f"dashboard screenshot: {shot}")
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors
    finally:
        stop.set()
        driver.quit()
        for t in threads:
            t.join(timeout=90)
