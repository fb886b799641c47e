"""`gemel check` against real things: its HTML report in a headless Chromium (as the dashboard
test drives it: Debian's chromium and chromium-driver through selenium), and `--url` against a
running `gemel serve`.

The page must render the heatmap and the table with the report's counts, filter on a click,
log no console errors and make no network request (the performance log lists every request
the page makes). The screenshot is saved in the test's temporary directory.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import httpx
import pytest

from conftest import free_port

from gemel.check.audit import Request, run
from gemel.check.html import heatmap, render_html
from gemel.cli import main

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
COLOURS = {"fail": "rgb(198, 40, 40)", "pass": "rgb(46, 125, 50)", "skip": "rgb(158, 158, 158)"}  # fail: high severity


def browser(tmp_path: Path):
    if not Path(CHROMIUM).exists() or not Path(CHROMEDRIVER).exists():
        pytest.skip("needs Debian's chromium and chromium-driver (scripts/install.sh installs them as root with apt)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (pip install -e '.[test]')")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
                f"--user-data-dir={tmp_path / 'chromium-profile'}", "--window-size=1400,1600"):  # fmt: skip
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    return webdriver.Chrome(service=Service(CHROMEDRIVER, log_output=str(tmp_path / "chromedriver.log")), options=opts)


INSECURE = """
server: {host: 0.0.0.0, verify_weights: "off", log_level: debug}
gateway: {insecure: true}
"""


def test_html_report_in_a_real_browser(tmp_path):
    cfg = tmp_path / "gemel.yaml"
    cfg.write_text(INSECURE)
    report = run(Request(config=str(cfg), k8s=str(ROOT / "deploy" / "k8s")))
    page = tmp_path / "report.html"
    page.write_text(render_html(report))
    expected = {(c["component"], c["severity"]): c for c in heatmap(report)}
    assert any(c["status"] == "fail" for c in expected.values()) and any(c["status"] == "pass" for c in expected.values())

    driver = browser(tmp_path)
    try:
        driver.get_log("performance")  # drop the browser's own start-up requests (its new-tab page)
        driver.get(page.as_uri())
        assert driver.title == "gemel check"
        state = driver.execute_script("return window.gemelCheck")
        assert state["ready"] and state["rows"] == len(report.findings) and state["cells"] == len(expected), state

        cells = driver.execute_script(
            "return Array.from(document.querySelectorAll('#heatmap td.cell')).map(c => ({component: c.dataset.component,"
            " severity: c.dataset.severity, status: c.dataset.status, failed: +c.dataset.failed, text: c.textContent,"
            " colour: getComputedStyle(c).backgroundColor, visible: c.getBoundingClientRect().width > 20}))"
        )
        for c in cells:
            want = expected[(c["component"], c["severity"])]
            assert (c["status"], c["failed"]) == (want["status"], want["failed"]), c
            assert c["visible"], c
            if want["status"] != "none":
                assert c["text"] == str(want["failed"])
            if c["status"] in ("pass", "skip") or (c["status"] == "fail" and c["severity"] == "high"):
                assert c["colour"] == COLOURS[c["status"]], c

        visible = "return Array.from(document.querySelectorAll('#rules tbody tr')).filter(r => r.offsetParent !== null)"
        assert len(driver.execute_script(visible)) == len(report.findings)

        # a click on the network/high cell filters the table to its rules and names them below the map
        cell = driver.find_element("css selector", '#heatmap td[data-component="network"][data-severity="high"]')
        cell.click()
        rows = driver.execute_script(visible + ".map(r => [r.dataset.rule, r.dataset.component, r.dataset.severity, r.dataset.status])")
        in_cell = [f for f in report.findings if f.rule.component == "network" and f.rule.severity == "high"]
        assert sorted(r[0] for r in rows) == sorted(f.rule.id for f in in_cell)
        assert {tuple(r[1:3]) for r in rows} == {("network", "high")}
        caption = driver.find_element("id", "heatmap-caption").text
        assert "NET001 fail" in caption and "network / high" in caption
        assert driver.find_element("id", "shown-count").text == f"{len(in_cell)} of {len(report.findings)} rules"

        # hovering another cell lists its rules
        from selenium.webdriver.common.action_chains import ActionChains

        ActionChains(driver).move_to_element(
            driver.find_element("css selector", '#heatmap td[data-component="engine"][data-severity="high"]')).perform()
        assert "ENG003 fail" in driver.find_element("id", "heatmap-caption").text

        # the status filter
        driver.find_element("id", "f-reset").click()
        driver.execute_script("const s = document.getElementById('f-status'); s.value = 'fail';"
                              " s.dispatchEvent(new Event('input'));")  # fmt: skip
        statuses = driver.execute_script(visible + ".map(r => r.dataset.status)")
        assert statuses == ["fail"] * sum(f.status == "fail" for f in report.findings)

        shot = tmp_path / "check-report.png"
        driver.save_screenshot(str(shot))
        assert shot.stat().st_size > 10_000
        print(f"report screenshot: {shot}")

        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors
        requests = [json.loads(e["message"])["message"] for e in driver.get_log("performance")]
        sent = [m["params"] for m in requests if m["method"] == "Network.requestWillBeSent"]
        assert not [p["request"]["url"] for p in sent if p["request"]["url"].split(":")[0] in ("http", "https", "ws", "wss")]
        own = [p["request"]["url"] for p in sent if p.get("documentURL") == page.as_uri()]
        assert own == [page.as_uri()], own  # the page itself, nothing it loads
    finally:
        driver.quit()


def test_url_against_a_running_server(server, capsys):
    """The shared test server: loopback, no tenants file, so anonymous requests are accepted."""
    code = main(["check", "--url", server.url, "--format", "json"])
    doc = json.loads(capsys.readouterr().out)
    findings = {f["rule"]: f for f in doc["findings"]}
    for rule in ("ENG006", "ENG007", "OBS008", "NET009", "GW015"):
        assert findings[rule]["status"] == "pass", findings[rule]
    assert "accepted" in findings["GW015"]["detail"] and "loopback" in findings["GW015"]["detail"]
    nosniff = httpx.get(f"{server.url}/v1/models", timeout=10).headers.get("x-content-type-options") == "nosniff"
    assert findings["NET010"]["status"] == ("pass" if nosniff else "fail")
    assert code == doc["exit_code"] == (0 if nosniff else 1)
    assert all(f["status"] == "skip" for f in doc["findings"] if f["rule"].startswith("DEP"))


def test_url_of_a_server_that_is_not_there(capsys):
    code = main(["check", "--url", f"http://127.0.0.1:{free_port()}", "--timeout", "2", "--format", "json"])
    findings = {f["rule"]: f for f in json.loads(capsys.readouterr().out)["findings"]}
    assert code == 2
    assert findings["ENG006"]["status"] == "fail" and "ConnectError" in findings["ENG006"]["detail"]
    assert findings["GW015"]["status"] == "skip"
