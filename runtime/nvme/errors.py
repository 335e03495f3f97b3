"""User-facing errors of the NVMe tier (docs/conventions.md, "Two error channels").

I/O failures are `OSError`s (errno, message, path) with `offset` and `nbytes` attributes, raised by
both engines alike; configuration and swap-directory problems the user can fix are these
`PlannerError`s (a ValueError), whose one-line message names the value and what to do, so that
every `planner` command prints them as one line and exits 1.
"""

from planner.specs.errors import PlannerError


class NvmeError(PlannerError):
    """A swap path or engine setting the user must change."""


class NvmeConfigError(NvmeError):
    """A bad engine setting (block size, queue depth, threads, backend)."""


class SwapPathError(NvmeError):
    """The swap directory cannot be used: missing, not a directory, unwritable, or too small."""
