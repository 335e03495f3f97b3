"""`planner dashboard`: the streamlit command it runs, and its one-line errors."""

from __future__ import annotations

import sys
from pathlib import Path

from typer.testing import CliRunner

from tierwise.cli import app
from tierwise.cli.dashboard import dashboard_script, streamlit_command

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
    monkeypatch.setattr("tierwise.cli.dashboard.os.execv", lambda path, argv: calls.append((path, argv)))
    monkeypatch.setattr("tierwise.cli.dashboard.subprocess.call", lambda argv: 0)
    result = CliRunner().invoke(app, ["dashboard", "--headless", "--port", "8601", "--", "--server.runOnSave", "true"])
    assert result.exit_code == 0
    path, argv = calls[0]
    assert path == sys.executable and argv[0] == sys.executable
    assert argv[-8:] == ["--client.toolbarMode", "viewer", "--server.port", "8601", "--server.address", "127.0.0.1",
                         "--server.runOnSave", "true"]  # this machine only, unless --address says otherwise


def test_bad_port_is_a_user_error():
    result = CliRunner().invoke(app, ["dashboard", "--port", "70000"])
    assert result.exit_code != 0
    assert "--port must be between 1 and 65535, got 70000" in str(result.exception)
