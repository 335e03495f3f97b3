"""Reference runs: `planner probe` calibrates the spec it measured on the bundled runtime itself.

Where the CPU is the compute device, bare-kernel rates predict the runtime far too fast, and the
runtime's own step is what is stable to measure: the probe trains four small GPTs with the
runtime and fits the spec to them ([Note: probe reference runs], above `REFERENCE_RUNS`), in the
precision whose rate the spec holds ([Note: reference runs in the probed precision], above
`reference_plan`).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from planner.calibration import REFERENCE_REPEATS
from planner.calibration.calibrate import Calibration, calibrate
from planner.specs.hardware import NodeSpec
from planner.specs.plan import Placement, Plan
from planner.specs.profile import Profile

REFERENCE_VOCAB = 256
REFERENCE_STEPS = 8
"""Steps per reference run: two warm-up (runtime/launch.py, WARMUP_STEPS) and six measured. A small
shared machine stalls a step now and then; with three measured steps one slow step moves a run's
mean and the fitted factors with it, and six halve that for a few seconds more probing
(docs/notes/2026-11-22-planner-source-measurements.md)."""


@dataclass(frozen=True, slots=True)
class ReferenceRun:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    seq_len: int
    micro_batch_per_gpu: int
    params: str
    gradients: str
    optimizer_states: str
    recompute_interval: int
    tiling_factor: int = 1


# [Note: probe reference runs]
# A spec made only of bare-kernel rates (a block's matmuls, a tensor copy, fused AdamW, 64 MiB O_DIRECT
# requests) predicts the runtime far too fast where the CPU is the compute device
# (docs/notes/2026-11-22-planner-source-measurements.md). Most of the gap is the memory-bound work of
# a block: torch's layer norm, GELU, softmax and bf16 casts run far below copy bandwidth on a CPU, and
# timing those kernels one by one is not stable, because their cost depends on the shapes and
# kernels around them. What is stable is the runtime's own step. So, where the CPU is the compute
# device, the probe trains `REFERENCE_RUNS` (four small GPTs with the runtime, `planner run`,
# `runtime.launch.WARMUP_STEPS` warm-up steps, the rest measured; each `REFERENCE_REPEATS` times) and
# fits the spec's efficiency parameters to the median run of each with `planner calibrate`'s model
# (planner/calibration/calibrate.py [Note: the calibration model]).
#
# The four runs cover the six fitted terms: an all-on-device run with long sequences (memory-bound
# heavy), a wide one with parameters and optimizer states in host memory (matmul heavy, CPU Adam)
# that does not recompute, so that its backward is the backward alone (what tells the backward's
# matmul rate from the forward's: planner/calibration/calibrate.py [Note: the backward's own matmul rate]), one
# with parameters and optimizer states on NVMe (the swap engine), and a tiled one (tiling 4: four
# times the operators for the same flops and bytes, which is what tells the per-operator cost from
# the rates; without it the fit charges tiling nothing and predicts tiled plans too fast). Their shapes are not those
# of benchmarks/sweep.py, which checks the result on configurations the probe never ran. On a CUDA
# machine these small models would measure launch overhead rather than the GPU, so the probe does not
# run them unless asked (`--calibrate`); its compute model there is the published-run fit of the GPU's
# generation (planner/calibration/fitted_gpus.py [Note: a probed GPU takes its generation's fit]), since
# bare-kernel rates predict a GPU's training step far too fast there.
REFERENCE_RUNS = (
    ReferenceRun("device-long-seq", 4, 384, 6, 512, 2, "gpu", "gpu", "gpu", 1),
    ReferenceRun("host-wide", 4, 1024, 16, 128, 8, "cpu", "cpu", "cpu", 0),
    ReferenceRun("nvme", 4, 640, 10, 256, 4, "nvme", "cpu", "nvme", 1),
    ReferenceRun("device-tiled", 3, 448, 7, 256, 2, "gpu", "gpu", "gpu", 1, tiling_factor=4),
)


def pinned_plan(node: NodeSpec, model: dict, placement: dict[str, str], *, micro_batch_per_gpu: int,
                recompute_interval: int, nvme_path: str, tiling_factor: int = 1, precision: str = "bf16",
                where: str = "plan") -> Plan:
    """A one-GPU plan with every knob pinned, as the runtime is asked to train it here: the probe's
    reference runs and benchmarks/sweep.py's configurations."""
    uses_nvme = Placement.from_dict(placement, f"{where}.placement").uses_nvme
    return Plan.from_dict({
        "model": model, "hardware": node.to_dict(), "num_gpus": 1, "precision": precision, "placement": placement,
        "micro_batch_per_gpu": micro_batch_per_gpu, "recompute_interval": recompute_interval,
        "tiling_factor": tiling_factor, "nvme_path": nvme_path if uses_nvme else None,
    }, where)


# [Note: reference runs in the probed precision]
# The runs train in the precision the spec states its compute rates in (`compute_precision`: on a CPU
# the one that trains fastest of fp32, bf16 and fp16, runtime/probe.py), so the fit scales the rates
# the spec holds (and through their ratios every other precision's: planner/specs/hardware.py [Note:
# a plan's precision prices its compute]), and
# the runs take what the spec says they take. A CPU without bf16 instructions emulates bf16 matmuls
# orders of magnitude slower than fp32, so a bf16 reference run there would outlast the whole probe
# many times over (docs/notes/2026-11-25-calibration-bf16-emulation.md).
def reference_plan(run: ReferenceRun, node: NodeSpec, nvme_path: str, precision: str = "bf16") -> Plan:
    model = {"name": f"probe-{run.name}", "num_layers": run.num_layers, "hidden_size": run.hidden_size,
             "num_heads": run.num_heads, "seq_len": run.seq_len, "vocab_size": REFERENCE_VOCAB}
    placement = {"params": run.params, "gradients": run.gradients, "optimizer_states": run.optimizer_states,
                 "recompute_inputs": "cpu"}
    return pinned_plan(node, model, placement, micro_batch_per_gpu=run.micro_batch_per_gpu,
                       recompute_interval=run.recompute_interval, nvme_path=nvme_path,
                       tiling_factor=run.tiling_factor, precision=precision, where=f"reference run {run.name}")


Train = Callable[[ReferenceRun, Path, int], Profile]
"""Trains the plan saved as `work/<run name>.plan.json` for `steps` steps and returns its profile:
the composition root's `planner run` in its own processes (tierwise/cli/probe.py): the planner
imports neither the runtime nor the CLI, so it is handed the trainer."""


STARTUP_S = 10.0
"""What one training adds to its steps on a 2-core CPU (torchrun, imports, building the model): the
first estimate of the calibrating probe's length ([Note: the calibrating probe's estimate])."""


# [Note: the calibrating probe's estimate]
# Before the first training the time left is what the bare spec predicts: each run's simulated step
# times its steps, plus `STARTUP_S`, times the repeats. The bare spec predicts a CPU device's steps
# fast (what the calibration is for), so after each training the estimate is rescaled by how long
# the trainings so far took against what they were estimated to take.
@dataclass(slots=True)
class Progress:
    """Says `k/N` and the time left before each training of the calibrating probe."""

    estimates_s: list[float]
    """The first estimate of each training, in the order they run."""
    log: Callable[[str], None]
    clock: Callable[[], float] = time.monotonic
    done: int = 0
    started: float = 0.0

    def next(self, what: str) -> None:
        now = self.clock()
        if self.done == 0:
            self.started = now
        spent, estimated = now - self.started, sum(self.estimates_s[:self.done])
        scale = spent / estimated if self.done and estimated > 0 else 1.0
        left = scale * sum(self.estimates_s[self.done:])
        self.done += 1
        self.log(f"{self.done}/{len(self.estimates_s)} {what}; about {_duration(left)} left")


def _duration(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def training_estimate_s(plan: Plan, steps: int) -> float:
    """What one training of `plan` for `steps` steps takes by the spec it was made with."""
    from planner.search.search import predict

    prediction = predict(plan).prediction
    step_s = prediction.iteration_time_s if prediction is not None and prediction.feasible else 0.0
    return STARTUP_S + steps * step_s


def calibrate_on_reference_runs(
    node: NodeSpec, nvme_path: str, *, train: Train, precision: str = "bf16", steps: int = REFERENCE_STEPS,
    repeats: int = REFERENCE_REPEATS, log: Callable[[str], None] = lambda m: None, keep: Path | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Calibration:
    """Train every reference run `repeats` times with `train` (round-robin, so that a slow minute
    hits different runs) in `precision` ([Note: reference runs in the probed precision]), and fit
    `node` to each run's median-time profile, saying `k/N` and the time left before each training
    ([Note: the calibrating probe's estimate]). `keep` (a directory) receives every plan and every
    profile (`<name>.<attempt>.profile.json`), for re-analysing the fit later."""
    measured: dict[str, list[Profile]] = {ref.name: [] for ref in REFERENCE_RUNS}
    plans = {ref.name: reference_plan(ref, node, nvme_path, precision) for ref in REFERENCE_RUNS}
    estimates = {name: training_estimate_s(plan, steps) for name, plan in plans.items()}
    progress = Progress([estimates[ref.name] for _ in range(repeats) for ref in REFERENCE_RUNS], log, clock)
    with tempfile.TemporaryDirectory(prefix="tierwise-probe-") as work:
        for ref in REFERENCE_RUNS:
            plans[ref.name].save(Path(work) / f"{ref.name}.plan.json")
        for attempt in range(repeats):
            for ref in REFERENCE_RUNS:
                progress.next(f"reference run {ref.name} ({attempt + 1} of {repeats}): {ref.num_layers} x hd "
                              f"{ref.hidden_size}, seq {ref.seq_len}, batch {ref.micro_batch_per_gpu}, params "
                              f"{ref.params}, optimizer {ref.optimizer_states}, tiling {ref.tiling_factor}, {precision}")
                measured[ref.name].append(train(ref, Path(work), steps))
                if keep is not None:
                    plans[ref.name].save(keep / f"{ref.name}.plan.json")
                    measured[ref.name][-1].save(keep / f"{ref.name}.{attempt}.profile.json")
    runs = []
    for ref in REFERENCE_RUNS:
        by_time = sorted(measured[ref.name], key=lambda p: p.measured.iteration_time_s)
        runs.append((plans[ref.name], by_time[(len(by_time) - 1) // 2]))
    return calibrate(runs, node)
