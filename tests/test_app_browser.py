"""A real browser drives the running dashboard: Debian's headless Chromium (packages `chromium` and
`chromium-driver`; nothing is downloaded) loads `planner dashboard`, changes the number of GPUs and
sees the answer change, and saves screenshots (`TIERWISE_DASHBOARD_SCREENSHOT=FILE` keeps the main
view; the pictures of every panel in docs/screenshots/ come from benchmarks/dashboard_screenshots.py)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
STARTUP_TIMEOUT_S = 90
ANSWER_TIMEOUT_S = 60

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)),
        reason="needs Debian's chromium and chromium-driver (apt-get install -y chromium chromium-driver)",
    ),
]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def dashboard_url(tmp_path):
    port = _free_port()
    env = {**os.environ, "TIERWISE_HISTORY": str(tmp_path / "no-history.sqlite")}
    log = open(tmp_path / "streamlit.log", "wb")  # noqa: SIM115 - closed below, after the server stops
    server = subprocess.Popen(
        [sys.executable, "-m", "tierwise", "dashboard", "--headless", "--port", str(port), "--address", "127.0.0.1"],
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as reply:
                    if reply.read() == b"ok":
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                log.flush()
                pytest.fail(f"planner dashboard did not start: {(tmp_path / 'streamlit.log').read_text()[-2000:]}")
            time.sleep(0.5)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


@pytest.fixture
def browser(monkeypatch):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    monkeypatch.setenv("SE_OFFLINE", "true")  # never let Selenium Manager fetch a browser or driver
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="tierwise-chromium-")
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1600,1150"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _verdict(driver, gpus: int) -> str:
    """Wait for the verdict for `gpus` GPUs and return the TFLOPS per GPU it shows."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(driver, ANSWER_TIMEOUT_S)
    wait.until(lambda d: f"fits on {gpus} GPU(s)" in d.find_element(By.TAG_NAME, "body").text)
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "[data-testid='stVegaLiteChart'] canvas, "
                                                              "[data-testid='stVegaLiteChart'] svg")) > 0)
    metrics = {
        m.find_element(By.CSS_SELECTOR, "[data-testid='stMetricLabel']").text:
        m.find_element(By.CSS_SELECTOR, "[data-testid='stMetricValue']").text
        for m in driver.find_elements(By.CSS_SELECTOR, "[data-testid='stMetric']")
    }
    return metrics["TFLOPS per GPU"]


def test_browser_loads_the_dashboard_changes_the_gpus_and_sees_a_new_answer(dashboard_url, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    browser.get(dashboard_url)
    tflops_16 = _verdict(browser, 16)
    time.sleep(2)  # let the charts finish drawing before the picture
    main_view = tmp_path / "dashboard-main.png"
    assert browser.save_screenshot(str(main_view))
    if os.environ.get("TIERWISE_DASHBOARD_SCREENSHOT"):
        shutil.copyfile(main_view, os.environ["TIERWISE_DASHBOARD_SCREENSHOT"])

    gpus = browser.find_element(By.CSS_SELECTOR, "input[aria-label='Number of GPUs']")
    gpus.send_keys(Keys.CONTROL, "a")
    gpus.send_keys("32", Keys.ENTER)
    tflops_32 = _verdict(browser, 32)
    assert tflops_32 != tflops_16  # 1T on dgx-h100: 32 GPUs give a different TFLOPS per GPU than 16
    assert browser.save_screenshot(str(tmp_path / "dashboard-32-gpus.png"))
    assert Path(main_view).stat().st_size > 10_000
