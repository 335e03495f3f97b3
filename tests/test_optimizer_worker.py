"""The in-backward update on the optimizer worker ([Note: the optimizer worker] in
runtime/optim/optimizer_worker.py): one thread per optimizer runs the updates in the order their
gradients became final; `optimizer.step()` waits for it, the backward does not; an exception on
it fails the step with its own one-line error, never a hang; it is always joined; the stores are never
used by both threads for one key at once ([Note: one lock per swap space] in runtime/transfer/nvme_store.py).
Bitwise equality with the after-backward step is tests/test_nvme_in_backward.py's."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from runtime_support import ALL_CPU, ALL_DEVICE, ROOT, batches, build_model, plan_doc
from test_nvme_training import ALL_NVME, OPTIMIZER_NVME, SMALL_CHUNKS, assert_bitwise

from runtime.optim.optimizer_worker import OptimizerWorker

IN_BACKWARD = {"optimizer_step": "in_backward"}
WORKER = "tierwise-optimizer"
PLACEMENTS = [(ALL_NVME, "fp32"), (OPTIMIZER_NVME, "bf16"), (ALL_CPU, "fp32")]
PLACEMENT_IDS = ["all-nvme", "optimizer-nvme-bf16", "all-cpu-resident"]


def _sharded(placement: dict[str, str], path: Path | None, **knobs: Any) -> tuple[Any, Any, Any]:
    import runtime
    from runtime.sharding import state_of

    nvme_path = None if placement is ALL_CPU or path is None else str(path)
    doc = plan_doc(placement=placement, nvme_path=nvme_path, **{**SMALL_CHUNKS, "prefetch_depth": 3, **IN_BACKWARD,
                                                                 **knobs})
    model = runtime.shard(build_model("gpt"), doc)
    return model, runtime.AdamW(model, lr=1e-3, weight_decay=0.1), state_of(model)


def _step(model: Any, opt: Any, tokens: torch.Tensor) -> float:
    loss = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _worker_threads(since: frozenset[threading.Thread] = frozenset()) -> list[threading.Thread]:
    """The optimizer worker threads alive now, except those in `since` (alive before the test: another
    test's model still referenced keeps its optimizer's worker; each test checks its own)."""
    return [t for t in threading.enumerate() if t.name == WORKER and t not in since]


def test_worker_runs_jobs_in_submission_order_on_its_own_thread() -> None:
    before = frozenset(_worker_threads())
    worker = OptimizerWorker()
    ran: list[int] = []
    released: list[int] = []
    threads: set[str] = set()

    def job(i: int) -> None:
        if i % 7 == 0:  # uneven jobs: a later, shorter one must still wait for its turn
            time.sleep(0.002)
        ran.append(i)
        threads.add(threading.current_thread().name)

    for i in range(40):
        worker.submit(partial(job, i), partial(released.append, i))
    worker.drain()
    assert ran == list(range(40)) and released == list(range(40))
    assert threads == {WORKER}
    assert worker.idle
    worker.close()
    assert not _worker_threads(before)


def test_a_failed_job_skips_the_rest_releases_their_buffers_and_stays_raised() -> None:
    before = frozenset(_worker_threads())
    worker = OptimizerWorker()
    ran: list[int] = []
    released: list[int] = []

    def job(i: int) -> None:
        if i == 2:
            raise OSError(5, f"injected failure in job {i}")
        ran.append(i)

    with pytest.raises(OSError, match="injected failure in job 2"):
        for i in range(6):
            worker.submit(partial(job, i), partial(released.append, i))
        worker.drain()
    with pytest.raises(OSError, match="injected failure in job 2"):  # the optimizer stays failed
        worker.drain()
    worker.close()
    assert ran == [0, 1]
    assert released == sorted(released) and set(released) == set(range(released[-1] + 1))
    assert not _worker_threads(before)


@pytest.mark.parametrize(("placement", "precision"), PLACEMENTS, ids=PLACEMENT_IDS)
def test_updates_run_on_the_worker_in_the_order_gradients_became_final(placement: dict[str, str], precision: str,
                                                                       tmp_path: Path) -> None:
    before = frozenset(_worker_threads())
    model, opt, st = _sharded(placement, tmp_path, precision=precision)
    final: list[str] = []
    updated: list[tuple[str, str]] = []
    told, update = opt.schedule.gradient_final, opt.engine.update_unit
    opt.schedule.gradient_final = lambda unit, g: (final.append(unit.key), told(unit, g))
    opt.engine.update_unit = lambda unit, g: (update(unit, g), updated.append((unit.key, threading.current_thread().name)))
    for tokens in batches(2):
        _step(model, opt, tokens)
    assert [k for k, _ in updated] == final and len(final) == 2 * len(st.units)
    assert {name for _, name in updated} == {WORKER}
    opt.close()
    st.close()
    assert not _worker_threads(before)


def test_backward_does_not_wait_for_the_updates_and_step_does(tmp_path: Path) -> None:
    """The host waits for the in-backward updates once, in `optimizer.step()`, not at the end of the
    backward ([Note: the transfer path as a GPU program] in runtime/transfer/streams.py): with the
    update of the unit whose gradient is final last (the tied embedding) held back until
    `loss.backward()` has returned, it returns without it, and `step()` returns with every update
    applied, so nothing after it (the next forward's gathers, a checkpoint) can see a shard before
    its update."""
    model, opt, st = _sharded(ALL_NVME, tmp_path)
    engine = opt.engine
    done: list[str] = []
    update = engine.update_unit
    backward_returned = threading.Event()
    last = st.units[0].key

    def last_held_back(unit: Any, gradient: Any) -> None:
        if unit.key == last:
            assert backward_returned.wait(timeout=120), "the backward waited for an update"
        update(unit, gradient)
        done.append(unit.key)

    engine.update_unit = last_held_back
    for step, tokens in enumerate(batches(2), start=1):
        backward_returned.clear()
        loss = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss
        loss.backward()
        assert done.count(last) == step - 1
        backward_returned.set()
        opt.step()
        assert opt.schedule.worker.idle and len(done) == step * len(st.units)
        assert all(int(engine.steps[u.key]) == step for u in st.units)
        opt.zero_grad()
    opt.close()
    st.close()


class StoreTraffic:
    """Every call into a store (and every unit update, which writes the unit's shards) as a span per
    (store, key) and thread; `overlaps` are spans of two threads on one key at once where at least
    one of them changes the key's bytes (a readers-writer check).

    Two reads of one key at once are no race, and they do happen: after updating unit k the worker
    reads ahead the next update's fp32 master (with fp32 parameters on NVMe, the parameter shard
    itself) while the backward's gather may be reading that shard for the same unit's backward.
    Nothing writes the shard until that unit's update, which starts only after its gradient is
    final, i.e. after its gather was waited for and its backward ran; and both calls go through the
    swap space's lock. Flagging read/read (as this did before) failed about 1 run in 5 on that pair."""

    READS = ("read", "read_into")
    WRITES = ("write", "write_from", "accumulate", "zero", "resident")
    """`resident` hands out the in-memory shard for an in-place update: a write."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active: dict[tuple[str, str], Counter[tuple[int, bool]]] = defaultdict(Counter)
        self.overlaps: list[tuple[str, str, str]] = []
        self.shared_reads: list[tuple[str, str]] = []
        """Read/read overlaps (allowed; kept to show what they are)."""
        self.threads: dict[str, set[str]] = defaultdict(set)

    def install(self, stores: list[Any], engine: Any) -> None:
        for store in stores:
            for name in (*self.READS, *self.WRITES):
                setattr(store, name, self._spanned(store.name, name, getattr(store, name)))
        update = engine.update_unit
        engine.update_unit = lambda unit, g: self._span(("params", str(unit.key)), "update", update, unit, g)

    def _spanned(self, store: str, method: str, real: Any) -> Any:
        def call(key: Any, *args: Any, **kwargs: Any) -> Any:
            # A state key names its unit: an update touches all of a unit's shards.
            unit = str(key.unit) if hasattr(key, "unit") else str(key)
            return self._span((store, unit), method, real, key, *args, **kwargs)

        return call

    def _span(self, where: tuple[str, str], what: str, real: Any, *args: Any, **kwargs: Any) -> Any:
        me = threading.get_ident()
        writes = what not in self.READS
        with self._lock:
            others = [(t, w) for (t, w), n in self._active[where].items() if n and t != me]
            if any(writes or w for _, w in others):
                self.overlaps.append((*where, what))
            elif others:
                self.shared_reads.append(where)
            self._active[where][me, writes] += 1
            self.threads[where[0]].add(threading.current_thread().name)
        try:
            return real(*args, **kwargs)
        finally:
            with self._lock:
                self._active[where][me, writes] -= 1


class _FakeStore:
    name = "params"

    def __init__(self) -> None:
        self.inside = threading.Event()
        self.leave = threading.Event()

    def read(self, key: str, *args: Any) -> None:  # noqa: ARG002
        self.inside.set()
        self.leave.wait(timeout=10)

    def write(self, key: str, *args: Any) -> None:
        pass

    read_into = write_from = accumulate = zero = resident = write


@pytest.mark.parametrize(("other", "flagged"), [("read", False), ("write", True)])
def test_the_traffic_check_flags_a_write_beside_a_read_but_not_two_reads(other: str, flagged: bool) -> None:
    store, engine = _FakeStore(), type("Engine", (), {"update_unit": lambda self, unit, g: None})()
    traffic = StoreTraffic()
    traffic.install([store], engine)
    reader = threading.Thread(target=store.read, args=("3:qkv",))
    reader.start()
    assert store.inside.wait(timeout=10)
    getattr(store, other)("3:qkv")
    store.leave.set()
    reader.join()
    assert traffic.overlaps == ([("params", "3:qkv", other)] if flagged else [])
    assert traffic.shared_reads == ([] if flagged else [("params", "3:qkv")])


@pytest.mark.parametrize(("placement", "precision"), PLACEMENTS, ids=PLACEMENT_IDS)
def test_stores_are_never_used_by_both_threads_for_one_key_at_once(placement: dict[str, str], precision: str,
                                                                    tmp_path: Path) -> None:
    model, opt, st = _sharded(placement, tmp_path, precision=precision)
    traffic = StoreTraffic()
    traffic.install(st.stores, opt.engine)
    for tokens in batches(3):
        _step(model, opt, tokens)
    # Both threads really used the parameter store (the backward's gathers, the updates' writes).
    assert {threading.main_thread().name, WORKER} <= traffic.threads["params"]
    assert traffic.overlaps == []
    opt.close()
    st.close()


def test_optimizer_dropped_without_close_joins_its_worker(tmp_path: Path) -> None:
    before = frozenset(_worker_threads())
    model, opt, st = _sharded(ALL_CPU, None)
    _step(model, opt, batches(1)[0])
    assert len(_worker_threads(before)) == 1
    st.detach(opt.schedule)
    del opt
    gc.collect()
    assert not _worker_threads(before)
    st.close()


_FAILING_RUN = """
import errno, json, sys, threading
sys.path.insert(0, {tests!r})
import runtime
from runtime.sharding import state_of
from runtime.optim.streamed_optimizer import StreamedAdamW
from runtime_support import batches, build_model, plan_doc

real = StreamedAdamW._adamw
def failing(self, key, *args):
    if key.index == {fail_index}:
        raise OSError(errno.EIO, f"injected: the update of unit {{key}} failed")
    return real(self, key, *args)
StreamedAdamW._adamw = failing

doc = plan_doc(placement={placement!r}, nvme_path={path!r}, optimizer_step="in_backward",
               optimizer_chunk_bytes=16 * 1024, num_optimizer_buffers=3)
model = runtime.shard(build_model("gpt"), doc)
opt = runtime.AdamW(model, lr=1e-3, weight_decay=0.1)
errors = []
for what, call in [("backward", lambda t: model(input_ids=t[:, :-1], labels=t[:, 1:]).loss.backward()),
                   ("step", lambda t: opt.step()), ("next backward", lambda t: model(input_ids=t[:, :-1], labels=t[:, 1:]).loss.backward())]:
    try:
        call(batches(1)[0])
    except OSError as error:
        errors.append([what, type(error).__name__, str(error)])
opt.close()
state_of(model).close()
print(json.dumps({{"errors": errors, "workers": [t.name for t in threading.enumerate() if t.name == "tierwise-optimizer"]}}))
"""


@pytest.mark.parametrize("fail_index", [0, 9], ids=["last-updated-unit", "an-early-update"])
def test_an_exception_on_the_worker_fails_the_step_in_one_line_without_a_hang(fail_index: int,
                                                                              tmp_path: Path) -> None:
    """An update that raises (here an I/O error, in the update of the unit updated last or of one
    updated early) fails `optimizer.step()`, where the host waits for the updates, with that error,
    and the next forward with the same one-line error; the worker is joined at close, and the
    process exits (a separate process, under a timeout: a hang fails the test instead of hanging the
    suite)."""
    import runtime.gpt  # noqa: F401 - the unit indices below are the test GPT's

    script = _FAILING_RUN.format(tests=str(ROOT / "tests"), fail_index=fail_index, placement=ALL_NVME,
                                 path=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=_env())
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    message = result["errors"][0][2]
    assert "injected: the update of unit" in message and "\n" not in message
    assert result["errors"] == [[what, "OSError", message] for what in ("step", "next backward")]
    assert result["workers"] == []
    assert list(tmp_path.iterdir()) == []


def test_a_process_that_never_closes_its_optimizer_exits(tmp_path: Path) -> None:
    """The worker thread is not a daemon; unclosed, it leaves at interpreter exit, before the
    interpreter tears down what an update uses."""
    script = (f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
              "import runtime\nfrom runtime_support import batches, build_model, plan_doc\n"
              f"doc = plan_doc(placement={ALL_NVME!r}, nvme_path={str(tmp_path)!r}, optimizer_step='in_backward')\n"
              "model = runtime.shard(build_model('gpt'), doc)\nopt = runtime.AdamW(model)\n"
              "t = batches(1)[0]\nmodel(input_ids=t[:, :-1], labels=t[:, 1:]).loss.backward()\nopt.step()\n"
              "print('trained')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "trained"
    assert "terminate called" not in done.stderr


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": str(ROOT)}


# -- on a GPU -----------------------------------------------------------------------------------------

gpu = pytest.mark.gpu

SLOW_BACKWARD_CYCLES = 200_000_000
"""`torch.cuda._sleep` cycles queued by the backward: ~0.1 s at H100 clocks, far longer than the
update of a test unit, so an update that runs while the backward's GPU work does is unambiguous."""


@gpu
def test_backward_gpu_work_continues_while_the_worker_updates(tmp_path: Path) -> None:
    """Property (overlap, measured with CUDA events): the backward queues a long kernel right after
    the gradients of every block are final; with the update on the worker, the update of at least
    one of those units ends while that kernel runs (its start event has completed, its end event has
    not). Updating in the hook instead (the autograd thread copying the gradient off the GPU and
    running Adam) finishes every one of those updates before the kernel is even queued."""
    model, opt, st = _sharded(ALL_NVME, tmp_path)
    embedding = next(m for m in model.modules() if isinstance(m, torch.nn.Embedding))
    marks: dict[str, torch.cuda.Event] = {}

    def slow_backward(grad: torch.Tensor) -> None:
        marks["began"], marks["ended"] = torch.cuda.Event(), torch.cuda.Event()
        marks["began"].record()
        torch.cuda._sleep(SLOW_BACKWARD_CYCLES)
        marks["ended"].record()

    def hook_output(module: Any, args: Any, output: torch.Tensor) -> None:  # noqa: ARG001
        if output.requires_grad:
            output.register_hook(slow_backward)

    embedding.register_forward_hook(hook_output)
    seen: list[tuple[bool, bool]] = []
    update = opt.engine.update_unit

    def observed(unit: Any, gradient: Any) -> None:
        update(unit, gradient)
        if marks:
            seen.append((marks["began"].query(), marks["ended"].query()))

    opt.engine.update_unit = observed
    # The first step loads the step's kernels, which may synchronise the context (and block the
    # worker's CUDA calls) while the long kernel runs: [Note: warm kernels before an overlap is
    # timed] in test_runtime_gpu_cuda_path.py. An H200 saw [(True, True), (True, True)] there.
    for step, tokens in enumerate(batches(3)):
        marks.clear()
        seen.clear()
        _step(model, opt, tokens.cuda())
        if step > 0:
            assert (True, False) in seen, seen
    opt.close()
    st.close()


def in_backward_matches_after_backward(placement: dict[str, str], precision: str, tmp_path: Path) -> None:
    """The in-backward schedule's three steps give the after-backward step's losses and parameters
    bit for bit, on the rank's compute device (CUDA, or the emulated device). With the optimizer
    states on NVMe every gradient byte crosses the link once per step (d2h), staged in
    `GradientStaging`: IN_BACKWARD_STAGED_GRADIENTS pinned buffers of the largest unit's gradient
    shard, each rounded up to 4 KiB, which is what the plan's bill charges a rank for them
    (`gradient_swap_buffers` on hardware whose device memory is its own)."""
    from runtime_support import HARDWARE

    from planner.cost.memory import IN_BACKWARD_STAGED_GRADIENTS, memory_bill
    from planner.specs.units import round_up_4kib

    runs = {}
    for schedule in ("after_backward", "in_backward"):
        model, opt, st = _sharded(placement, tmp_path, precision=precision, optimizer_step=schedule,
                                  hardware={**HARDWARE, "host_is_device": False})
        d2h = []
        losses = []
        for tokens in batches(3):
            before = st.profiler.link_bytes.get("d2h", 0)
            losses.append(_step(model, opt, tokens.to(st.config.device)))
            d2h.append(st.profiler.link_bytes.get("d2h", 0) - before)
        runs[schedule] = (losses, st.full_parameters())
        if schedule == "in_backward" and placement["optimizer_states"] == "nvme":
            grads = [u for u in st.units if u.num_grad_params]
            produced = torch.empty(0, dtype=grads[0].compute_dtype).element_size()
            assert d2h[-1] == sum(u.layout.shard_numel * produced for u in grads)
            staging = st.ledger.usage("cpu").term_peaks.get("gradient_swap_buffers", 0)
            largest = max(u.layout.shard_numel * produced for u in grads)
            billed = memory_bill(st.plan).terms["cpu"]["gradient_swap_buffers"] // st.plan.cluster.gpus_per_node
            assert staging == IN_BACKWARD_STAGED_GRADIENTS * round_up_4kib(largest) == billed, (staging, largest, billed)
        opt.close()
        st.close()
    assert_bitwise(runs["after_backward"], runs["in_backward"])


@pytest.mark.parametrize(("placement", "precision"), [(ALL_NVME, "fp32"), (OPTIMIZER_NVME, "bf16")],
                         ids=["all-nvme", "optimizer-nvme-bf16"])
def test_emulated_device_in_backward_on_the_worker_is_bitwise_after_backward(
        placement: dict[str, str], precision: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA test below, on the emulated device (`CopyEngine.separate_memory_on_cpu`: gradients
    staged off the "device" through the same `GradientStaging`): its checks run in CI."""
    from runtime.transfer.stores import CopyEngine

    monkeypatch.setattr(CopyEngine, "separate_memory_on_cpu", True)
    in_backward_matches_after_backward(placement, precision, tmp_path)


@gpu
@pytest.mark.parametrize(("placement", "precision"), [(ALL_NVME, "fp32"), (OPTIMIZER_NVME, "bf16"),
                                                      (ALL_DEVICE, "bf16")],
                         ids=["all-nvme", "optimizer-nvme-bf16", "all-device-bf16"])
def test_cuda_in_backward_on_the_worker_is_bitwise_after_backward(placement: dict[str, str], precision: str,
                                                                 tmp_path: Path) -> None:
    """Property (bitwise): on the GPU, the updates from gradients staged off the device on the copy
    stream (the worker waits for each copy's event) give the after-backward step's losses and
    parameters bit for bit; every gradient byte crossed the link once per step (d2h), through the
    pinned staging the bill charges (`in_backward_matches_after_backward`). With every state on the
    device the worker queues the update's kernels itself: after the gradient's (an event) and
    before the next forward's (the drain)."""
    in_backward_matches_after_backward(placement, precision, tmp_path)
