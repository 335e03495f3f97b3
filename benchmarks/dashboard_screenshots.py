"""Screenshots of every dashboard panel from a real headless browser, for docs/dashboard.md.

Starts `planner dashboard` headless on a free local port (with a run history holding one real run
of a tiny model, `planner run` for three steps, so *Predicted vs measured* has a point), drives Debian's Chromium through selenium
(`apt-get install -y chromium chromium-driver`; nothing is downloaded), opens each panel for 1T on
16 GPUs of a DGX H100, then the *does not fit* view (1T on 1 GPU) and a CPU-only machine, and saves
one PNG each, reduced to a palette so the set stays small.

    python benchmarks/dashboard_screenshots.py [--out docs/screenshots] [--width 1400] [--height 1500] [--history FILE]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
PANELS = {  # file name -> tab label (app/dashboard.py TABS)
    "memory": "Memory per tier",
    "strategies": "Strategies",
    "timeline": "Timeline",
    "bandwidth": "Bandwidth (eq. 6)",
    "largest-model": "Largest model",
    "predicted-vs-measured": "Predicted vs measured",
}
TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


TINY_FIT = ("--layers", "2", "--hidden", "128", "--heads", "4", "--seq", "128", "--vocab", "1024",
            "--hardware", "cpu-dev-2core", "--gpus", "1", "--precision", "fp32", "--batch-per-gpu", "2")
"""A model small enough to train a few steps on any CPU (about a minute with the process start)."""


def recorded_history(path: Path, work: Path) -> None:
    """A real run in `path`: the tiny plan fitted and trained three steps with `planner run`, so the
    *Predicted vs measured* panel draws a measured point (nothing is made up)."""
    planner = [sys.executable, "-m", "tierwise"]
    subprocess.run([*planner, "fit", *TINY_FIT, "--out", str(work / "tiny.json")], check=True, cwd=work,
                   stdout=subprocess.DEVNULL)
    subprocess.run([*planner, "run", str(work / "tiny.json"), "--steps", "3", "--store", str(path)], check=True,
                   cwd=work, stdout=subprocess.DEVNULL)


def start_dashboard(port: int, history: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "TIERWISE_HISTORY": str(history)}
    server = subprocess.Popen(
        [sys.executable, "-m", "tierwise", "dashboard", "--headless", "--port", str(port), "--address", "127.0.0.1"],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, cwd=REPO)
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2) as reply:
                if reply.read() == b"ok":
                    return server
        except OSError:
            time.sleep(0.5)
        if server.poll() is not None:
            break
    server.kill()
    raise SystemExit(f"planner dashboard did not start: {log.read_text()[-2000:]}")


def browser(width: int, height: int):  # noqa: ANN201
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ["SE_OFFLINE"] = "true"  # never let Selenium Manager fetch a browser or driver
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="tierwise-chromium-")
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage", "--hide-scrollbars",
                 f"--user-data-dir={profile}", f"--window-size={width},{height}"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)


def settle(driver) -> None:  # noqa: ANN001
    """Wait until the script has finished running (no status widget, no spinner) and charts are drawn."""
    from selenium.webdriver.common.by import By

    deadline, quiet = time.monotonic() + TIMEOUT_S, 0
    while time.monotonic() < deadline and quiet < 3:
        busy = driver.find_elements(By.CSS_SELECTOR, "[data-testid='stStatusWidget'], [data-testid='stSpinner']")
        quiet = 0 if busy else quiet + 1
        time.sleep(1.0)
    time.sleep(2.0)  # Vega draws after the data arrives


def open_tab(driver, label: str) -> None:  # noqa: ANN001
    from selenium.webdriver.common.by import By

    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        for tab in driver.find_elements(By.CSS_SELECTOR, "[role='tab']"):
            if tab.text.strip() == label:
                driver.execute_script("arguments[0].click()", tab)  # the page header may lie over it
                settle(driver)
                return
        time.sleep(1.0)
    raise SystemExit(f"no tab {label!r} on the page")


def set_field(driver, aria_label: str, value: str) -> None:  # noqa: ANN001
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    field = driver.find_element(By.CSS_SELECTOR, f"input[aria-label='{aria_label}']")
    field.send_keys(Keys.CONTROL, "a")
    field.send_keys(value, Keys.ENTER)
    settle(driver)


def choose(driver, aria_label: str, option: str) -> None:  # noqa: ANN001
    """Pick `option` in the selectbox labelled `aria_label` (Streamlit's combobox)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    widget = next(w for w in driver.find_elements(By.CSS_SELECTOR, "[data-testid='stSelectbox']")
                  if w.text.splitlines()[0].strip() == aria_label)
    box = widget.find_element(By.CSS_SELECTOR, "input")
    box.click()
    box.send_keys(option, Keys.ENTER)
    settle(driver)


def save(driver, path: Path, *, panel: bool = False) -> None:  # noqa: ANN001
    """The window as it is; with `panel`, scrolled so the tabs are at the top (the panel, not the verdict)."""
    from PIL import Image
    from selenium.webdriver.common.by import By

    tabs = driver.find_elements(By.CSS_SELECTOR, "[role='tablist']")
    if panel and tabs:  # the tabs just below the page header
        driver.execute_script("arguments[0].scrollIntoView(true);"
                              "for (const el of [window, document.querySelector('[data-testid=\"stMain\"]')]) "
                              "{ if (el) el.scrollBy(0, -70); }", tabs[0])
    else:
        driver.execute_script("for (const el of [window, document.querySelector('[data-testid=\"stMain\"]')]) "
                              "{ if (el) el.scrollTo(0, 0); }")
    time.sleep(1.0)
    driver.save_screenshot(str(path))
    with Image.open(path) as image:  # a palette of 256 colours: a third of the bytes, the same text
        image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)
    print(f"{path} ({path.stat().st_size / 1024:,.0f} KiB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "screenshots")
    parser.add_argument("--width", type=int, default=1400)
    parser.add_argument("--height", type=int, default=1500)
    parser.add_argument("--history", type=Path, help="a run history to show (default: record one tiny run)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tierwise-screens-"))
    history = args.history or work / "history.sqlite"
    if args.history is None:
        recorded_history(history, work)
    port = free_port()
    server = start_dashboard(port, history, work / "streamlit.log")
    driver = browser(args.width, args.height)
    try:
        driver.get(f"http://127.0.0.1:{port}")
        settle(driver)
        for name, label in PANELS.items():
            open_tab(driver, label)
            save(driver, args.out / f"{name}.png", panel=name != "memory")
        set_field(driver, "Number of GPUs", "1")
        save(driver, args.out / "does-not-fit.png")
        choose(driver, "Node preset", "cpu-dev-2core")
        set_field(driver, "Size, preset or JSON file", "gpt3-125m")
        set_field(driver, "Sequence length", "256")
        open_tab(driver, "Memory per tier")
        save(driver, args.out / "cpu-only.png")
    finally:
        driver.quit()
        server.terminate()
        server.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
