"""Runner-ups simulated ahead in a forked worker ([Note: simulated ahead] in planner/sim/ahead.py):
the same answer, bit for bit, as one process alone, and one process where a worker cannot help.

A worker is forked only from a process running one thread, and a test process may hold threads
other tests left (the dashboard's, the runtime's): the checks that fork run in a fresh interpreter
(`in_fresh_process`), told that two cores are free whatever this machine's load."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from search_support import searched

from planner.output.verdict import critical_path, searcher, simulated_runners_up, verdict
from planner.search.refine import refine, runners_ahead_of
from planner.search.search import SearchRequest
from planner.sim import ahead, fast, samples
from planner.specs.catalog import resolve_hardware, resolve_model

FIT_1T = SearchRequest(model=resolve_model("1T"), node=resolve_hardware("dgx-h100"), num_gpus=16)
"""`planner fit 1T --gpus 16`'s question: two plans refined, three runner-ups simulated for the verdict."""


TESTS = Path(__file__).resolve().parent


def in_fresh_process(check: str) -> None:
    """Run this module's function `check` in a fresh interpreter (one thread) where a worker is
    forked even on one core or a busy machine (it is then only slower); its assertions are this test's."""
    code = (f"import sys; sys.path.insert(0, {str(TESTS)!r}); import test_sim_ahead as t; "
            f"t.ahead.usable_cores = lambda: 2; t.ahead.other_runnable_tasks = lambda: 0; t.{check}()")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def shown(result) -> dict:
    """Everything `planner fit`'s verdict prints, as data: the ranked plans, the winner's critical
    path, the runner-ups and their bottlenecks."""
    seen = verdict(result, searcher(result.request))
    return {"ranked": [plan.to_dict() for plan in result.ranked], "path": seen.path.sentence(),
            "runners": [plan.to_dict() for plan in seen.runners], "bottlenecks": seen.runner_bottlenecks}


def test_the_runner_ups_simulated_for_the_verdict_are_the_workers_tasks():
    result = refine(searched(FIT_1T))
    tasks = {samples.sample_key(plan) for plan in runners_ahead_of(searched(FIT_1T))}
    simulated_for_verdict = [plan for plan in result.runners_up() if plan.prediction.method == "analytic"]
    assert len(simulated_for_verdict) == 3
    assert {samples.sample_key(plan) for plan in simulated_for_verdict} <= tasks
    assert len(tasks) == 4  # the fourth, the second placement, is refined: simulated either way


def check_verdict_with_a_worker() -> None:
    alone = shown(refine(searched(FIT_1T)))
    samples.forget_samples()
    with_worker = refine(searched(FIT_1T), runners_ahead=True)
    assert ahead._worker is not None  # noqa: SLF001 - a worker runs: refine settled one of its four tasks
    assert shown(with_worker) == alone


def test_verdict_with_a_worker_is_the_verdict_of_one_process():
    in_fresh_process("check_verdict_with_a_worker")


@pytest.mark.parametrize("loadavg,others", [("0.52 0.40 0.31 1/112 2567\n", 0), ("5.22 4.29 3.04 7/112 25303\n", 6),
                                              ("", 0), ("no numbers here", 0)])
def test_other_runnable_tasks_are_the_kernels_count_less_this_process(monkeypatch, loadavg, others):
    class Loadavg:
        def __init__(self, path: str) -> None:
            assert path == "/proc/loadavg"

        def read_text(self) -> str:
            return loadavg

    monkeypatch.setattr(ahead, "Path", Loadavg)
    assert ahead.other_runnable_tasks() == others


def check_adopted_not_simulated_again() -> None:
    plans = runners_ahead_of(searched(FIT_1T))
    alone = [fast.predict(plan).to_dict() for plan in plans]
    samples.forget_samples()
    assert ahead.start(plans, fast.predict)
    os.waitpid(ahead._worker.pid, 0)  # noqa: SLF001 - it has claimed and simulated every task

    def no_simulation(*args, **kwargs):
        raise AssertionError("simulated again")

    samples.Simulation = samples.simulate = no_simulation
    assert [fast.predict(plan).to_dict() for plan in plans] == alone
    assert ahead._worker is None  # noqa: SLF001 - every task settled: the worker is reaped
    winner = plans[-1].replace(prediction=fast.predict(plans[-1]))
    assert critical_path(winner).sentence()  # from the adopted samples


def test_plans_the_worker_simulated_are_adopted_not_simulated_again():
    in_fresh_process("check_adopted_not_simulated_again")


def check_a_worker_that_dies() -> None:
    plans = runners_ahead_of(searched(FIT_1T))[-2:]
    alone = [fast.predict(plan).to_dict() for plan in plans]
    samples.forget_samples()
    assert ahead.start(plans, fast.predict)
    os.kill(ahead._worker.pid, signal.SIGKILL)  # noqa: SLF001
    assert [fast.predict(plan).to_dict() for plan in plans] == alone


def test_a_worker_that_dies_leaves_its_tasks_to_this_process():
    in_fresh_process("check_a_worker_that_dies")


def test_no_worker_on_one_core_on_a_busy_machine_or_beside_other_threads(monkeypatch):
    plans = runners_ahead_of(searched(FIT_1T))
    monkeypatch.setattr(threading, "active_count", lambda: 1)
    monkeypatch.setattr(ahead, "other_runnable_tasks", lambda: 0)
    monkeypatch.setattr(ahead, "usable_cores", lambda: 1)
    assert not ahead.can_fork() and not ahead.start(plans, fast.predict)
    monkeypatch.setattr(ahead, "usable_cores", lambda: 2)
    monkeypatch.setattr(ahead, "other_runnable_tasks", lambda: 1)  # the second core is taken
    assert not ahead.can_fork() and not ahead.start(plans, fast.predict)
    monkeypatch.setattr(ahead, "usable_cores", lambda: 4)
    assert ahead.can_fork() == hasattr(os, "fork")
    monkeypatch.setattr(ahead, "usable_cores", lambda: 2)
    monkeypatch.setattr(ahead, "other_runnable_tasks", lambda: 0)
    assert ahead.can_fork() == hasattr(os, "fork")
    monkeypatch.setattr(threading, "active_count", lambda: 2)  # a thread beside the main one
    assert not ahead.can_fork() and not ahead.start(plans, fast.predict)
    assert ahead._worker is None  # noqa: SLF001


def _fit_text(*, one_core: bool) -> str:
    """`planner fit 1T --gpus 16`'s output, from a process that may use every core here or only one
    (where it may use one, no worker is forked)."""
    def pin() -> None:
        if one_core:
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})

    done = subprocess.run([sys.executable, "-m", "tierwise", "fit", "1T", "--gpus", "16"], capture_output=True,
                          text=True, timeout=120, preexec_fn=pin)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_fit_prints_the_same_with_a_worker_as_in_one_process():
    assert _fit_text(one_core=False) == _fit_text(one_core=True)


def check_simulated_runners_up() -> None:
    result = refine(searched(FIT_1T))
    alone = [plan.to_dict() for plan in simulated_runners_up(result)]
    samples.forget_samples()
    result = refine(searched(FIT_1T), runners_ahead=True)
    assert ahead._worker is not None  # noqa: SLF001
    assert [plan.to_dict() for plan in simulated_runners_up(result)] == alone


def test_simulated_runners_up_unchanged_by_a_worker():
    in_fresh_process("check_simulated_runners_up")
