"""User-facing checkpoint errors: one line naming the file or value and what to do."""

from planner.specs.errors import PlannerError


class CheckpointError(PlannerError):
    """A checkpoint cannot be written, read or used (full disk, corrupt file, another plan's checkpoint)."""


class CheckpointMismatch(CheckpointError):
    """A complete checkpoint of another run (plan, ranks or seed) where this run keeps its own."""
