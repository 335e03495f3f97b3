"""The phase vocabulary: what one training iteration is doing at a given moment.

`PHASES` are the three timed phases (`phase_time_s` keys in every plan and profile: a contract,
docs/plan-format.md); within the backward phase a recomputed block's forward runs again first
(`RECOMPUTE`). Trace steps, busy intervals (the Gantt chart's colours) and calibration's rows all
use these members, each of which *is* its value (`str`).
"""

from __future__ import annotations

from enum import Enum


class Phase(str, Enum):
    FORWARD = "forward"
    RECOMPUTE = "recompute"
    """The forward of a recompute segment again, just before its backward (eq. 7's extra 2)."""
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"

    # Print as the value, as `str` does (Python 3.11 prints `Phase.FORWARD` for a mixed-in enum).
    __str__ = str.__str__
    __format__ = str.__format__

    @property
    def timed(self) -> Phase:
        """The timed phase this work is part of: a recompute belongs to the backward."""
        return Phase.BACKWARD if self is Phase.RECOMPUTE else self


PHASES: tuple[Phase, ...] = (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER)
"""The timed phases, in order."""
