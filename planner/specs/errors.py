"""The planner's user-facing error channel (docs/conventions.md, "Two error channels").

`PlannerError` carries a one-line message that names the offending value and what to do. The CLI
turns it into that line and exit code 1; `assert` stays reserved for invariants of our own code.
"""


class PlannerError(ValueError):
    """Bad user input: an unknown model size, a malformed spec file, an impossible pin."""

