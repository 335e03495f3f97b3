"""The analytic cost models: what a plan costs in memory, bytes moved and seconds (paper §4)."""
