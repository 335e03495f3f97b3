"""`planner` command line, the composition root: each verb a module of this package, a thin adapter
over the pure library (`planner`), the runtime (`runtime`, imported by the verbs that train) and the
dashboard (`app`, started as a Streamlit process). Shared option types are in `options`.

Exit codes: 0 success (an infeasible model is a successful answer), 1 user error with a one-line
message, 2 usage error (typer/click).
"""

from __future__ import annotations

import importlib
import sys

import typer

from planner.specs.errors import PlannerError
from tierwise.cli.options import one_line_error

VERBS = ("fit", "memory", "max_size", "models", "hardware", "history", "dashboard", "simulate", "probe", "run", "export",
         "compare", "calibrate", "validate")
"""The verb modules of this package, in the order `planner --help` lists them; each registers the
command named as it is, `_` written `-` (tests/test_planner_cli.py checks)."""

HELP = "Tierwise: plan, simulate and run heterogeneous-memory ZeRO-3 (ZeRO-Infinity) training."


def build_app(verbs: tuple[str, ...] = VERBS) -> typer.Typer:
    """The `planner` command with the commands of `verbs` (modules of this package) registered."""
    application = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, help=HELP)
    if len(verbs) == 1:  # one command still takes its name, as among all of them
        application.callback(help=HELP)(_group)
    for verb in verbs:
        importlib.import_module(f"tierwise.cli.{verb}").register(application)
    return application


def _group() -> None:
    pass


def verb_asked(args: list[str]) -> str | None:
    """The verb module of the command `args` names first, or None (help, an unknown command: every
    verb is registered to answer)."""
    if not args:
        return None
    verb = args[0].replace("-", "_")
    return verb if verb in VERBS and args[0] == verb.replace("_", "-") else None


def __getattr__(name: str) -> typer.Typer:
    """`app`: the `planner` command with every verb (built on first use: `main` registers only the
    verb it runs, whose module alone is imported)."""
    if name != "app":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    application = build_app()
    globals()["app"] = application
    return application


def main() -> None:
    verb = verb_asked(sys.argv[1:])
    try:
        (build_app((verb,)) if verb else build_app())()
    except PlannerError as exc:
        sys.stderr.write(one_line_error(exc))
        sys.exit(1)
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        sys.exit(130)
