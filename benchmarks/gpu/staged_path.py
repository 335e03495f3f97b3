"""Where the CPU tier's forward and backward go on a GPU: the staged host copies, piece by piece, and
a sampled trace of the runtime's threads training a plan.

    python benchmarks/gpu/staged_path.py [--plan PLAN.json [--model CONFIG.json] [--hardware SPEC]] [--steps 5]
                                         [--sampled-steps 2] [--profile gpu|dry] [--out staged.json]

A `--plan` that does not exist yet is fitted first: the planner chain's host-memory plan
(planner_chain.CHAINS["cpu"]: the kit's Llama, every state in host memory) on `--hardware` (a spec
file or preset). `--model` is the Hugging Face config the plan is for (none: the reference GPT).

[Note: why the staged path is timed alone] On the first GPU run (docs/notes/2026-11-26-first-gpu-run.md)
a 1.2 B GPT with every state in host memory trained several times slower forward and backward than
the simulator predicted, its parameters crossing the link far below the probed rate, and nothing in
that run said whether the host memcpy into the pinned staging pool, the DMA,
the pool's waits, the gradients' landing in fp32 host shards, or the optimizer step running beside
the forward sets the pace. So this stage measures each on its own with the runtime's classes
(`micro`), then trains the plan while a sampler records, every millisecond, the innermost frame of
the project's code on every thread (`sampled`: where each thread spends the step, without a
profiler's per-call overhead changing it). Both go into the stage's JSON; the model and the
runtime's fix come after.

`micro` runs on a CPU too (`CopyEngine.separate_memory_on_cpu`: the "device" is host memory), so
the kit's CPU check exercises this script; its numbers there mean nothing for a GPU.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import threading
import time
from pathlib import Path

import torch
from kit import emit

ROOT = Path(__file__).resolve().parents[2]
OWN_CODE = (str(ROOT / "runtime"), str(ROOT / "planner"))
SAMPLE_INTERVAL_S = 0.001
TOP_FRAMES = 25


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rate(nbytes: float, seconds: float) -> float:
    """GB/s to three significant digits (a slow path on a small shard is not rounded to 0)."""
    return float(f"{nbytes / seconds / 1e9:.3g}") if seconds > 0 else float("inf")


def micro(unit_numel: int, units: int, device: torch.device, reps: int = 3) -> dict:
    """GB/s (bytes of the 16-bit tensors moved) of each piece of the staged path, best of `reps`, over
    `units` shards of `unit_numel` bf16 elements, through the runtime's own pool and copy engine."""
    from runtime.transfer.stores import CopyEngine

    try:
        return _micro(unit_numel, units, device, reps)
    finally:
        CopyEngine.separate_memory_on_cpu = False


def _micro(unit_numel: int, units: int, device: torch.device, reps: int) -> dict:
    from planner.cost.memory import PinnedPoolShape, _aligned
    from runtime.transfer.mixed_add import add_into
    from runtime.transfer.pinned_pool import StagingPool
    from runtime.transfer.stores import CopyEngine

    pin_hook = None
    if device.type == "cuda":
        from runtime.nvme.pinning import TorchCudaPinHook

        pin_hook = TorchCudaPinHook()
    else:
        CopyEngine.separate_memory_on_cpu = True
    pool = StagingPool(PinnedPoolShape(buffer_bytes=_aligned(unit_numel * 4), num_buffers=5), pin_hook)
    copier = CopyEngine(device, {}, pool)
    shards = [torch.randn(unit_numel).to(torch.bfloat16) for _ in range(units)]  # pageable, as HostStore's
    masters = [torch.zeros(unit_numel) for _ in range(units)]  # fp32 host gradient shards
    grads = [s.to(device) for s in shards]
    nbytes = units * unit_numel * 2
    buffer = pool.acquire()
    staged = torch.frombuffer(buffer.view, dtype=torch.bfloat16, count=unit_numel)
    on_device = torch.empty(unit_numel, dtype=torch.bfloat16, device=device)

    def best(fn) -> float:  # noqa: ANN001
        times = []
        for _ in range(reps + 1):  # the first is a warm-up
            _synchronize(device)
            start = time.perf_counter()
            fn()
            _synchronize(device)
            times.append(time.perf_counter() - start)
        return min(times[1:])

    def memcpy() -> None:
        for s in shards:
            staged.copy_(s)

    def dma() -> None:
        for _ in shards:
            on_device.copy_(staged, non_blocking=True)

    def through_pool() -> None:
        for s in shards:
            copier.stage_to_device(s)

    def landing(land) -> None:  # noqa: ANN001
        transfers = [copier.to_host(g, lambda piece, at, m=m: land(m[at: at + piece.numel()], piece))
                     for g, m in zip(grads, masters, strict=True)]
        for t in transfers:
            t.finish()

    doc = {"unit_numel": unit_numel, "units": units, "torch_threads": torch.get_num_threads(),
           "memcpy pageable -> pinned GB/s": _rate(nbytes, best(memcpy)),
           "dma pinned -> device GB/s": _rate(nbytes, best(dma))}
    pool.release(buffer)  # the pool's own paths below have all its buffers
    doc |= {"stage_to_device (memcpy + dma through the pool) GB/s": _rate(nbytes, best(through_pool)),
           "to_host, copy into fp32 GB/s": _rate(nbytes, best(lambda: landing(lambda m, p: m.copy_(p)))),
           "to_host, add into fp32 GB/s": _rate(nbytes, best(lambda: landing(add_into)))}
    # The same staging with CPU Adam streaming on another thread, as the runtime's optimizer worker
    # does beside the prefetch when it updates in backward (`optimizer_step: in_backward`).
    param = torch.zeros(units * unit_numel, requires_grad=True)
    param.grad = torch.zeros_like(param)
    adam = torch.optim.AdamW([param], lr=1e-4, fused=True)
    stop = threading.Event()

    def optimizer_load() -> None:
        while not stop.is_set():
            adam.step()

    worker = threading.Thread(target=optimizer_load, daemon=True)
    worker.start()
    try:
        doc["stage_to_device beside CPU Adam GB/s"] = _rate(nbytes, best(through_pool))
    finally:
        stop.set()
        worker.join()
    doc |= _adam_beside_landing(unit_numel, nbytes, best, lambda: landing(add_into))
    pool.close()
    return doc


def _beside(load, timed):  # noqa: ANN001, ANN202 - (() -> None, () -> None) -> (list[int], () -> None)
    """`timed` to run on this thread while `load` runs again and again on another (as the runtime's
    optimizer worker and transfer worker run beside each other); returns the load's completed runs
    (a one-item list, filled when the run ends) and the run."""
    counts = [0]

    def run() -> None:
        stop = threading.Event()

        def loop() -> None:
            while not stop.is_set():
                load()
                counts[0] += 1

        worker = threading.Thread(target=loop, daemon=True)
        worker.start()
        try:
            timed()
        finally:
            stop.set()
            worker.join()

    return counts, run


LANDINGS_TIMED = 3
"""Passes of the landings while AdamW's steps are counted: several of its steps fit in the window."""


def _adam_beside_landing(params: int, nbytes: int, best, land) -> dict:  # noqa: ANN001
    """CPU AdamW's rate alone and while gradients land in fp32 host shards on another thread: what the
    in-backward step's optimizer worker gets beside the transfer worker (the planner prices the two as
    sharing the host memory: planner/sim/resources.py [Note: CPU Adam shares the host memory]); and
    the landing's rate beside AdamW. AdamW (one unit's worth of parameters, so that many of its steps
    fit in the landings' time) runs on the other thread, timed by its completed steps."""
    param = torch.zeros(params, requires_grad=True)
    param.grad = torch.zeros_like(param)
    adam = torch.optim.AdamW([param], lr=1e-4, fused=True)
    alone_s = best(adam.step)

    def landings() -> None:
        for _ in range(LANDINGS_TIMED):
            land()

    landed_s, steps = [], []
    for _ in range(3):
        counts, run = _beside(adam.step, landings)
        start = time.perf_counter()
        run()
        landed_s.append(time.perf_counter() - start)
        steps.append(counts[0])
    # Steps finished while the landings ran, over their time: a lower bound on AdamW's rate beside them.
    beside = max(params * n / t for n, t in zip(steps, landed_s, strict=True))
    return {"CPU AdamW alone G params/s": float(f"{params / alone_s / 1e9:.3g}"),
            "CPU AdamW beside the landing add G params/s (completed steps)": float(f"{beside / 1e9:.3g}"),
            "to_host, add into fp32 beside CPU Adam GB/s": _rate(LANDINGS_TIMED * nbytes, min(landed_s)),
            "AdamW steps completed during the landings": steps}


class FrameSampler:
    """Every SAMPLE_INTERVAL_S, the innermost frame of the project's code on each thread (or the
    innermost frame at all where none is the project's): a count per (thread and the runtime's open
    phase, file:function:line). `phases` says which phases are open ("" between them)."""

    def __init__(self, phases=lambda: "") -> None:  # noqa: ANN001 - () -> str
        self.phases = phases
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="frame-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the sampling (nothing to do if it never started)."""
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join()

    def _run(self) -> None:
        names = {}
        while not self._stop.wait(SAMPLE_INTERVAL_S):
            names.update({t.ident: t.name for t in threading.enumerate()})
            self.samples += 1
            phase = self.phases() or "between phases"
            for ident, frame in sys._current_frames().items():
                if ident == self._thread.ident:
                    continue
                own = frame
                while own is not None and not own.f_code.co_filename.startswith(OWN_CODE):
                    own = own.f_back
                at = own or frame
                where = f"{Path(at.f_code.co_filename).name}:{at.f_code.co_name}:{at.f_lineno}"
                self.counts[f"{names.get(ident, str(ident))} in {phase}"][where] += 1

    def summary(self) -> dict:
        """Per thread and phase: the share of all samples at each frame (top TOP_FRAMES), the
        busiest thread-phases first."""
        ordered = sorted(self.counts.items(), key=lambda kv: -sum(kv[1].values()))
        return {key: {where: round(n / self.samples, 4) for where, n in counter.most_common(TOP_FRAMES)}
                for key, counter in ordered} if self.samples else {}


def sampled(plan_path: Path, steps: int, sampled_steps: int, model: Path | None = None) -> dict:
    """Train the plan `steps` steps (the `model` config, else the reference GPT; synthetic tokens);
    sample the last `sampled_steps`."""
    import runtime
    from planner.specs.plan import load_plan
    from runtime.host_malloc import keep_freed_memory_mapped
    from runtime.launch import batch_for, bind_device, build_model

    keep_freed_memory_mapped()
    device = bind_device()
    plan = load_plan(plan_path)
    built = build_model(plan, argparse.Namespace(seed=0, model=str(model) if model else None, init_from=None))
    model = runtime.shard(built.model, plan, param_init_fn=built.init_fn)
    state = runtime.state_of(model)
    optimizer = runtime.AdamW(model, lr=3e-4, weight_decay=0.1)
    sampler = FrameSampler(lambda: "+".join(state.profiler.open_phases))
    try:
        for step in range(1, steps + 1):
            if step == steps - sampled_steps + 1:
                sampler.start()
            loss = built.loss_fn(model, batch_for(step, 0, plan, built.vocab_size, None, 0).to(device))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            loss.item()
    finally:
        sampler.stop()
        optimizer.close()
        state.close()
    phases = [s.to_dict()["phase_time_s"] for s in list(state.profiler.samples)[-sampled_steps:]]
    return {"plan": str(plan_path), "placement": json.loads(plan_path.read_text()).get("placement"), "steps": steps, "sampled_steps": sampled_steps,
            "phase_time_s": phases, "samples": sampler.samples, "threads": sampler.summary()}


def fit_plan(path: Path, hardware: str, profile: str) -> Path:
    """The planner chain's host-memory plan (its model, first shape and pins), fitted on `hardware`
    to `path`; returns the model config it is for."""
    from planner_chain import CHAINS, model_file, planner

    pins, mode, _ = CHAINS["cpu"]
    config, shape = model_file(mode, profile, path.parent)
    fit = planner("fit", str(config), *shape, "--gpus", "1", "--hardware", hardware, "--precision", "bf16", *pins,
                  "--out", str(path))
    if fit.returncode or not path.exists():
        raise RuntimeError(f"fit: {(fit.stderr or fit.stdout)[-1500:]}")
    return config


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", type=Path, help="a plan with host-memory states (default: micro only)")
    ap.add_argument("--model", type=Path, help="the Hugging Face config --plan is for (default: the reference GPT)")
    ap.add_argument("--hardware", default="h200-x1", help="spec file or preset a missing --plan is fitted on")
    ap.add_argument("--profile", choices=("gpu", "dry"), default="gpu", help="the model size a missing --plan is fitted for")
    ap.add_argument("--unit-numel", type=int, default=2048 * 8192, help="elements per shard (default: a 2048 x 8192 Linear)")
    ap.add_argument("--units", type=int, default=12)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--sampled-steps", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    doc: dict = {"device": str(device)}
    try:
        doc["micro"] = micro(args.unit_numel, args.units, device)
        if args.plan is not None and not args.plan.exists():
            args.model = fit_plan(args.plan, args.hardware, args.profile)
        if args.plan is not None:
            doc["sampled"] = sampled(args.plan, args.steps, args.sampled_steps, args.model)
        doc["ok"] = True
    except Exception as exc:  # the stage reports what broke; the kit goes on with the next stage
        doc |= {"ok": False, "error": f"{type(exc).__name__}: {exc}"[-1500:]}
    return emit(doc, args.out)


if __name__ == "__main__":
    sys.exit(main())
