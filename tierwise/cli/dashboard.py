"""`planner dashboard`: start the Streamlit what-if dashboard (app/dashboard.py).

Streamlit is the `dashboard` extra, imported only by the child process, so `planner` keeps starting
fast without it. Options after the known ones are passed to `streamlit run` unchanged
(e.g. `planner dashboard -- --theme.base dark`).

It starts the same way everywhere: in a terminal, under nohup, as a service or with stdin closed.
Streamlit's first-run e-mail prompt (which reads stdin, and exits when there is none) and its usage
statistics are switched off through the child's environment (STREAMLIT_* variables, read like its
config files but written nowhere, so the user's ~/.streamlit is left alone); the server is headless
unless `--open` asks for a browser; it binds 127.0.0.1 unless `--address` says otherwise, on the
first free port from 8501 unless `--port` names one, and the address is printed before it starts.
"""

from __future__ import annotations

import importlib.util
import os
import socket
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


DEFAULT_PORT = 8501
"""Streamlit's own default; the first free port from here is served when `--port` is not given."""
PORTS_TRIED = 100

QUIET_ENVIRONMENT = {
    "STREAMLIT_SERVER_SHOW_EMAIL_PROMPT": "false",
    "STREAMLIT_BROWSER_GATHER_USAGE_STATS": "false",
}
"""Streamlit settings as environment variables (its documented third source after the flags and the
config files): no first-run e-mail prompt, no usage statistics. A variable an older Streamlit does
not know is ignored, where an unknown flag would stop it."""


def free_port(address: str, first: int = DEFAULT_PORT) -> int:
    """The first port from `first` that nothing listens on at `address` (so the printed URL is the
    one served: streamlit would otherwise move to another port by itself)."""
    for port in range(first, first + PORTS_TRIED):
        with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address, port))
            except OSError:
                continue
            return port
    raise PlannerError(f"no free port from {first} to {first + PORTS_TRIED - 1} on {address}; pass --port N")


def dashboard_url(address: str, port: int) -> str:
    host = "127.0.0.1" if address in ("0.0.0.0", "::") else address  # noqa: S104 - reached from here
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def streamlit_environment(base: dict[str, str] | None = None) -> dict[str, str]:
    """The child's environment: `base` (default: this process's) with QUIET_ENVIRONMENT."""
    return {**(os.environ if base is None else base), **QUIET_ENVIRONMENT}


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
        open_browser: Annotated[bool, typer.Option(
            "--open/--headless", help="open a browser on the page (default: headless, only serve it and print "
                                      "its address)")] = False,
    ) -> None:
        """Start the what-if dashboard (Streamlit); extra options go to `streamlit run`."""
        if importlib.util.find_spec("streamlit") is None:
            raise PlannerError("the dashboard needs streamlit: pip install 'tierwise[dashboard]'")
        if port is not None and not 1 <= port <= 65535:
            raise PlannerError(f"--port must be between 1 and 65535, got {port}")
        bind = address or LOCALHOST
        port = port if port is not None else free_port(bind)
        command = streamlit_command(port=port, address=bind, headless=not open_browser, extra=list(ctx.args))
        print(f"Tierwise dashboard: {dashboard_url(bind, port)} (starting streamlit; Ctrl-C stops it)", flush=True)
        environment = streamlit_environment()
        if os.name == "posix":
            # Become the server, so signals (Ctrl-C, a supervisor's SIGTERM) reach streamlit itself
            # and no orphaned server outlives a stopped `planner dashboard`.
            sys.stdout.flush()
            os.execve(command[0], command, environment)
        try:
            code = subprocess.call(command, env=environment)
        except KeyboardInterrupt:
            code = 130
        raise typer.Exit(code)

