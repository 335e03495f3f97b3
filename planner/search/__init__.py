"""The placement search: enumerate plans, keep what fits, rank them (analytic, then simulated)."""
