"""Predictions against our own measured runs: calibrate a hardware spec, compare, probe's reference runs."""
