"""`planner dashboard`: start the Streamlit what-if dashboard (app/dashboard.py).

Streamlit is the `dashboard` extra, imported only by the child process, so `planner` keeps starting
fast without it. Options after the known ones are passed to `streamlit run` unchanged
(e.g. `planner dashboard -- --theme.base dark`).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import typer

from planner.specs.errors import PlannerError


def dashboard_script() -> Path:
    """app/dashboard.py of this installation: the `app` package sits beside `tierwise` both in a
    checkout and in site-packages (setup.py ships both), so look there rather than import `app`,
    a name another distribution could also own."""
    script = Path(__file__).resolve().parents[2] / "app" / "dashboard.py"
    if not script.is_file():
        raise PlannerError(f"the dashboard script {script} is missing; reinstall tierwise with its `app` package")
    return script


LOCALHOST = "127.0.0.1"
"""The default bind address: the page is a what-if tool for the person at this machine. Served
beyond it (`--address 0.0.0.0`), it reads model and hardware files by upload only (app/sidebar.py)."""


def streamlit_command(*, port: int | None, address: str | None, headless: bool, extra: list[str]) -> list[str]:
    command = [sys.executable, "-m", "streamlit", "run", str(dashboard_script()),
               "--server.headless", "true" if headless else "false", "--browser.gatherUsageStats", "false",
               "--client.toolbarMode", "viewer"]
    if port is not None:
        command += ["--server.port", str(port)]
    command += ["--server.address", address or LOCALHOST]
    return command + list(extra)


def register(app: typer.Typer) -> None:
    @app.command("dashboard", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def dashboard(
        ctx: typer.Context,
        port: Annotated[int | None, typer.Option("--port", help="port to serve on (default: streamlit's 8501)")] = None,
        address: Annotated[str | None, typer.Option("--address", help="address to bind (default 127.0.0.1: this machine only; "
                                                                         "0.0.0.0 serves every interface)")] = None,
        headless: Annotated[bool, typer.Option("--headless/--open-browser", help="do not open a browser")] = False,
    ) -> None:
        """Start the what-if dashboard (Streamlit); extra options go to `streamlit run`."""
        if importlib.util.find_spec("streamlit") is None:
            raise PlannerError("the dashboard needs streamlit: pip install 'tierwise[dashboard]'")
        if port is not None and not 1 <= port <= 65535:
            raise PlannerError(f"--port must be between 1 and 65535, got {port}")
        command = streamlit_command(port=port, address=address, headless=headless, extra=list(ctx.args))
        if os.name == "posix":
            # Become the server, so signals (Ctrl-C, a supervisor's SIGTERM) reach streamlit itself
            # and no orphaned server outlives a stopped `planner dashboard`.
            sys.stdout.flush()
            os.execv(command[0], command)
        try:
            code = subprocess.call(command)
        except KeyboardInterrupt:
            code = 130
        raise typer.Exit(code)

