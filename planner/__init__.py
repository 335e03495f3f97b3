"""Tierwise planner: capacity planning for heterogeneous-memory ZeRO-3 training (no torch here)."""

__version__ = "0.1.0"
