"""Shared fixtures. GPU tests are marked `gpu` and skipped when CUDA is absent (CI has none)."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest


# [Note: torch threads per test process]
# `-n auto` starts one test process per core, and torch's CPU kernels would start one OpenMP thread per
# core in each of them: on N cores, N x N threads. An OpenMP thread whose teammates are descheduled
# spins at the next barrier, so oversubscribed processes burn far more CPU than the same work on one
# thread each (docs/notes/2026-11-28-ci-time.md). Each xdist worker therefore takes its share of the
# cores before torch is imported, and the trainings the tests start (`planner run`, torchrun) inherit
# it. A value the user set is kept, and a run without workers keeps torch's default.
def _threads_per_worker() -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1 or "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, (os.cpu_count() or 1) // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if "torch" in sys.modules:  # imported by a plugin before this file: too late for the variable alone
        sys.modules["torch"].set_num_threads(threads)


_threads_per_worker()


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
