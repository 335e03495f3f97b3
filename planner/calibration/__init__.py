"""Predictions against our own measured runs: calibrate a hardware spec, compare, probe's reference runs."""

REFERENCE_REPEATS = 3
"""Each reference run of `planner probe --calibrate` is trained this many times, round-robin, and
the fit takes the run of median step time. A whole run can land in a slow minute, and a probe that
took one such run would move its predictions of other plans with it; the median of three narrows
that spread by about half, for about a minute more probing
(docs/notes/2026-11-23-calibration-machine-spread.md); `--no-calibrate` skips the reference runs
altogether. Here, not in probe_reference.py, so that the command line's default imports no
calibration code."""
