"""`planner dashboard`: the streamlit command it runs, and its one-line errors."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tierwise.cli import app
from tierwise.cli.dashboard import (
    QUIET_ENVIRONMENT,
    dashboard_script,
    dashboard_url,
    free_port,
    streamlit_command,
)

REPO = Path(__file__).resolve().parent.parent


def test_the_script_is_the_checkouts_dashboard():
    assert dashboard_script() == REPO / "app" / "dashboard.py"


def test_streamlit_command_passes_flags_through():
    command = streamlit_command(port=8600, address="127.0.0.1", headless=True, extra=["--theme.base", "dark"])
    assert command == [
        sys.executable, "-m", "streamlit", "run", str(REPO / "app" / "dashboard.py"),
        "--server.headless", "true", "--browser.gatherUsageStats", "false", "--client.toolbarMode", "viewer",
        "--server.port", "8600", "--server.address", "127.0.0.1", "--theme.base", "dark",
    ]


def test_dashboard_becomes_the_streamlit_server(monkeypatch):
    calls = []
    monkeypatch.setattr("tierwise.cli.dashboard.os.execve", lambda path, argv, env: calls.append((path, argv, env)))
    monkeypatch.setattr("tierwise.cli.dashboard.subprocess.call", lambda argv, env: 0)
    result = CliRunner().invoke(app, ["dashboard", "--headless", "--port", "8601", "--", "--server.runOnSave", "true"])
    assert result.exit_code == 0
    path, argv, env = calls[0]
    assert path == sys.executable and argv[0] == sys.executable
    assert env["STREAMLIT_SERVER_SHOW_EMAIL_PROMPT"] == "false" and env["STREAMLIT_BROWSER_GATHER_USAGE_STATS"] == "false"
    assert "Tierwise dashboard: http://127.0.0.1:8601" in result.output
    assert argv[-8:] == ["--client.toolbarMode", "viewer", "--server.port", "8601", "--server.address", "127.0.0.1",
                         "--server.runOnSave", "true"]  # this machine only, unless --address says otherwise


def test_bad_port_is_a_user_error():
    result = CliRunner().invoke(app, ["dashboard", "--port", "70000"])
    assert result.exit_code != 0
    assert "--port must be between 1 and 65535, got 70000" in str(result.exception)


def test_headless_unless_open_and_a_free_port_when_none_is_named(monkeypatch):
    calls = []
    monkeypatch.setattr("tierwise.cli.dashboard.os.execve", lambda path, argv, env: calls.append(argv))
    monkeypatch.setattr("tierwise.cli.dashboard.subprocess.call", lambda argv, env: 0)
    with socket.socket() as busy:  # a port in use is skipped, so the printed address is the one served
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        assert free_port("127.0.0.1", taken) != taken
    result = CliRunner().invoke(app, ["dashboard"])
    argv = calls[0]
    assert argv[argv.index("--server.headless") + 1] == "true"
    port = argv[argv.index("--server.port") + 1]
    assert f"Tierwise dashboard: http://127.0.0.1:{port}" in result.output
    CliRunner().invoke(app, ["dashboard", "--open"])
    assert calls[1][calls[1].index("--server.headless") + 1] == "false"
    assert dashboard_url("0.0.0.0", 8502) == "http://127.0.0.1:8502"


STARTUP_DEADLINE_S = 30.0
"""How long a newcomer waits for the page before calling it a hang (a deadline, not a timing assert)."""


@pytest.mark.parametrize("flags", [[], ["--open"]], ids=["headless", "open"])
def test_dashboard_serves_without_a_terminal_or_a_streamlit_config(tmp_path, flags):
    """stdin closed, no controlling terminal, a HOME without ~/.streamlit: streamlit's first-run
    e-mail prompt would exit 255 here. With --open the browser is `true` (BROWSER), so no window."""
    port = free_port("127.0.0.1", 8700)
    env = {**os.environ, "HOME": str(tmp_path), "BROWSER": "true", "TIERWISE_HISTORY": str(tmp_path / "h.sqlite")}
    env.pop("STREAMLIT_SERVER_HEADLESS", None)
    log_path = tmp_path / "dashboard.log"
    with open(log_path, "wb") as log:
        server = subprocess.Popen([sys.executable, "-m", "tierwise", "dashboard", "--port", str(port), *flags],
                                  stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                  cwd=tmp_path, start_new_session=True)
        try:
            status = _wait_for_page(f"http://127.0.0.1:{port}/", server)
        finally:
            _stop(server)
    output = log_path.read_text()
    assert status == 200, output[-2000:]
    assert f"Tierwise dashboard: http://127.0.0.1:{port}" in output
    assert "Email" not in output and not (tmp_path / ".streamlit" / "credentials.toml").exists()
    assert set(QUIET_ENVIRONMENT) == {"STREAMLIT_SERVER_SHOW_EMAIL_PROMPT", "STREAMLIT_BROWSER_GATHER_USAGE_STATS"}


def _stop(server: subprocess.Popen) -> None:
    server.terminate()  # streamlit stops on SIGTERM; a server that does not is killed
    try:
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.kill()


def _wait_for_page(url: str, server: subprocess.Popen) -> int | None:
    deadline = time.monotonic() + STARTUP_DEADLINE_S
    while time.monotonic() < deadline and server.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                return reply.status
        except OSError:
            time.sleep(0.5)
    return None
